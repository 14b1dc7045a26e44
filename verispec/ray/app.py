"""`verispec serve --replicas N`: N engine replicas as one Ray Serve application.

    HTTP -> Ray Serve proxy -> FrontDoor (1 replica, no CPU reserved)
              -> DeploymentHandle, routed by PrefixAffinityRouter ("prefix") or Ray's
                 power-of-two-choices router ("ray")
              -> ReplicaServer x N (each: --threads CPUs, or one GPU; its engine core process)

`build_app` makes the application (tests and `bench/ray_serve.py` deploy it with
`serve.run`); `serve_replicas` is the CLI: it joins or starts a Ray cluster, deploys, and
serves until SIGINT/SIGTERM, then shuts Serve down (each replica drains its engine).
"""
from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field, replace

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from verispec.config import EngineConfig, physical_cores
from verispec.ray.front_door import FrontDoor
from verispec.ray.replica import ReplicaServer
from verispec.server.app import ServerConfig

log = logging.getLogger("verispec.ray")

APP_NAME = "verispec"
ROUTINGS = ("prefix", "ray")
PREFIX_ROUTER = "verispec.ray.router:PrefixAffinityRouter"
HEALTH_CHECK_PERIOD_S = 2.0   # how soon a replica whose engine died stops getting requests
ROUTING_STATS_PERIOD_S = 1.0  # how often replicas report their cached block keys to the router


@dataclass(frozen=True)
class ReplicaConfig:
    """How the engine is replicated (the engine and server settings are separate)."""

    replicas: int = 1
    routing: str = "prefix"
    router_kwargs: dict = field(default_factory=dict)   # PrefixAffinityRouter.initialize_state
    ray_address: str | None = None                      # None: start a local cluster

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")


def replica_resources(engine: EngineConfig) -> dict:
    """Ray actor options of one replica: its engine's threads as CPUs, or one GPU."""
    if engine.device.startswith("cuda"):
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": engine.threads, "num_gpus": 0}


def resolve_engine(engine: EngineConfig, replicas: int, cluster_gpus: float) -> EngineConfig:
    """`device: auto` pinned to what the cluster has, and unset threads shared out: the
    resolved config is what every replica runs (and what benchmark results record)."""
    if engine.device == "auto":
        engine = replace(engine, device="cuda" if cluster_gpus >= replicas else "cpu")
    if engine.threads is None:
        engine = replace(engine, threads=max(1, physical_cores() // replicas))
    return engine


def build_app(engine: EngineConfig, server: ServerConfig, config: ReplicaConfig):
    """The Ray Serve application: the front door bound to N replicas of `engine`."""
    by_prefix = config.routing == "prefix"
    router = RequestRouterConfig(request_router_class=PREFIX_ROUTER, request_router_kwargs=config.router_kwargs,
                                 request_routing_stats_period_s=ROUTING_STATS_PERIOD_S) \
        if by_prefix else RequestRouterConfig()
    replicas = serve.deployment(ReplicaServer).options(
        name="VerispecReplica", num_replicas=config.replicas, ray_actor_options=replica_resources(engine),
        # the engine queues and batches; Ray should not hold requests back from it
        max_ongoing_requests=server.max_waiting + engine.scheduler.max_num_seqs,
        request_router_config=router, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=server.shutdown_timeout_s + 5)
    front = serve.deployment(FrontDoor).options(
        name="VerispecFrontDoor", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=server.max_connections)
    return front.bind(replicas.bind(engine, server), server, by_prefix)


def check_fits(engine: EngineConfig, replicas: int) -> None:
    """Refuse at once a deployment the cluster cannot place (Ray would wait forever)."""
    need = replica_resources(engine)
    have = ray.cluster_resources()
    for key, ray_key in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        total = need[key] * replicas
        if total > have.get(ray_key, 0):
            raise ValueError(f"{replicas} replicas need {total:g} {ray_key} ({need[key]:g} each: "
                             f"--threads, or one GPU with --device cuda); the Ray cluster has "
                             f"{have.get(ray_key, 0):g}")


def serve_replicas(engine: EngineConfig, args) -> int:
    """The CLI: deploy on the cluster at --ray-address (default: a new local one) and serve
    until SIGINT/SIGTERM."""
    server = ServerConfig.from_args(args)
    config = ReplicaConfig(args.replicas, args.routing, ray_address=args.ray_address)
    ray.init(address=config.ray_address, logging_level=logging.WARNING)
    try:
        engine = resolve_engine(engine, config.replicas, ray.cluster_resources().get("GPU", 0))
        check_fits(engine, config.replicas)
        logging_config = {"log_level": server.log_level.upper(), "enable_access_log": server.access_log}
        serve.start(http_options={"host": server.host, "port": server.port,
                                  "keep_alive_timeout_s": server.keep_alive_timeout_s},
                    logging_config=logging_config)
        serve.run(build_app(engine, server, config), name=APP_NAME, route_prefix="/",
                  logging_config=logging_config)
        log.info("serving %d replica(s) of %s on http://%s:%d (routing: %s; engine config: %s)",
                 config.replicas, engine.model, server.host, server.port, config.routing, engine.to_dict())
        _wait_for_signal()
    finally:
        if config.ray_address is None:
            serve.shutdown()   # our own cluster: Serve and Ray go with us
        else:
            serve.delete(APP_NAME)   # someone else's cluster: remove only our application
        ray.shutdown()
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
