"""The draft's gate: acceptance and decode speed of draft vs n-gram vs plain decoding, per task.

One engine holds the target and the trained draft; every prompt runs alone (batch 1) once
per method, the methods in rotated order from prompt to prompt so that drift in machine
load falls on all of them alike. Greedy decoding, adaptive k (the engine's default). Speed
is decode tokens per second after the first token (prefill excluded); a task's speed is
its total tokens over its total decode time. Greedy outputs must be identical across methods
(speculation is lossless); mismatches are counted.

Tasks: every built-in benchmark set (first turn only) and `chat-heldout`, ShareGPT openers
from the far end of the seeded order that training prompts never reach.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verispec.train.store import write_json

METHODS = ("none", "ngram", "draft")
DEFAULT_TASKS = ("chat-heldout", "mtbench", "humaneval", "gsm8k", "mbpp", "math500", "cnn",
                 "rewrite-code", "rewrite-essay", "json")


@dataclass(frozen=True)
class GateConfig:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    prompts_per_task: int = 3
    max_tokens: int = 128
    max_load: float = 1.3            # 1-minute load average allowed when timing starts
    max_prompt_tokens: int = 1536
    fixed_k: int | None = None       # None: adaptive k (the engine default); else k, not adaptive
    seed: int = 0

    def __post_init__(self):
        if self.prompts_per_task < 1:
            raise ValueError(f"prompts_per_task must be >= 1, got {self.prompts_per_task}")
        if not 1 <= self.max_tokens <= 2048:
            raise ValueError(f"max_tokens must be in [1, 2048], got {self.max_tokens}")


@dataclass
class MethodTotals:
    tokens: int = 0
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    def add(self, out, decode_s: float) -> None:
        self.tokens += max(len(out.token_ids) - 1, 0)
        self.decode_s += decode_s
        self.drafted += out.spec.num_draft_tokens
        self.accepted += out.spec.num_accepted_tokens
        self.rounds += out.spec.target_forwards

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


@dataclass
class TaskResult:
    task: str
    num_prompts: int
    methods: dict[str, MethodTotals] = field(default_factory=dict)
    mismatches: int = 0
    load_avg: list[float] = field(default_factory=list)


def gate_prompts(cfg: GateConfig, tokenizer) -> dict[str, list[list[int]]]:
    """Chat-encoded prompt ids per task (seeded choice; prompts over max_prompt_tokens skipped)."""
    import random

    from verispec.bench.datasets import BUILTIN_DATASETS
    from verispec.train.prompts import heldout_prompts, load_sharegpt

    out = {}
    for task in cfg.tasks:
        if task == "chat-heldout":
            pool, _ = load_sharegpt()
            messages = [list(p.messages) for p in heldout_prompts(pool, cfg.seed, 200)]
        elif task in BUILTIN_DATASETS:
            prompts, _ = BUILTIN_DATASETS[task]()
            messages = [list(p.messages) for p in prompts]
        else:
            raise ValueError(f"gate task {task!r} is neither 'chat-heldout' nor one of {sorted(BUILTIN_DATASETS)}")
        random.Random(f"{cfg.seed}:gate:{task}").shuffle(messages)
        encoded = [ids for ids in (tokenizer.encode_chat(m) for m in messages) if len(ids) <= cfg.max_prompt_tokens]
        out[task] = encoded[: cfg.prompts_per_task]
    return out


def _run_one(engine, rid: str, prompt_ids: list[int], params, method: str, fixed_k: int | None = None):
    from verispec.engine.engine import SpecOverride

    spec = SpecOverride(method=method) if fixed_k is None or method == "none" else \
        SpecOverride(method=method, num_tokens=fixed_k, adaptive=False)
    engine.add_request(rid, prompt_ids, params, spec)
    t_first = final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and t_first is None:
                t_first = time.perf_counter()
            if out.finished:
                final = out
    if final.error:
        raise RuntimeError(f"gate request {rid} failed: {final.error}")
    return final, time.perf_counter() - (t_first or time.perf_counter())


def run_gate(engine, cfg: GateConfig, prompts: dict[str, list[list[int]]], progress=print) -> list[TaskResult]:
    """Time every prompt under every method (rotated order); returns per-task totals."""
    from verispec.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens)
    warm = next(iter(prompts.values()))[0]
    for m in METHODS:  # warm-up: first-call allocations, the policy's cost cells
        _run_one(engine, f"warm-{m}", warm, params, m, cfg.fixed_k)
    results, n = [], 0
    for task, task_prompts in prompts.items():
        res = TaskResult(task, len(task_prompts), {m: MethodTotals() for m in METHODS})
        for i, ids in enumerate(task_prompts):
            res.load_avg.append(round(os.getloadavg()[0], 2))
            outputs = {}
            order = METHODS[n % 3:] + METHODS[: n % 3]
            n += 1
            for m in order:
                out, decode_s = _run_one(engine, f"{task}-{i}-{m}", ids, params, m, cfg.fixed_k)
                res.methods[m].add(out, decode_s)
                outputs[m] = out.token_ids
            res.mismatches += sum(outputs[m] != outputs["none"] for m in METHODS)
        progress(format_row(res))
        results.append(res)
    return results


def format_row(r: TaskResult) -> str:
    base = r.methods["none"].tokens_per_s or float("nan")
    cells = [f"{r.task:14s}", f"{base:6.1f}"]
    for m in ("ngram", "draft"):
        t = r.methods[m]
        acc = t.accepted / t.drafted if t.drafted else 0.0
        cells.append(f"{t.tokens_per_s:6.1f} ({t.tokens_per_s / base:4.2f}x, acc {acc:.2f}, "
                     f"{(t.tokens + r.num_prompts) / max(t.rounds, 1):.2f} tok/fwd)")
    return " | ".join(cells)


def markdown_table(results: list[TaskResult]) -> str:
    """The docs table: tokens/s per method, speed-up over plain, acceptance, tokens per forward."""
    lines = ["| task | prompts | plain tok/s | n-gram tok/s (speed-up, acceptance) | "
             "draft tok/s (speed-up, acceptance, tokens/target forward) | outputs identical |",
             "|---|---|---|---|---|---|"]
    for r in results + [_overall(results)]:
        base = r.methods["none"].tokens_per_s
        ng, dr = r.methods["ngram"], r.methods["draft"]
        acc = lambda t: t.accepted / t.drafted if t.drafted else 0.0  # noqa: E731
        lines.append(f"| {r.task} | {r.num_prompts} | {base:.1f} | {ng.tokens_per_s:.1f} "
                     f"({ng.tokens_per_s / base:.2f}x, {acc(ng):.2f}) | {dr.tokens_per_s:.1f} "
                     f"({dr.tokens_per_s / base:.2f}x, {acc(dr):.2f}, "
                     f"{(dr.tokens + r.num_prompts) / max(dr.rounds, 1):.2f}) | "
                     f"{'yes' if r.mismatches == 0 else f'{r.mismatches} differ'} |")
    return "\n".join(lines)


def _overall(results: list[TaskResult]) -> TaskResult:
    total = TaskResult("all tasks", sum(r.num_prompts for r in results), {m: MethodTotals() for m in METHODS})
    for r in results:
        total.mismatches += r.mismatches
        for m in METHODS:
            for key in ("tokens", "decode_s", "drafted", "accepted", "rounds"):
                setattr(total.methods[m], key, getattr(total.methods[m], key) + getattr(r.methods[m], key))
    return total


def gate_verdict(results: list[TaskResult]) -> tuple[bool, str]:
    """Pass: draft faster than plain on every task, and faster than n-gram on open chat."""
    slower = [r.task for r in results if r.methods["draft"].tokens_per_s <= r.methods["none"].tokens_per_s]
    chat = [r for r in results if r.task in ("chat-heldout", "mtbench")]
    lost_chat = [r.task for r in chat if r.methods["draft"].tokens_per_s <= r.methods["ngram"].tokens_per_s]
    ok = not slower and not lost_chat and bool(chat)
    why = []
    if slower:
        why.append(f"draft not faster than plain on {', '.join(slower)}")
    if lost_chat:
        why.append(f"draft not faster than n-gram on {', '.join(lost_chat)}")
    return ok, "PASS" if ok else "FAIL: " + "; ".join(why)


def run_gate_cli(args, work: Path) -> int:
    """`verispec train-draft gate`: refuse on a busy machine, time, print and save the table."""
    import torch

    from verispec.config import CacheConfig, EngineConfig, SpecConfig
    from verispec.engine.engine import LLMEngine
    from verispec.train.registry import registered_draft

    cfg = GateConfig(tasks=tuple(t.strip() for t in args.tasks.split(",")), prompts_per_task=args.prompts_per_task,
                     max_tokens=args.max_tokens, max_load=args.max_load, fixed_k=args.fixed_k)
    deadline = time.time() + args.wait_quiet
    while (load := os.getloadavg()[0]) >= cfg.max_load and time.time() < deadline:
        time.sleep(15)
    if load >= cfg.max_load:
        raise ValueError(f"1-minute load average is {load:.2f} (>= --max-load {cfg.max_load}): "
                         "timings on a busy machine are not evidence; retry when it is quiet")
    draft = args.draft_model or registered_draft(args.target)
    config = EngineConfig(model=args.target, draft_model=draft, spec=SpecConfig(method="draft"),
                          cache=CacheConfig(num_kv_tokens=8192))
    engine = LLMEngine.from_config(config)
    prompts = gate_prompts(cfg, engine.tokenizer)
    print(f"gate: {sum(map(len, prompts.values()))} prompts, torch threads {torch.get_num_threads()}, "
          f"load {load:.2f}\n{'task':14s} | plain  | n-gram | draft")
    results = run_gate(engine, cfg, prompts)
    ok, verdict = gate_verdict(results)
    table = markdown_table(results)
    print(table + "\n" + verdict)
    out = Path(args.out) if args.out else work / "gate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"config": asdict(cfg), "engine": config.to_dict(), "draft": draft,
                     "threads": torch.get_num_threads(), "load_at_start": load,
                     "results": [asdict(r) for r in results], "verdict": verdict, "table": table,
                     "policy": engine.policy.snapshot()})  # measured verify / draft costs
    return 0 if ok else 1
