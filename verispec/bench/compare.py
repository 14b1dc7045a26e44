"""Paired comparison of a speculative run against a baseline run of the same prompts.

  * output equality per (dataset, prompt, turn, pass) at temperature 0, with the first differing
    character and a lower bound on the first differing completion token;
  * JSON validity of the JSON task's outputs;
  * speedups with seeded bootstrap confidence intervals, resampling prompts (the unit that was
    paired), never requests of one prompt independently:
      decode_tps   geometric mean over prompts of spec/base per-request decode tokens/s
      inv_tpot     geometric mean over prompts of base TPOT / spec TPOT (needs no per-chunk
                   counts, so it exists for servers that send none)
      e2e_tput     (sum completion tokens / sum end-to-end seconds), spec over base
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from pathlib import Path

import numpy as np

from verispec.bench.records import read_run, request_key

_CONFIG_KEYS_THAT_MUST_MATCH = ("dataset", "max_tokens", "num_prompts", "seed", "temperature",
                                "passes", "request_seeds")


def ok_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r["status"] == "ok"]


def per_prompt(records: list[dict], field: str) -> dict[tuple, float]:
    """Mean of `field` over the passes of each (dataset, prompt_id, turn); None values skipped."""
    acc: dict[tuple, list[float]] = defaultdict(list)
    for r in ok_records(records):
        if r[field] is not None:
            acc[request_key(r)].append(float(r[field]))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def _sums(records: list[dict]) -> dict[tuple, tuple[float, float]]:
    acc: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in ok_records(records):
        a = acc[request_key(r)]
        a[0] += r["completion_tokens"]
        a[1] += r["e2e_s"]
    return {k: (v[0], v[1]) for k, v in acc.items()}


def _interval(samples: np.ndarray, point: float, n: int, resamples: int) -> dict:
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return {"point": float(point), "ci95": [float(lo), float(hi)], "n_prompts": n,
            "resamples": resamples}


def bootstrap_decode_speedup(spec: dict, base: dict, resamples: int, seed: int) -> dict | None:
    """Geometric-mean speedup of a per-prompt rate (spec / base) with a percentile bootstrap CI."""
    keys = sorted(k for k in spec.keys() & base.keys() if spec[k] > 0 and base[k] > 0)
    if not keys:
        return None
    log_ratio = np.array([math.log(spec[k] / base[k]) for k in keys])  # (P,)
    idx = np.random.default_rng(seed).integers(0, len(keys), (resamples, len(keys)))  # (R, P)
    samples = np.exp(log_ratio[idx].mean(axis=1))  # (R,)
    return _interval(samples, math.exp(log_ratio.mean()), len(keys), resamples)


def bootstrap_e2e_speedup(spec: dict, base: dict, resamples: int, seed: int) -> dict | None:
    """Ratio of end-to-end throughputs (tokens / seconds, summed over prompts) with a CI."""
    keys = sorted(k for k in spec.keys() & base.keys() if spec[k][1] > 0 and base[k][1] > 0)
    if not keys:
        return None
    s = np.array([spec[k] for k in keys])  # (P, 2): tokens, seconds
    b = np.array([base[k] for k in keys])  # (P, 2)
    idx = np.random.default_rng(seed).integers(0, len(keys), (resamples, len(keys)))  # (R, P)

    def ratio(rows):  # rows: (..., P) indices
        return (s[rows, 0].sum(-1) / s[rows, 1].sum(-1)) / (b[rows, 0].sum(-1) / b[rows, 1].sum(-1))

    return _interval(ratio(idx), float(ratio(np.arange(len(keys)))), len(keys), resamples)


def first_divergence(a: str, b: str) -> int | None:
    """Index of the first differing character, or None if the strings are equal."""
    if a == b:
        return None
    return len(os.path.commonprefix([a, b]))


def tokens_before_char(record: dict, char_index: int) -> int | None:
    """Completion tokens in the chunks that end at or before `char_index` (None if unknown)."""
    if record["chunk_token_semantics"] == "unavailable":
        return None
    end, tokens = 0, 0
    for chars, n in zip(record["chunk_chars"], record["chunk_tokens"]):
        end += chars
        if end > char_index:
            break
        tokens += n
    return tokens


def output_equality(spec: list[dict], base: list[dict]) -> dict:
    """Compare outputs request by request (same prompt, turn and pass) and list divergences."""
    base_by = {(request_key(r), r["pass_index"]): r for r in ok_records(base)}
    compared, divergences = 0, []
    diverged_prompts = set()
    for r in sorted(ok_records(spec), key=lambda r: (request_key(r), r["pass_index"])):
        other = base_by.get((request_key(r), r["pass_index"]))
        if other is None:
            continue
        compared += 1
        idx = first_divergence(r["output_text"], other["output_text"])
        if idx is None:
            continue
        dataset, prompt_id, turn = request_key(r)
        bounds = [tokens_before_char(x, idx) for x in (r, other)]
        divergences.append({
            "dataset": dataset, "prompt_id": prompt_id, "turn": turn,
            "pass_index": r["pass_index"], "char_index": idx,
            "token_index_at_least": min(b for b in bounds if b is not None)
            if any(b is not None for b in bounds) else None,
            "spec_excerpt": r["output_text"][max(0, idx - 20):idx + 40],
            "base_excerpt": other["output_text"][max(0, idx - 20):idx + 40],
            # a later turn's prompt holds the earlier answer: it may differ for that reason
            "earlier_turn_diverged": (dataset, prompt_id, r["pass_index"]) in diverged_prompts,
        })
        diverged_prompts.add((dataset, prompt_id, r["pass_index"]))
    return {"compared": compared, "identical": compared - len(divergences),
            "divergences": divergences}


def self_consistency(records: list[dict]) -> dict:
    """Do repeated passes of one run give the same output for each prompt turn?"""
    outputs: dict[tuple, set[str]] = defaultdict(set)
    for r in ok_records(records):
        outputs[request_key(r)].add(r["output_text"])
    varying = sorted("/".join(map(str, k)) for k, v in outputs.items() if len(v) > 1)
    return {"prompts": len(outputs), "varying_across_passes": varying}


def json_validity(records: list[dict]) -> dict:
    """Count outputs of JSON-task requests that parse as JSON."""
    rows = [r for r in ok_records(records) if r["json_valid"] is not None]
    invalid = sorted({f"{r['dataset']}/{r['prompt_id']}/turn{r['turn']}"
                      for r in rows if not r["json_valid"]})
    return {"checked": len(rows), "valid": sum(r["json_valid"] for r in rows), "invalid": invalid}


def _inverse(values: dict[tuple, float]) -> dict[tuple, float]:
    return {k: 1.0 / v for k, v in values.items() if v > 0}


def _speedups(spec: list[dict], base: list[dict], resamples: int, seed: int) -> dict:
    return {"decode_tps": bootstrap_decode_speedup(per_prompt(spec, "decode_tokens_per_s"),
                                                   per_prompt(base, "decode_tokens_per_s"),
                                                   resamples, seed),
            "inv_tpot": bootstrap_decode_speedup(_inverse(per_prompt(spec, "tpot_s")),
                                                 _inverse(per_prompt(base, "tpot_s")),
                                                 resamples, seed),
            "e2e_throughput": bootstrap_e2e_speedup(_sums(spec), _sums(base), resamples, seed)}


def compare_runs(spec_dir: Path, base_dir: Path, resamples: int = 2000, seed: int = 0) -> dict:
    """The full paired comparison of two run directories (JSON-serialisable)."""
    spec_run, spec = read_run(spec_dir)
    base_run, base = read_run(base_dir)
    differences = [{"key": k, "spec": spec_run["config"].get(k), "base": base_run["config"].get(k)}
                   for k in _CONFIG_KEYS_THAT_MUST_MATCH
                   if spec_run["config"].get(k) != base_run["config"].get(k)]
    spec_keys = {request_key(r) for r in ok_records(spec)}
    base_keys = {request_key(r) for r in ok_records(base)}
    greedy = spec_run["config"]["temperature"] == 0 and base_run["config"]["temperature"] == 0
    by_task = {}
    for dataset in sorted({k[0] for k in spec_keys & base_keys}):
        sel = lambda rs: [r for r in rs if r["dataset"] == dataset]  # noqa: E731
        by_task[dataset] = _speedups(sel(spec), sel(base), resamples, seed)
    return {
        "spec_run": {"dir": str(spec_dir), "run_id": spec_run["run_id"],
                     "config_name": spec_run["config_name"], "status": spec_run["status"]},
        "base_run": {"dir": str(base_dir), "run_id": base_run["run_id"],
                     "config_name": base_run["config_name"], "status": base_run["status"]},
        "config_differences": differences,
        "unpaired": {"only_spec": sorted("/".join(map(str, k)) for k in spec_keys - base_keys),
                     "only_base": sorted("/".join(map(str, k)) for k in base_keys - spec_keys)},
        "speedup": _speedups(spec, base, resamples, seed),
        "speedup_by_task": by_task,
        "equality": (output_equality(spec, base) if greedy else
                     {"not_applicable": "output equality is only expected at temperature 0"}),
        "self_consistency": {"spec": self_consistency(spec), "base": self_consistency(base)},
        "json_validity": {"spec": json_validity(spec), "base": json_validity(base)},
    }
