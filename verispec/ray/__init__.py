"""verispec replicas on Ray Serve (the optional extra: pip install 'verispec[ray]').

    app.py           build_app (the Ray Serve application) and `verispec serve --replicas N`
    front_door.py    the ingress deployment: reads the body, routes, relays; /health, /metrics
    replica.py       ReplicaServer: one engine core process + the single server's Starlette app
    bridge.py        an HTTP request and its streamed response as picklable values
    router.py        PrefixAffinityRouter, a ray.serve.request_router.RequestRouter
    prefix_index.py  the routing rule and per-replica prefix index (pure Python)
    metrics.py       replicas' /metrics merged: labelled by replica, or summed

Only `add_arguments` is importable without Ray installed.
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`verispec serve` flags that deploy replicas on Ray Serve."""
    g = parser.add_argument_group("replicas (Ray Serve; docs/serving.md, 'Replicas on Ray Serve')")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas as a Ray Serve application (needs "
                        "pip install 'verispec[ray]'); each takes --threads CPUs, or one GPU")
    g.add_argument("--routing", choices=["prefix", "ray"], default="prefix",
                   help="with --replicas: send a request to the replica holding its prompt's "
                        "prefix ('prefix'), or use Ray Serve's default power-of-two-choices router")
    g.add_argument("--ray-address", default=None,
                   help="with --replicas: the Ray cluster to deploy on ('auto': the one this "
                        "node joined; default: start a local one)")
