"""Shared pieces of the in-process engine benchmarks (throughput, prefix cache, adaptive k).

These scripts drive `LLMEngine` directly (add_request + step), not the HTTP server, so the
numbers are the engine's own: no client, network or JSON in the loop.

What every script here does the same way:
  * models are loaded once and shared by every engine built from them (an engine owns its
    KV pool, scheduler, prefix cache and speculation policy, so a fresh engine is cheap);
  * a workload runs closed-loop: exactly C requests are in flight, and a finished one is
    replaced at once by the next prompt until none is left (`run_closed_loop`);
  * timing runs start only on a quiet machine (1-minute load average under a threshold),
    and the load average at start and end is stored with the numbers;
  * every result file records the resolved EngineConfig.to_dict() of each contender, the
    software versions, the machine, and the git commit the imported verispec sources match.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/<script>.py` from a checkout
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import verispec  # noqa: E402
from verispec.bench.datasets import BenchPrompt, load_datasets, select_prompts  # noqa: E402
from verispec.bench.provenance import machine_info, software_versions  # noqa: E402
from verispec.config import EngineConfig  # noqa: E402
from verispec.engine.engine import LLMEngine  # noqa: E402
from verispec.model.llama import LlamaModel  # noqa: E402
from verispec.model.tokenizer import Tokenizer  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"


# ---------------------------------------------------------------- models and engines

@dataclass
class Models:
    """Weights loaded once; every engine of a run shares them (read-only in forward)."""

    config: EngineConfig             # the config they were loaded with (model, draft, dtype, format)
    target: LlamaModel
    tokenizer: Tokenizer
    draft: LlamaModel | None = None
    vocab_limit: int | None = None   # ids both models share (draft pairs only)
    load_seconds: float = 0.0


_LOAD_FIELDS = ("model", "dtype", "weight_format", "draft_weight_format")


def load_models(config: EngineConfig) -> Models:
    """Load through LLMEngine.from_config (its formats and pair check), keep only the weights."""
    t0 = time.perf_counter()
    engine = LLMEngine.from_config(config)
    draft = engine.draft_runner.model if engine.draft_runner is not None else None
    models = Models(config, engine.target.model, engine.tokenizer, draft, engine.target.vocab_limit,
                    time.perf_counter() - t0)
    del engine  # its KV pools; the next engines allocate their own
    return models


def resolved(models: Models, config: EngineConfig) -> EngineConfig:
    """`config` as an engine over `models` runs it: "auto" weight formats resolved."""
    return replace(config, weight_format=models.target.weight_format,
                   draft_weight_format=models.draft.weight_format if models.draft is not None
                   else config.draft_weight_format)


def make_engine(models: Models, config: EngineConfig) -> LLMEngine:
    """A fresh engine (own KV pool, prefix cache, policy) over the shared weights.

    `config` may differ from the loading config in anything but the weights: a config
    without a draft model gets an engine without one (plain decoding runs no draft passes).
    """
    for name in _LOAD_FIELDS:
        if getattr(config, name, None) != getattr(models.config, name, None):
            raise ValueError(f"config.{name} {getattr(config, name, None)!r} differs from the loaded "
                             f"{getattr(models.config, name, None)!r}")
    uses_draft = config.draft_model is not None
    if uses_draft and config.draft_model != models.config.draft_model:
        raise ValueError(f"config.draft_model {config.draft_model!r} is not the loaded "
                         f"{models.config.draft_model!r}")
    gc.collect()  # the previous engine's KV pool goes before the next one is allocated
    return LLMEngine(config, models.target, models.tokenizer,
                     models.draft if uses_draft else None,
                     models.vocab_limit if uses_draft else None)


# ---------------------------------------------------------------- prompts

@dataclass(frozen=True)
class WorkItem:
    """One prompt, encoded with the target's chat template."""

    prompt_id: str          # "<dataset>:<id in the dataset>"
    task: str
    token_ids: tuple[int, ...]


SPLITS = ("eval", "tuning", "all")


def prompt_half(dataset: str, prompt_id: str) -> str:
    """"tuning" or "eval": a fixed half of every dataset by a hash of the prompt's id, so a
    mechanism is tuned on one half and judged on the other."""
    return "tuning" if hashlib.sha256(f"{dataset}:{prompt_id}".encode()).digest()[0] % 2 == 0 else "eval"


def pick_prompts(datasets: list[str], num_prompts: int, num_warmup: int, seed: int,
                 split: str = "all") -> tuple[list[BenchPrompt], list[BenchPrompt], list[dict]]:
    """Seeded pick of measured and (disjoint) warm-up prompts, interleaved across datasets.

    `num_prompts` and `num_warmup` are totals over all datasets; datasets take turns so a
    prefix of either list mixes them evenly. With `split` "eval" or "tuning" the measured
    prompts come from that half (`prompt_half`) and the warm-ups from the other.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    by_name, sources = load_datasets(",".join(datasets))
    if split == "all":
        per_dataset = -(-(num_prompts + num_warmup) // len(datasets))
        mixed = _interleave(select_prompts(by_name, per_dataset, 0, seed).measured, by_name)
        measured, warmup = mixed[:num_prompts], mixed[num_prompts: num_prompts + num_warmup]
    else:
        halves = {h: {n: [p for p in ps if prompt_half(n, p.prompt_id) == h] for n, ps in by_name.items()}
                  for h in ("tuning", "eval")}
        other = "tuning" if split == "eval" else "eval"
        per_dataset = -(-num_prompts // len(datasets))
        measured = _interleave(select_prompts(halves[split], per_dataset, 0, seed).measured, by_name)[:num_prompts]
        warmup = list(select_prompts(halves[other], 0, num_warmup, seed).warmup)
    return measured, warmup, [_source_dict(s) for s in sources]


def _interleave(prompts, by_name) -> list[BenchPrompt]:
    columns = [[p for p in prompts if p.dataset == name] for name in by_name]
    return [col[i] for i in range(max(map(len, columns), default=0)) for col in columns if i < len(col)]


def _source_dict(source) -> dict:
    return {"name": source.name, "package": source.package, "version": source.package_version,
            "sha256": source.sha256, "num_available": source.num_available}


def encode(tokenizer: Tokenizer, prompts: list[BenchPrompt], task: str | None = None) -> list[WorkItem]:
    """Chat-template every prompt's first turn; the task defaults to the dataset name."""
    return [WorkItem(f"{p.dataset}:{p.prompt_id}", task or p.dataset,
                     tuple(tokenizer.encode_chat(list(p.messages)))) for p in prompts]


# ---------------------------------------------------------------- the closed loop

@dataclass
class RequestResult:
    prompt_id: str
    prompt_tokens: int
    token_ids: list[int]
    finish_reason: str
    ttft_s: float           # add_request -> the step that returned its first token
    latency_s: float        # add_request -> finished
    drafted: int
    accepted: int
    draft_rounds: int
    target_forwards: int


@dataclass
class RunResult:
    """One workload on one engine at one concurrency."""

    concurrency: int
    seconds: float
    requests: list[RequestResult]
    steps: int
    mean_in_flight: float   # time-weighted; below C while the last requests drain
    chosen_k: list[int] = field(default_factory=list)  # the policy's k histogram (speculating rows)
    load_after: float = 0.0  # 1-minute load average when the run ended (this run adds ~1-2)
    others_cpu_share: float | None = None  # cores' time other processes took during the run
    # The steps run with all `concurrency` requests in flight (see `ClosedLoop`): their
    # seconds and the tokens they returned. 0 seconds: none was.
    sustained_tokens: int = 0
    sustained_seconds: float = 0.0
    # An adaptive engine's policy state when the run ended (`SpeculationPolicy.snapshot`:
    # cost cells, acceptance pools, k counts, warm-up included), so a cell's miss can be
    # read afterwards; None for a fixed-k or plain engine.
    policy: dict | None = None

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def sustained_tokens_per_s(self) -> float | None:
        """Tokens per second while `concurrency` requests were in flight (None: never)."""
        return self.sustained_tokens / self.sustained_seconds if self.sustained_seconds > 0 else None

    @property
    def drain_tokens_per_s(self) -> float | None:
        """Tokens per second over the other steps: the drain, fewer than `concurrency` in
        flight with nothing left to add (None: none was)."""
        seconds = self.seconds - self.sustained_seconds
        return (self.tokens - self.sustained_tokens) / seconds if seconds > 0 else None

    @property
    def mean_latency_s(self) -> float | None:
        """A request's seconds from add_request to finished, averaged over the run's
        requests (on the loop's own clock; None: no request)."""
        return statistics.fmean(r.latency_s for r in self.requests) if self.requests else None

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.requests)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.requests)

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted draft tokens (None when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    def summary(self) -> dict:
        ttfts = sorted(r.ttft_s for r in self.requests)
        return {"concurrency": self.concurrency, "requests": len(self.requests),
                "tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
                "drafted": self.drafted, "accepted": self.accepted, "acceptance": self.acceptance,
                "mean_accepted_per_round": (self.accepted / n if (n := sum(r.draft_rounds for r in self.requests))
                                            else None),
                "sustained_tokens": self.sustained_tokens, "sustained_seconds": self.sustained_seconds,
                "sustained_tokens_per_s": self.sustained_tokens_per_s,
                "drain_tokens_per_s": self.drain_tokens_per_s,
                "steps": self.steps, "mean_in_flight": self.mean_in_flight,
                "median_ttft_s": ttfts[len(ttfts) // 2] if ttfts else None,
                "mean_latency_s": self.mean_latency_s,
                "chosen_k_histogram": self.chosen_k, "load_after": self.load_after,
                "others_cpu_share": self.others_cpu_share}


class ClosedLoop:
    """`items` on one engine keeping exactly `concurrency` requests in flight, refilled as
    they finish, one engine step per `step()`. Its clock counts only its own work (adding
    requests, the step, reading the outputs), so loops stepped in turn (`run_lockstep`) each
    measure their own seconds, and latencies are on that clock too.

    Failed requests raise: a benchmark never averages over errors.

    Besides the whole run's rate it keeps the sustained one: tokens returned by, over the
    seconds of, the steps run with all `concurrency` requests in flight. Once the queue is
    empty the batch drains, and how long that tail is depends on how far apart the last
    requests' progress drifted, not on the concurrency measured: plain decoding of equal-
    length answers keeps every row in step and drains at once, while speculation moves rows
    apart (chat at 4 in flight, 8 answers of 128 tokens: 75 of adaptive's 236 rounds ran
    with 1-3 rows, none of plain's). The whole-run rate charges that tail to speculation.
    """

    def __init__(self, engine: LLMEngine, items: list[WorkItem], concurrency: int, params: SamplingParams,
                 tag: str):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.engine, self.items, self.concurrency, self.params, self.tag = engine, items, concurrency, params, tag
        self._k_before = list(engine.policy.snapshot()["k_counts"])
        self._queue = list(items)
        self._added: dict[str, tuple[WorkItem, float]] = {}
        self._first_token: dict[str, float] = {}
        self._done: list[RequestResult] = []
        self.steps, self.clock, self._in_flight_time = 0, 0.0, 0.0
        self.sustained_tokens, self.sustained_seconds = 0, 0.0

    @property
    def finished(self) -> bool:
        return not self._queue and len(self._done) == len(self.items)

    def step(self) -> None:
        t_start = time.perf_counter()
        at = lambda: self.clock + (time.perf_counter() - t_start)  # noqa: E731 (this loop's clock now)
        while self._queue and len(self._added) - len(self._done) < self.concurrency:
            item = self._queue.pop(0)
            rid = f"{self.tag}/{item.prompt_id}"
            self.engine.add_request(rid, list(item.token_ids), self.params)
            self._added[rid] = (item, at())
        in_flight = len(self._added) - len(self._done)
        t0 = time.perf_counter()
        outputs = self.engine.step()
        now = at()
        self.steps += 1
        self._in_flight_time += in_flight * (time.perf_counter() - t0)
        for out in outputs:
            if out.new_token_ids and out.request_id not in self._first_token:
                self._first_token[out.request_id] = now
            if out.finished:
                if out.error or out.finish_reason == "abort":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                item, t_add = self._added[out.request_id]
                s = out.spec
                self._done.append(RequestResult(item.prompt_id, len(item.token_ids), list(out.token_ids),
                                                out.finish_reason, self._first_token[out.request_id] - t_add,
                                                now - t_add, s.num_draft_tokens, s.num_accepted_tokens,
                                                s.num_drafts, s.target_forwards))
        spent = time.perf_counter() - t_start
        self.clock += spent
        if in_flight == self.concurrency:
            self.sustained_tokens += sum(len(out.new_token_ids) for out in outputs)
            self.sustained_seconds += spent

    def result(self, others_cpu: float | None) -> RunResult:
        snapshot = self.engine.policy.snapshot()
        spec = self.engine.config.spec
        k_after = snapshot["k_counts"]
        order = {it.prompt_id: i for i, it in enumerate(self.items)}
        done = sorted(self._done, key=lambda r: order[r.prompt_id])
        return RunResult(self.concurrency, self.clock, done, self.steps, self._in_flight_time / self.clock,
                         [a - b for a, b in zip(k_after, self._k_before)], round(load_average(), 2), others_cpu,
                         self.sustained_tokens, self.sustained_seconds,
                         snapshot if spec.adaptive and spec.method != "none" else None)


def run_closed_loop(engine: LLMEngine, items: list[WorkItem], concurrency: int,
                    params: SamplingParams, tag: str) -> RunResult:
    """Run `items` keeping exactly `concurrency` requests in flight (see `ClosedLoop`)."""
    loop = ClosedLoop(engine, items, concurrency, params, tag)
    cpu_before = cpu_sample()
    while not loop.finished:
        loop.step()
    return loop.result(others_cpu_share(cpu_before, cpu_sample()))


def run_lockstep(loops: dict[str, ClosedLoop], seed: int = 0) -> dict[str, RunResult]:
    """Step every unfinished loop once per round, in an order shuffled every round (seeded),
    until all are done; each loop's seconds are its own steps' (see `ClosedLoop`). Contenders
    stepped in turn meet the same moments of a machine whose speed drifts by 10-30% within
    seconds (a shared VM), where runs one after the other do not: their ratios compare like
    with like. Shuffled, not rotated: rotated, each contender would nearly always follow the
    same one (whose pass leaves the caches and allocator in its own state)."""
    names, cpu_before, rng = list(loops), cpu_sample(), random.Random(seed)
    while not all(loop.finished for loop in loops.values()):
        rng.shuffle(names)
        for name in names:
            if not loops[name].finished:
                loops[name].step()
    others = others_cpu_share(cpu_before, cpu_sample())
    return {name: loop.result(others) for name, loop in loops.items()}


def warm_up(engine: LLMEngine, items: list[WorkItem], concurrency: int, max_tokens: int, tag: str) -> float:
    """Unmeasured run: first-call overheads, and a first look at costs for the policy."""
    if not items:
        return 0.0
    t0 = time.perf_counter()
    run_closed_loop(engine, items, concurrency, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                    f"warmup-{tag}")
    return time.perf_counter() - t0


def same_outputs(a: RunResult, b: RunResult) -> dict:
    """How many completions are token-for-token equal (greedy: lossless up to bf16 numerics)."""
    pairs = list(zip(a.requests, b.requests))
    equal = sum(x.token_ids == y.token_ids for x, y in pairs)
    return {"identical": equal, "compared": len(pairs)}


# ---------------------------------------------------------------- the machine

def load_average() -> float:
    return os.getloadavg()[0]


@dataclass(frozen=True)
class CpuSample:
    """Machine-wide and this-process CPU time, in clock ticks (from /proc)."""

    total: int
    busy: int
    mine: int


def cpu_sample() -> CpuSample:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    mine = int(stat[11]) + int(stat[12])  # utime + stime of this process (all its threads)
    return CpuSample(sum(fields[:8]), sum(fields[:8]) - idle, mine)


def others_cpu_share(before: CpuSample, after: CpuSample) -> float | None:
    """Fraction of all cores' time that other processes used between two samples.

    The load average lags by a minute and counts our own threads; this says directly
    whether someone else competed for the cores during a measured run (clean: ~0.0x).
    """
    total = after.total - before.total
    if total <= 0:
        return None
    return max(0.0, (after.busy - before.busy) - (after.mine - before.mine)) / total


def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 20.0,
                   max_others: float = 0.15, sample_s: float = 5.0) -> dict:
    """Sleep until the 1-minute load average is under `max_load` and, over a `sample_s`
    window, other processes use under `max_others` of the cores (at most `max_wait_s`)."""
    t0 = time.monotonic()
    history, streak = [], 0
    while True:
        before = cpu_sample()
        time.sleep(sample_s)
        share = others_cpu_share(before, cpu_sample())
        history.append((round(load_average(), 2), round(share or 0.0, 3)))
        quiet = history[-1][0] < max_load and history[-1][1] < max_others
        streak = streak + 1 if quiet else 0
        if streak >= 2 or (streak == 0 and time.monotonic() - t0 >= max_wait_s):
            break
        if quiet:
            # Quiet twice, a random pause apart: two waiting benchmarks rarely start together.
            time.sleep(random.uniform(5.0, 25.0))
            continue
        print(f"[bench] load average {history[-1][0]:.2f} (limit {max_load}), others' CPU share "
              f"{history[-1][1]:.2f} (limit {max_others}): waiting", file=sys.stderr, flush=True)
        time.sleep(poll_s)
    return {"quiet": quiet, "max_load": max_load, "max_others_cpu_share": max_others,
            "load_at_start": history[-1][0], "others_cpu_share_at_start": history[-1][1],
            "waited_s": round(time.monotonic() - t0, 1), "checks": len(history)}


def code_provenance() -> dict:
    """The git commit and whether the imported verispec sources are exactly that commit's.

    The shared working tree may hold someone's uncommitted engine edits; a snapshot run
    (`git archive HEAD | tar -x`) is then the way to measure one commit, and this check
    says which case a result came from.
    """
    src = Path(verispec.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    head = (git("rev-parse", "HEAD") or "").strip() or None
    committed = {}
    for line in (git("ls-tree", "-r", "HEAD", "verispec") or "").splitlines():
        meta, path = line.split("\t", 1)
        committed[path[len("verispec/"):]] = meta.split()[2]
    differing = []
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(src).as_posix()
        data = f.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
        if committed.get(rel) != blob:
            differing.append(rel)
    return {"commit": head, "verispec_source": str(src),
            "sources_match_commit": head is not None and not differing,
            "files_differing_from_commit": differing}


def provenance() -> dict:
    return {"software": software_versions(), "machine": machine_info(), "code": code_provenance(),
            "torch_threads": torch.get_num_threads()}


# ---------------------------------------------------------------- flags, files, tables

def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_common_args(parser: argparse.ArgumentParser, concurrency: str) -> None:
    g = parser.add_argument_group("common")
    g.add_argument("--concurrency", type=parse_int_list, default=parse_int_list(concurrency),
                   help=f"requests in flight, comma-separated (default {concurrency})")
    g.add_argument("--quick", action="store_true", help="tiny settings: checks the script in minutes")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    g.add_argument("--weight-format", default=None,
                   help="EngineConfig.weight_format (default: the engine's default)")
    g.add_argument("--device", default="auto", help="EngineConfig.device: auto, cpu, cuda or cuda:N")
    g.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    g.add_argument("--split", default="eval", choices=SPLITS,
                   help="measure the evaluation half of every dataset's prompts (default), the "
                        "tuning half, or all (warm-ups come from the other half)")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    g.add_argument("--max-load", type=float, default=1.3, help="start only below this 1-min load average")
    g.add_argument("--wait-quiet-s", type=float, default=300.0, help="how long to wait for a quiet machine")
    g.add_argument("--allow-noisy", action="store_true",
                   help="run even if the machine never got quiet (recorded in the result)")
    g.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/<name>.json)")


def base_config(args: argparse.Namespace, draft_model: str | None = None) -> EngineConfig:
    """The engine's default config with the run's model, draft model, dtype, weight format
    and device."""
    extra = {"weight_format": args.weight_format} if args.weight_format else {}
    return EngineConfig(model=args.model, draft_model=draft_model, dtype=args.dtype,
                        device=getattr(args, "device", "auto"), **extra)


def start_run(args: argparse.Namespace) -> dict:
    """Set threads, wait for a quiet machine; returns the run header stored with the results."""
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet = wait_for_quiet(args.max_load, args.wait_quiet_s)
    if not quiet["quiet"] and not args.allow_noisy:
        raise SystemExit(f"machine not quiet after {quiet['waited_s']} s: load average "
                         f"{quiet['load_at_start']}, others' CPU share {quiet['others_cpu_share_at_start']} "
                         "(use --allow-noisy to record anyway)")
    return {"argv": sys.argv, "started": now_iso(), "machine_load": quiet, **provenance()}


def finish_run(header: dict, t0: float) -> dict:
    header = dict(header)
    header["finished"] = now_iso()
    header["runtime_s"] = round(time.perf_counter() - t0, 1)
    header["machine_load"] = {**header["machine_load"], "load_at_end": round(load_average(), 2)}
    return header


def write_result(benchmark: str, args: argparse.Namespace, header: dict, t0: float, body: dict,
                 default_out: Path) -> None:
    """The run's result file: {benchmark, the finished header, the settings, **body}, at
    --out or `default_out`."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_json(args.out or default_out, {"benchmark": benchmark, **finish_run(header, t0), "settings": settings, **body})


def paired_resamples(runs: dict[str, list[RunResult]], resamples: int, seed: int = 0):
    """Each contender's rate on `resamples` draws of the prompts with replacement (seeded):
    its tokens over its seconds, summed over the drawn prompts and over its runs. Only at 1
    in flight is a request's seconds its own, so every prompt is a pair across the
    contenders; the caller checks the concurrency. Contenders that ran different prompts
    are a ValueError."""
    tokens, seconds = ({n: {} for n in runs} for _ in range(2))
    for n, results in runs.items():
        for run in results:
            for req in run.requests:
                tokens[n][req.prompt_id] = tokens[n].get(req.prompt_id, 0) + len(req.token_ids)
                seconds[n][req.prompt_id] = seconds[n].get(req.prompt_id, 0.0) + req.latency_s
    prompts = sorted(next(iter(seconds.values())))
    if any(sorted(s) != prompts for s in seconds.values()):
        raise ValueError(f"paired interval: the contenders ran different prompts: "
                         f"{ {n: sorted(s) for n, s in seconds.items()} }")
    rng = random.Random(seed)
    for _ in range(resamples):
        draw = [rng.choice(prompts) for _ in prompts]
        yield {n: sum(tokens[n][p] for p in draw) / sum(seconds[n][p] for p in draw) for n in runs}


def central_interval(values: list[float], level: float) -> list[float]:
    """The [low, high] ends holding the central `level` share of `values`."""
    xs, tail = sorted(values), (1.0 - level) / 2
    return [xs[int(tail * (len(xs) - 1))], xs[int((1.0 - tail) * (len(xs) - 1))]]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    print(f"[bench] wrote {path}", file=sys.stderr)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-flavoured table; floats get 2 decimals, None prints as n/a."""
    def cell(v):
        if v is None:
            return "n/a"
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
