"""Serving benchmark: verispec as users meet it (`verispec serve` + an HTTP client), against
the same engine in-process and against llama.cpp's llama-server (docs/benchmarks.md, "Serving").

Every contender runs the same prompts (the evaluation half of each dataset, split by id:
`eval_half`), greedy, `--max-tokens` each, with C requests in flight (a closed loop: a
finished request is replaced at once), one contender at a time, in an order shuffled per
repeat. Contenders, named KIND:MODE:

  inproc:none|ngram      LLMEngine stepped on the main thread of a child process, no server,
                         the configuration `verispec serve --spec MODE --serve-args` resolves to
  serve:none|ngram       `verispec serve --spec MODE`, otherwise default settings; streamed
                         through the evidence client (verispec.bench.client) with usage
  post:none|ngram        the same server, non-streaming POSTs
  llama:plain|ngram-*    llama-server (--llama-server-bin) on the same GGUF, threads, and the
                         model's own chat template, -np C; its n-gram modes (--spec-type MODE)
                         get a fresh server per request (they learn across requests), C = 1 only

A peer's failed request (llama-server in an n-gram mode sometimes closes the connection
without an answer) is counted in the table and left out of its rate; verispec's fail the run.
tokens/s is completion tokens over wall seconds from the first request sent to the last
answer; at C = 1 over the sum of the requests' own seconds (a fresh server's start-up is
not the contender's time). Ratios are taken within a repeat and the table shows their
median. Greedy outputs are compared with `serve:none`'s, prompt by prompt.

    .venv/bin/python bench/serving.py --contenders inproc:none,serve:none,post:none,llama:plain \
        --concurrency 1,4,16 --llama-server-bin PATH
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402
from verispec.bench.client import ChatRequest, OpenAIHTTPBackend  # noqa: E402
from verispec.bench.datasets import BenchPrompt, load_datasets  # noqa: E402
from verispec.bench.launch import (FreshServerBackend, launched_llama_server,  # noqa: E402
                                   launched_server, llama_server_spec)
from verispec.config import EngineConfig, add_engine_arguments, config_from_args  # noqa: E402


@dataclass
class Answer:
    prompt_id: str
    text: str
    completion_tokens: int
    seconds: float          # sent -> last byte
    ttft_s: float | None
    decode_tps: float | None


def eval_half(prompts: list[BenchPrompt], evaluation: bool = True) -> list[BenchPrompt]:
    """The evaluation half of a dataset: prompts whose id hashes odd; the even half
    (evaluation=False) is for tuning, and here for warm-ups, which are never measured."""
    return [p for p in prompts
            if int(hashlib.sha256(f"{p.dataset}:{p.prompt_id}".encode()).hexdigest(), 16) % 2 == evaluation]


def pick(datasets: str, per_dataset: int, seed: int, evaluation: bool = True) -> list[BenchPrompt]:
    """`per_dataset` prompts of each dataset's evaluation (or tuning) half, seeded."""
    by_name, _ = load_datasets(datasets)
    picked = []
    for name, prompts in by_name.items():
        half = eval_half(prompts, evaluation)
        random.Random(f"{seed}:{name}").shuffle(half)
        picked.extend(half[:per_dataset])
    return picked


# ---------------------------------------------------------------- in-process contender
def serve_config(mode: str, serve_args: str) -> EngineConfig:
    """The EngineConfig `verispec serve --spec MODE SERVE_ARGS` runs (same parser, same threads)."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args, _ = parser.parse_known_args(["--spec", mode, *shlex.split(serve_args)])
    return config_from_args(args).resolved_for("serve")


def _inproc_child(config: EngineConfig, conversations: list[list[dict]], warm: list[list[dict]],
                  concurrency: int, max_tokens: int) -> dict:
    from verispec.engine.engine import LLMEngine
    from verispec.sampling import SamplingParams
    engine = LLMEngine.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    _closed_loop(engine, warm, concurrency, params)
    t0 = time.perf_counter()
    answers = _closed_loop(engine, conversations, concurrency, params)
    return {"wall_s": time.perf_counter() - t0, "answers": answers, "config": engine.config.to_dict()}


def _closed_loop(engine, conversations: list[list[dict]], concurrency: int, params) -> list[tuple]:
    queue = list(enumerate(conversations))
    live: dict[str, tuple[int, float, float | None]] = {}
    done = []
    while queue or live:
        while queue and len(live) < concurrency:
            i, messages = queue.pop(0)
            engine.add_request(str(i), engine.tokenizer.encode_chat(messages), params)
            live[str(i)] = (i, time.perf_counter(), None)
        for out in engine.step():
            i, t_add, t_first = live[out.request_id]
            now = time.perf_counter()
            if t_first is None and out.new_token_ids:
                live[out.request_id] = (i, t_add, now)
                t_first = now
            if out.finished:
                n = len(out.token_ids)
                decode = (n - 1) / (now - t_first) if n > 1 and now > t_first else None
                done.append((i, out.text, n, now - t_add, t_first - t_add, decode))
                del live[out.request_id]
    return sorted(done)


def run_inproc(config: EngineConfig, prompts: list[BenchPrompt], warm: list[BenchPrompt], concurrency: int,
               max_tokens: int) -> tuple[list[Answer], float, dict]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # a fresh process: the engine on its main thread, nothing else
        r = pool.apply(_inproc_child, (config, [list(p.messages) for p in prompts],
                                       [list(p.messages) for p in warm], concurrency, max_tokens))
    answers = [Answer(_key(prompts[i]), text, n, s, ttft, dec) for i, text, n, s, ttft, dec in r["answers"]]
    return answers, r["wall_s"], r["config"]


# ---------------------------------------------------------------- HTTP contenders
async def run_http(target, prompts: list[BenchPrompt], concurrency: int, max_tokens: int,
                   stream: bool, failures: list[str] | None = None) -> tuple[list[Answer], float]:
    """target: a base URL, or a LlamaServer to start afresh for every request. A failed
    request raises, unless `failures` is given (peers): then it is listed there and left out."""
    # a new connection per request for every contender: llama-server drops kept-alive ones
    backend = OpenAIHTTPBackend(target, keepalive=False) if isinstance(target, str) else FreshServerBackend(target)
    try:
        model = (await backend.list_models())[0]
        queue = list(prompts)
        answers: list[Answer] = []

        async def worker():
            while queue:
                p = queue.pop(0)
                request = ChatRequest(tuple(p.messages), model, max_tokens, 0.0)
                try:
                    answer = await (_streamed(backend, p, request) if stream else _posted(target, p, request))
                except RuntimeError as exc:
                    if failures is None:
                        raise
                    failures.append(str(exc))
                    continue
                answers.append(answer)

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return answers, time.perf_counter() - t0
    finally:
        await backend.aclose()


async def _streamed(backend, p: BenchPrompt, request: ChatRequest) -> Answer:
    r = await backend.chat(request)
    if r.error is not None:
        raise RuntimeError(f"{_key(p)}: {r.error}")
    n = r.usage["completion_tokens"]
    times = [e.t for e in r.events if e.text]
    decode = (n - 1) / (times[-1] - times[0]) if n > 1 and len(times) > 1 and times[-1] > times[0] else None
    return Answer(_key(p), r.text, n, r.e2e_s, times[0] if times else None, decode)


async def _posted(base_url: str, p: BenchPrompt, request: ChatRequest) -> Answer:
    import httpx
    body = {"model": request.model, "messages": list(request.messages), "max_tokens": request.max_tokens,
            "temperature": 0.0}
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        r = await client.post(f"{base_url}/chat/completions", json=body)
        seconds = time.perf_counter() - t0
    r.raise_for_status()
    d = r.json()
    return Answer(_key(p), d["choices"][0]["message"]["content"], d["usage"]["completion_tokens"],
                  seconds, None, None)


def _key(p: BenchPrompt) -> str:
    return f"{p.dataset}:{p.prompt_id}"


# ---------------------------------------------------------------- the run
@contextlib.contextmanager
def started(name: str, args, concurrency: int):
    """What run_http needs for a contender (a base URL, or a LlamaServer to start per
    request), with its server running for the block: a fresh one for every run, as the
    in-process contender gets a fresh engine (a prefix cache warm from an earlier repeat
    would make the next repeat of the same prompts cheaper)."""
    kind, mode = name.split(":")
    if kind in ("serve", "post"):
        with launched_server(f"--spec {mode} {args.serve_args}") as url:
            yield url
        return
    spec = llama_server_spec("" if mode == "plain" else f"--spec-type {mode}", args.llama_server_bin,
                             None, None, concurrency)
    if mode == "plain":
        with launched_llama_server(spec) as url:
            yield url
        return
    if concurrency != 1:
        raise SystemExit(f"{name}: n-gram modes run a fresh server per request, at concurrency 1 only")
    yield spec


def measure(args, concurrency: int, prompts, warm) -> dict:
    names = args.contenders
    runs = {n: [] for n in names}
    configs = {}
    for repeat in range(args.repeats):
        order = list(names)
        random.Random(f"{args.seed}:{concurrency}:{repeat}").shuffle(order)
        for name in order:
            failures: list[str] | None = [] if name.startswith("llama") else None  # verispec must not fail
            if name.startswith("inproc"):
                config = serve_config(name.split(":")[1], args.serve_args)
                answers, wall, configs[name] = run_inproc(config, prompts, warm, concurrency, args.max_tokens)
            else:
                stream = not name.startswith("post")
                try:
                    with started(name, args, concurrency) as target:
                        asyncio.run(run_http(target, warm, concurrency, args.max_tokens, stream, failures))
                        answers, wall = asyncio.run(run_http(target, prompts, concurrency, args.max_tokens,
                                                             stream, failures))
                except Exception as exc:
                    raise RuntimeError(f"{name} at {concurrency} in flight, repeat {repeat}: {exc}") from exc
            seconds = sum(a.seconds for a in answers) if concurrency == 1 else wall
            runs[name].append({"tokens_per_s": sum(a.completion_tokens for a in answers) / seconds,
                               "answers": [a.__dict__ for a in answers], "failures": failures or []})
            print(f"[serving] C={concurrency} repeat {repeat} {name}: "
                  f"{runs[name][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return {"concurrency": concurrency, "runs": runs, "inproc_configs": configs}


def summarise(result: dict, reference: str) -> list[dict]:
    runs = result["runs"]
    ref_texts = {a["prompt_id"]: a["text"] for a in runs[reference][0]["answers"]} if reference in runs else {}
    rows = []
    for name, reps in runs.items():
        answers = [a for r in reps for a in r["answers"]]
        ttft = [a["ttft_s"] for a in answers if a["ttft_s"] is not None]
        decode = [a["decode_tps"] for a in answers if a["decode_tps"]]
        same = sum(a["text"] == ref_texts.get(a["prompt_id"]) for a in reps[0]["answers"])
        rows.append({"contender": name, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps),
                     "repeats": [round(r["tokens_per_s"], 1) for r in reps],
                     "ttft_ms_median": 1e3 * statistics.median(ttft) if ttft else None,
                     "decode_tps_median": statistics.median(decode) if decode else None,
                     "identical_to_reference": f"{same}/{len(reps[0]['answers'])}" if ref_texts else None,
                     "failed_requests": sum(len(r.get("failures", [])) for r in reps),
                     "ratio_to_reference": _paired_ratio(reps, runs.get(reference))})
    return rows


def _paired_ratio(reps: list[dict], reference: list[dict] | None) -> float | None:
    """Median over repeats of tokens/s over the reference's in the same repeat."""
    if not reference:
        return None
    return statistics.median(x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(reps, reference))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contenders", type=lambda s: s.split(","), default=["inproc:none", "serve:none"])
    p.add_argument("--concurrency", type=common.parse_int_list, default=[1])
    p.add_argument("--datasets", default="mtbench",
                   help="comma-separated built-in datasets, or a .jsonl file of {id, prompt}")
    p.add_argument("--prompts", type=int, default=8, help="evaluation-half prompts per dataset")
    p.add_argument("--prompts-per-slot", type=int, default=2,
                   help="at concurrency C use at least C x this many prompts (repeating the list)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="extra `verispec serve` flags for serve:/post:")
    p.add_argument("--llama-server-bin", help="llama-server for llama: contenders")
    p.add_argument("--reference", default="serve:none", help="outputs are compared with this one's")
    p.add_argument("--allow-noisy", action="store_true", help="run even on a busy machine (recorded)")
    p.add_argument("--wait-quiet-s", type=float, default=300.0,
                   help="how long to wait for a quiet machine (0: neither wait nor check)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.wait_quiet_s > 0:
        header = common.start_run(argparse.Namespace(threads=None, max_load=1.3, wait_quiet_s=args.wait_quiet_s,
                                                     allow_noisy=args.allow_noisy))
    else:  # no wait, no check (tests): recorded as such
        header = {"argv": sys.argv, "started": common.now_iso(),
                  "machine_load": {"quiet": None, "load_at_start": round(common.load_average(), 2)},
                  **common.provenance()}
    base = pick(args.datasets, args.prompts, args.seed)
    warm = pick(args.datasets, 2, args.seed, evaluation=False)[:2]
    results = []
    for c in args.concurrency:
        prompts = (base * -(-c * args.prompts_per_slot // len(base)))[: max(len(base), c * args.prompts_per_slot)]
        prompts = [_renamed(pr, i) for i, pr in enumerate(prompts)]
        r = measure(args, c, prompts, warm)
        r["summary"] = summarise(r, args.reference)
        results.append(r)
        print(common.markdown_table(["contender", "tok/s (median)", "repeats", "TTFT ms", "decode tok/s",
                                     f"same text as {args.reference}", f"x {args.reference}", "failed"],
                                    [[s["contender"], s["tokens_per_s"], s["repeats"], s["ttft_ms_median"],
                                      s["decode_tps_median"], s["identical_to_reference"],
                                      s["ratio_to_reference"], s["failed_requests"]]
                                     for s in r["summary"]]), file=sys.stderr)
    common.write_json(args.out, {"benchmark": "serving", "args": vars(args) | {"out": str(args.out)},
                                 "run": common.finish_run(header, t0), "results": results})
    return 0


def _renamed(prompt: BenchPrompt, index: int) -> BenchPrompt:
    """A repeated prompt gets its own key (answers are matched by key)."""
    from dataclasses import replace
    return replace(prompt, prompt_id=f"{prompt.prompt_id}#{index}")


if __name__ == "__main__":
    raise SystemExit(main())
