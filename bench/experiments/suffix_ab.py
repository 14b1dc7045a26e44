"""The suffix proposer of the working tree against the one at another git revision, with an A/A.

Loads `verispec/spec/suffix.py` as it is at `--baseline-rev` (via `git show`) and registers
it as the method `suffix_baseline`; then runs `bench/agentic.py`'s workloads in-process as
`oracle_ceiling.py` does (one engine per contender, C chains turn by turn, each turn plain
first, then the others in a shuffled order; every output must equal plain's): plain, the
working tree's suffix twice (`suffix`, `suffix-aa`: the spread of identical contenders) and
the baseline's. A change to the proposer keeps its gain only where it exceeds the A/A's
distance. The contenders share one process, so one's garbage-collection pauses can land in
another's turn: a baseline that leaves more to collect is, if anything, flattered.

    .venv/bin/python bench/experiments/suffix_ab.py --baseline-rev HEAD~1 --workload edits --concurrency 16
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "experiments"))
import common  # noqa: E402
from oracle_ceiling import run_group, summarise  # noqa: E402
from verispec.bench.datasets import load_datasets  # noqa: E402
from verispec.bench.provenance import machine_info  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.spec.proposer import register_proposer  # noqa: E402


def load_baseline(rev: str):
    """verispec/spec/suffix.py at `rev`, imported as its own module."""
    source = subprocess.run(["git", "show", f"{rev}:verispec/spec/suffix.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "suffix_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("suffix_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-rev", required=True)
    ap.add_argument("--workload", choices=("edits", "retries"), default="edits")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--split", choices=("eval", "tuning"), default="eval")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from verispec import LLM

    baseline = load_baseline(args.baseline_rev)
    register_proposer("suffix_baseline", lambda context: baseline.SuffixProposer())
    problems = load_datasets("humaneval")[0]["humaneval"]
    other = "tuning" if args.split == "eval" else "eval"
    chosen = [p for p in problems if common.prompt_half("humaneval", p.prompt_id) == args.split]
    random.Random(0).shuffle(chosen)
    warm = next(p for p in problems if common.prompt_half("humaneval", p.prompt_id) == other)
    methods = {"none": "none", "suffix": "suffix", "suffix-aa": "suffix", "suffix-baseline": "suffix_baseline"}
    llms = {name: LLM(spec=SpecConfig(method=m), threads=args.threads) for name, m in methods.items()}
    run_group(llms, "warm", args.workload, [warm.messages[0]["content"]], args.max_tokens)
    firsts = [p.messages[0]["content"] for p in chosen[: args.problems]]
    C = args.concurrency
    chains = [c for g in range(0, len(firsts), C)
              for c in run_group(llms, str(g), args.workload, firsts[g: g + C], args.max_tokens)]
    summary, by_turn = summarise(chains, list(llms))
    print(json.dumps({"summary": summary, "speedup_by_turn": by_turn}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "suffix-ab", "args": {**vars(args), "out": str(args.out)},
                                        "configs": {n: llms[n].config.to_dict() for n in llms},
                                        "machine": machine_info(), "summary": summary,
                                        "speedup_by_turn": by_turn, "chains": chains}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
