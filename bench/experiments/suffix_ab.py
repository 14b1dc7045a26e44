"""The suffix proposer of the working tree against the one at another git revision (or
against its own Python index), with an A/A.

Loads `verispec/spec/suffix.py` as it is at `--baseline-rev` (via `git show`) and registers
it as the method `suffix_baseline` (`--baseline-rev python-index`: the working tree's
proposer on suffix.py's Python index instead of the C++ one); then runs
`bench/agentic.py`'s workloads in-process as `oracle_ceiling.py` does (one engine per contender, C chains turn by turn, each turn plain
first, then the others in a shuffled order; every output must equal plain's): plain, the
working tree's suffix twice (`suffix`, `suffix-aa`: the spread of identical contenders) and
the baseline's. A change to the proposer keeps its gain only where it exceeds the A/A's
distance. The contenders share one process, so one's garbage-collection pauses can land in
another's turn: a baseline that leaves more to collect is, if anything, flattered.

    .venv/bin/python bench/experiments/suffix_ab.py --baseline-rev HEAD~1 --workload edits --concurrency 16
    .venv/bin/python bench/experiments/suffix_ab.py --baseline-rev python-index --workload retries
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "experiments"))
from oracle_ceiling import add_workload_args, measure  # noqa: E402
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
    add_workload_args(ap, problems=32, concurrency=16)
    args = ap.parse_args(argv)
    if args.baseline_rev == "python-index":
        from verispec.spec.suffix import SuffixProposer
        register_proposer("suffix_baseline", lambda context: SuffixProposer(native=False))
    else:
        baseline = load_baseline(args.baseline_rev)
        register_proposer("suffix_baseline", lambda context: baseline.SuffixProposer())
    methods = {"none": "none", "suffix": "suffix", "suffix-aa": "suffix", "suffix-baseline": "suffix_baseline"}
    measure({name: SpecConfig(method=m) for name, m in methods.items()}, args, "suffix-ab")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
