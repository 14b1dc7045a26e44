"""Replicas on Ray Serve: prefix-aware routing vs Ray's default routing vs one replica (issue 55).

Two-turn MT-bench chats: turn 1 is sent; when its answer is complete, turn 2 is sent with
that answer in the history, as a chat client does. C conversations are in flight at once
(a closed loop), greedy, streamed through the front door over HTTP. Contenders, deployed
one after another on one local Ray cluster, each fresh (cold caches), warmed up on other
conversations, then measured on the same ones, in an order rotated per repeat:

  prefix   2 replicas x 1 thread, PrefixAffinityRouter (verispec/ray/router.py)
  ray      2 replicas x 1 thread, Ray Serve's default router (power of two choices)
  single   1 replica x 2 threads

Per contender: turn-2 TTFT (median, p90), the turn-2 prefix hit rate (the responses'
usage.prompt_tokens_details.cached_tokens over their prompt tokens; the engines' own
counters, /metrics/aggregate deltas, are recorded beside it), completion tokens/s over the
wall time of the measured run. The result JSON records each contender's resolved engine
config as its replicas run it.

    .venv/bin/python bench/ray_serve.py                 # the full run
    .venv/bin/python bench/ray_serve.py --quick         # a smoke run (minutes)
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402
from verispec.bench.client import ChatRequest, OpenAIHTTPBackend  # noqa: E402
from verispec.bench.metrics_scrape import Sample, counter_delta, parse_metrics  # noqa: E402
from verispec.config import EngineConfig  # noqa: E402

CONTENDERS = {"prefix": (2, 1, "prefix"), "ray": (2, 1, "ray"), "single": (1, 2, "prefix")}  # replicas, threads, routing
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:generation_tokens_total")


@dataclass
class Turn:
    conversation: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    e2e_s: float


def turn_of(conv_id: str, turn: int, r) -> Turn:
    if r.error is not None:
        raise RuntimeError(f"conversation {conv_id} turn {turn} failed: {r.error.to_dict()}")
    first = next((e.t for e in r.events if e.text), r.e2e_s)   # an empty answer: its end
    cached = (r.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Turn(conv_id, turn, r.usage["prompt_tokens"], cached, r.usage["completion_tokens"], first, r.e2e_s)


async def run_conversations(url: str, model: str, convs, concurrency: int, max_tokens: int) -> list[Turn]:
    """Closed loop: `concurrency` conversations in flight, turn 2 sent when turn 1 is done."""
    backend = OpenAIHTTPBackend(f"{url}/v1", continuous_usage=False)
    gate = asyncio.Semaphore(concurrency)

    async def one(conv) -> list[Turn]:
        async with gate:
            messages = tuple(conv.messages)
            r1 = await backend.chat(ChatRequest(messages, model, max_tokens, 0.0))
            t1 = turn_of(conv.prompt_id, 1, r1)
            messages += ({"role": "assistant", "content": r1.text}, {"role": "user", "content": conv.followups[0]})
            return [t1, turn_of(conv.prompt_id, 2, await backend.chat(ChatRequest(messages, model, max_tokens, 0.0)))]
    try:
        return [t for pair in await asyncio.gather(*(one(c) for c in convs)) for t in pair]
    finally:
        await backend.aclose()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> list[Sample]:
    """The samples of the replicas' summed /metrics (one server's format)."""
    return parse_metrics(httpx.get(f"{url}/metrics/aggregate", timeout=30).text)


def run_contender(name: str, port: int, measured, warm, args) -> dict:
    """Deploy one contender, warm it, measure it, remove it."""
    from ray import serve
    from verispec.ray.app import APP_NAME, ReplicaConfig, build_app
    from verispec.server.app import ServerConfig

    replicas, threads, routing = CONTENDERS[name]
    url = f"http://127.0.0.1:{port}"
    engine = EngineConfig(model=args.model, threads=threads, device="cpu")
    server = ServerConfig(port=port, log_level="warning", access_log=False)
    serve.run(build_app(engine, server, ReplicaConfig(replicas, routing)), name=APP_NAME, route_prefix="/")
    try:
        described = serve.get_deployment_handle("VerispecReplica", APP_NAME).broadcast("describe").results(timeout_s=60)
        asyncio.run(run_conversations(url, args.model, warm, args.concurrency, min(16, args.max_tokens)))
        before, cpu0, t0 = scrape(url), common.cpu_sample(), time.perf_counter()
        turns = asyncio.run(run_conversations(url, args.model, measured, args.concurrency, args.max_tokens))
        wall, others = time.perf_counter() - t0, common.others_cpu_share(cpu0, common.cpu_sample())
        after = scrape(url)
    finally:
        serve.delete(APP_NAME)
    return {"replicas": replicas, "threads_per_replica": threads, "routing": routing,
            "engine_config": described[0]["config"], "wall_s": wall, "others_cpu_share": others,
            # a counter missing from the scrape, or reset during the run, is None, never 0
            "metrics_delta": {k: counter_delta(before, after, k).total for k in COUNTERS},
            "summary": summarise(turns, wall), "turns": [t.__dict__ for t in turns]}


def summarise(turns: list[Turn], wall_s: float) -> dict:
    t2 = [t for t in turns if t.turn == 2]
    ttft = sorted(t.ttft_s for t in t2)
    return {"turn2_ttft_median_s": statistics.median(ttft), "turn2_ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "turn2_hit_rate": sum(t.cached_tokens for t in t2) / sum(t.prompt_tokens for t in t2),
            "tokens_per_s": sum(t.completion_tokens for t in turns) / wall_s}


def table(runs: list[dict]) -> str:
    rows = []
    for name in CONTENDERS:
        s = [run[name]["summary"] for run in runs]
        rows.append([name, statistics.median(x["turn2_ttft_median_s"] for x in s),
                     statistics.median(x["turn2_ttft_p90_s"] for x in s),
                     statistics.median(x["turn2_hit_rate"] for x in s), statistics.median(x["tokens_per_s"] for x in s)])
    return common.markdown_table(["contender", "turn-2 TTFT median s", "turn-2 TTFT p90 s",
                                  "turn-2 prefix hit rate", "tokens/s"], rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    p.add_argument("--num-prompts", type=int, default=32, help="measured conversations per contender")
    p.add_argument("--num-warmup", type=int, default=4, help="warm-up conversations per contender")
    p.add_argument("--max-tokens", type=int, default=128, help="max tokens of each turn's answer")
    p.add_argument("--repeats", type=int, default=2, help="runs of every contender (order rotated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 conversations, 16 tokens, 1 repeat")
    p.add_argument("--max-load", type=float, default=1.3, help="start only below this 1-min load average")
    p.add_argument("--wait-quiet-s", type=float, default=300.0)
    p.add_argument("--allow-noisy", action="store_true", help="run even if the machine never got quiet")
    p.add_argument("--port", type=int, default=0, help="Serve's HTTP port (default: a free one)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/ray_serve.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.num_warmup, args.max_tokens, args.repeats = 4, 1, 16, 1
    return args


def main(argv=None) -> int:
    import ray
    from ray import serve

    args = parse_args(argv)
    t0 = time.perf_counter()
    quiet = common.wait_for_quiet(args.max_load, args.wait_quiet_s) if not args.quick else {"quiet": None}
    if quiet["quiet"] is False and not args.allow_noisy:
        raise SystemExit(f"machine not quiet after {quiet['waited_s']} s (use --allow-noisy to record anyway)")
    header = {"argv": sys.argv, "started": common.now_iso(), "machine_load": quiet, **common.provenance()}
    measured, warm, sources = common.pick_prompts(["mtbench"], args.num_prompts, args.num_warmup,
                                                  seed=args.seed, split="eval")
    port = args.port or free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    runs = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        names = list(CONTENDERS)
        for r in range(args.repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            runs.append({n: run_contender(n, port, measured, warm, args) for n in order})
            for n in order:
                print(f"[ray_serve] repeat {r} {n}: {runs[-1][n]['summary']}", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    text = table(runs)
    print(text)
    payload = {"benchmark": "ray_serve", "schema": "verispec.bench.ray-serve/v1", **common.finish_run(header, t0),
               "settings": {"model": args.model, "temperature": 0.0, "max_tokens": args.max_tokens,
                            "concurrency": args.concurrency, "num_prompts": args.num_prompts,
                            "num_warmup": args.num_warmup, "repeats": args.repeats, "quick": args.quick,
                            "contenders": {n: dict(zip(("replicas", "threads", "routing"), v))
                                           for n, v in CONTENDERS.items()},
                            "conversation_ids": [p.prompt_id for p in measured], "datasets": sources},
               "runs": runs, "table_markdown": text}
    name = "ray_serve_quick" if args.quick else "ray_serve"
    common.write_json(args.out or common.RESULTS_DIR / f"{name}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
