"""What suffix decoding costs per row per step, in process: the time of the proposer's
`offer` (extending the row's tries with its new tokens, then the lookup) and of `forget`
(a finished output joining the global trie), over the agentic `retries` workload on the
tuning half of HumanEval (bench/agentic.py), greedy, 256 tokens, the default model; and the
garbage collector's pauses meanwhile (the tries should give it nothing to scan). `--index`:
the C++ index the engine runs where it builds (default), or suffix.py's Python one.

    .venv/bin/python bench/suffix_lookup.py --out bench/results/suffix-lookup-<machine>.json
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402
from agentic import RETRIES  # noqa: E402
from verispec.bench.datasets import load_datasets  # noqa: E402
from verispec.bench.provenance import machine_info  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=6)
    ap.add_argument("--index", choices=("native", "python"), default="native")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from verispec.engine.llm import LLM
    from verispec.sampling import SamplingParams
    from verispec.spec import suffix as suffix_mod
    from verispec.spec.suffix import SuffixProposer
    real_make = suffix_mod.make_index
    suffix_mod.make_index = lambda native=None: real_make(native=args.index == "native")

    timings: dict[str, list[float]] = {"offer_per_row_us": [], "forget_us": []}
    real_offer, real_forget = SuffixProposer.offer, SuffixProposer.forget

    def offer(self, rows, budgets):
        start = time.perf_counter()
        out = real_offer(self, rows, budgets)
        timings["offer_per_row_us"].append((time.perf_counter() - start) * 1e6 / max(1, len(rows)))
        return out

    def forget(self, request_id):
        start = time.perf_counter()
        real_forget(self, request_id)
        timings["forget_us"].append((time.perf_counter() - start) * 1e6)
    SuffixProposer.offer, SuffixProposer.forget = offer, forget
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1e3)
    problems = [p for p in load_datasets("humaneval")[0]["humaneval"]
                if common.prompt_half("humaneval", p.prompt_id) == "tuning"][: args.problems]
    llm = LLM(speculative_config={"method": "suffix"})
    gc.callbacks.append(on_gc)
    for p in problems:
        for prefix in RETRIES:
            llm.chat([{"role": "user", "content": prefix + p.messages[0]["content"]}],
                     SamplingParams(temperature=0, max_tokens=256), use_tqdm=False)
    summary = {name: {"median": statistics.median(v), "p90": sorted(v)[int(0.9 * (len(v) - 1))],
                      "max": max(v), "calls": len(v)} for name, v in timings.items()}
    gc.callbacks.remove(on_gc)
    summary["gc_pauses_ms"] = {"count": len(pauses), "total": sum(pauses), "max": max(pauses, default=0.0)}
    proposer = llm.llm_engine.proposers["suffix"]
    summary["proposer_stats"] = proposer.stats()
    index = proposer.index
    held = trie_bytes(index.trie) if isinstance(index, suffix_mod.PythonIndex) else index.trie_bytes()
    summary["index"] = args.index
    summary["global_bytes_per_node"] = held / index.num_nodes()
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "machine": machine_info(),
                                        "config": llm.llm_engine.config.to_dict()}, indent=1) + "\n")
    return 0


def trie_bytes(trie) -> int:
    """The global trie's memory: its arrays, its child dict and the int objects in it."""
    arrays = [v for v in vars(trie).values() if hasattr(v, "buffer_info")]
    return (sum(sys.getsizeof(a) for a in arrays) + sys.getsizeof(trie._child)
            + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in trie._child.items()))


if __name__ == "__main__":
    raise SystemExit(main())
