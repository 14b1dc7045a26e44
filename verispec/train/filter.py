"""Stage 2: deduplicate, drop degenerate outputs, decontaminate against the benchmarks.

Each trace is checked in this order and dropped by the first check it fails (so every drop
is counted once):
    empty         fewer than `min_output_tokens` generated tokens besides EOS, or blank text
    loop          a repetition loop: among the last 96 generated tokens, distinct 4-grams
                  / all 4-grams < `loop_distinct_ratio` (outputs under `loop_min_tokens` never)
    duplicate     the same prompt text (case and whitespace folded) as an earlier trace
    contaminated  shares a word `ngram`-gram (13 by default) with any prompt of any
                  benchmark set in verispec.bench.datasets (prompt or output text checked)
The kept traces are split by a hash of the prompt id into train and held-out (validation).

Layout of `<work>/filtered/`: train.pt, heldout.pt, report.json (counts + the fingerprint of
the inputs and settings; a rerun with the same fingerprint does nothing).
"""
from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from verispec.train.config import FilterConfig
from verispec.train.store import load_torch, read_json, save_torch, write_json

_WORD = re.compile(r"\w+")
LOOP_WINDOW = 96


@dataclass
class FilterReport:
    num_traces: int = 0
    dropped_empty: int = 0
    dropped_loop: int = 0
    dropped_duplicate: int = 0
    dropped_contaminated: int = 0
    contaminated_by: dict[str, int] = field(default_factory=dict)  # benchmark set -> traces
    num_kept: int = 0
    num_train: int = 0
    num_heldout: int = 0
    train_output_tokens: int = 0
    heldout_output_tokens: int = 0
    benchmark_ngrams: int = 0
    fingerprint: str = ""

    def lines(self) -> list[str]:
        """The report as printed by `verispec train-draft filter`."""
        out = [f"traces {self.num_traces}: kept {self.num_kept} "
               f"(train {self.num_train}, held-out {self.num_heldout})",
               f"  dropped empty {self.dropped_empty}, repetition loop {self.dropped_loop}, "
               f"duplicate {self.dropped_duplicate}, contaminated {self.dropped_contaminated}"]
        if self.contaminated_by:
            out.append("  contaminated by: " + ", ".join(f"{k} {v}" for k, v in sorted(self.contaminated_by.items())))
        out.append(f"  output tokens: train {self.train_output_tokens}, held-out {self.heldout_output_tokens}; "
                   f"benchmark {self.benchmark_ngrams} distinct n-grams checked")
        return out


def word_ngrams(text: str, n: int) -> set[int]:
    """Hashes of the lower-cased word n-grams of `text`."""
    words = _WORD.findall(text.lower())
    return {hash(" ".join(words[i: i + n])) for i in range(len(words) - n + 1)}


class BenchmarkIndex:
    """Word n-grams of every benchmark prompt -> the benchmark set they come from."""

    def __init__(self, texts_by_set: dict[str, Iterable[str]], n: int):
        self.n = n
        self.owner: dict[int, str] = {}
        digest = hashlib.sha256()
        for name in sorted(texts_by_set):
            digest.update(name.encode() + b"\0")
            for text in texts_by_set[name]:
                digest.update(text.encode() + b"\0")
                for g in word_ngrams(text, n):
                    self.owner.setdefault(g, name)
        self.fingerprint = digest.hexdigest()[:16]

    def match(self, text: str) -> str | None:
        """The benchmark set sharing an n-gram with `text`, or None."""
        for g in word_ngrams(text, self.n):
            if g in self.owner:
                return self.owner[g]
        return None


def benchmark_texts() -> dict[str, list[str]]:
    """Every prompt text (all turns) of every built-in benchmark set; fails if one is missing."""
    from verispec.bench.datasets import BUILTIN_DATASETS

    out = {}
    for name, loader in BUILTIN_DATASETS.items():
        prompts, _ = loader()  # DatasetError (a ValueError) says how to install a missing set
        out[name] = [m["content"] for p in prompts for m in p.messages] + \
                    [t for p in prompts for t in p.followups]
    return out


def is_loop(output_ids: list[int], cfg: FilterConfig) -> bool:
    """True when the tail of the output keeps repeating the same few 4-grams."""
    if len(output_ids) < cfg.loop_min_tokens:
        return False
    tail = output_ids[-LOOP_WINDOW:]
    grams = [tuple(tail[i: i + 4]) for i in range(len(tail) - 3)]
    return len(set(grams)) / len(grams) < cfg.loop_distinct_ratio


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def classify(record: dict, cfg: FilterConfig, eos_ids: set[int], seen: set[str],
             index: BenchmarkIndex) -> str | None:
    """Why `record` is dropped ('empty', 'loop', 'duplicate', 'contaminated:<set>') or None."""
    ids = [int(t) for t in record["output_ids"].tolist() if int(t) not in eos_ids]
    if len(ids) < cfg.min_output_tokens or not record["output_text"].strip():
        return "empty"
    if is_loop(ids, cfg):
        return "loop"
    key = _normalise(record["prompt_text"])
    if key in seen:
        return "duplicate"
    seen.add(key)
    hit = index.match(record["prompt_text"]) or index.match(record["output_text"])
    return f"contaminated:{hit}" if hit else None


def is_heldout(prompt_id: str, fraction: float) -> bool:
    return zlib.crc32(prompt_id.encode()) % 10_000 < fraction * 10_000


def run_filter(cfg: FilterConfig, traces_dir: Path, out_dir: Path, eos_ids: Iterable[int],
               bench: dict[str, list[str]] | None = None) -> tuple[FilterReport, bool]:
    """Filter the finished traces; returns (report, ran). Skips when already done alike."""
    if not (traces_dir / "done.json").exists():
        raise ValueError(f"traces in {traces_dir} are not finished; run the traces stage first")
    num_shards = read_json(traces_dir / "done.json")["num_shards"]
    shards = [traces_dir / f"shard-{i:05d}.pt" for i in range(num_shards)]
    index = BenchmarkIndex(benchmark_texts() if bench is None else bench, cfg.ngram)
    fingerprint = hashlib.sha256(json.dumps({
        "config": cfg.to_dict(), "traces": read_json(traces_dir / "done.json"),
        "settings": read_json(traces_dir / "settings.json"), "bench": index.fingerprint,
        "shards": [(s.name, s.stat().st_size) for s in shards]}, sort_keys=True).encode()).hexdigest()[:16]
    report_path = out_dir / "report.json"
    if report_path.exists() and read_json(report_path).get("fingerprint") == fingerprint:
        return FilterReport(**read_json(report_path)), False
    out_dir.mkdir(parents=True, exist_ok=True)
    report = FilterReport(benchmark_ngrams=len(index.owner), fingerprint=fingerprint)
    eos, seen = set(eos_ids), set()
    train, heldout = [], []
    for shard in shards:
        for record in load_torch(shard)["records"]:
            report.num_traces += 1
            reason = classify(record, cfg, eos, seen, index)
            if reason is None:
                (heldout if is_heldout(record["prompt_id"], cfg.heldout_fraction) else train).append(record)
            elif reason.startswith("contaminated:"):
                report.dropped_contaminated += 1
                name = reason.split(":", 1)[1]
                report.contaminated_by[name] = report.contaminated_by.get(name, 0) + 1
            else:
                setattr(report, f"dropped_{reason}", getattr(report, f"dropped_{reason}") + 1)
    report.num_kept, report.num_train, report.num_heldout = len(train) + len(heldout), len(train), len(heldout)
    report.train_output_tokens = sum(int(r["output_ids"].numel()) for r in train)
    report.heldout_output_tokens = sum(int(r["output_ids"].numel()) for r in heldout)
    save_torch(out_dir / "train.pt", {"records": train})
    save_torch(out_dir / "heldout.pt", {"records": heldout})
    write_json(report_path, asdict(report))  # last: marks the stage done
    return report, True
