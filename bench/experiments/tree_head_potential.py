"""Could a tree of head drafts pay on the Qwen2.5-Coder pair? A bound, measured without building it.

`tree_potential.py` bounded trees of prompt-lookup drafts on the default model, where every
verify token costs ~1 ms of compute. A 1.5B target at batch 1 streams its weights once a
pass whatever the width, so extra verify tokens cost little; and an EAGLE-style head ranks
its whole vocabulary, so its second and third guesses are there for free. This measures both
sides for a trained head:

Cost: the target's batch-1 forward of w query tokens after ~300 tokens of context, relative
to w = 1 (`tree_potential.width_costs`).
Benefit, on the head's held-out traces (`train-draft eagle`'s `heldout.pt`; greedy): at every
output position, whether each depth's draft would be accepted. A shape (k1, k2, ...) drafts
k1 candidates at depth 1 and k_{d+1} children under the first candidate of depth d (all 1s:
a chain); a round accepts depth d while every earlier depth's first candidate was right and
the target's top-1 is among depth d's. Depth 1 reads the target's feature, exactly as a first
draft does; depth d the head's own output of depth d - 1, as a chain drafts (in these dense
passes the earlier positions' features are the head's too, where serving keeps the
target's: the approximation the head's training and evaluation make). The verify width is
1 + the drafts; the head runs one pass a depth, so each shape is compared with the best chain
no deeper. The bound ignores the tree's attention mask and the head's passes, and held-out
agreement runs above live acceptance (0.43 vs 0.34 for the first draft, docs/benchmarks.md):
compare shapes, not absolute speed-ups.

    .venv/bin/python bench/experiments/tree_head_potential.py --threads 2 --max-load 1.5
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
sys.path.insert(0, str(Path(__file__).resolve().parent))      # for tree_potential
import common  # noqa: E402
from tree_potential import width_costs  # noqa: E402

from verispec.config import SpecConfig  # noqa: E402
from verispec.model.eagle import load_head  # noqa: E402
from verispec.model.fetch import cache_root  # noqa: E402
from verispec.spec.eagle import registered_head  # noqa: E402
from verispec.train import eagle as train_eagle  # noqa: E402
from verispec.train.distill import micro_batches  # noqa: E402
from verispec.train.store import load_torch  # noqa: E402

# Draft counts per depth: (k1, k2, ...) is k1 candidates at depth 1 and, under the first
# candidate of each depth, k_{d+1} children; all 1s is a chain.
SHAPES = tuple((1,) * d for d in range(1, 8)) + ((2,), (3,), (4,), (2, 1), (3, 1), (3, 2), (4, 3), (3, 2, 1),
                                               (2, 2, 1, 1), (3, 2, 1, 1), (4, 1, 1, 1), (2, 1, 1, 1, 1, 1))
DEPTHS = max(len(shape) for shape in SHAPES)
TOP = 8  # the head's guesses kept per position


@torch.no_grad()
def head_guesses(head, records: list[dict], depths: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Per held-out record: the head's top-TOP target ids at each output position for drafts
    at depth 1..`depths`, and the target's top-1 there. A depth-1 draft reads the target's
    feature; a depth-d one the head's own output of the depth d - 1 pass one position back
    (as a chain drafts; along the answer, which is the path every accepted draft is on)."""
    out = []
    for batch in micro_batches(records, "ids", train_eagle.MICRO_BATCH_TOKENS):
        longest = max(r["ids"].numel() for r in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        h = torch.zeros(len(batch), longest, batch[0]["h"].shape[1])
        for b, r in enumerate(batch):
            ids[b, :r["ids"].numel()], h[b, :r["ids"].numel()] = r["ids"].long(), r["h"].float()
        features, tops = h, []
        for _ in range(depths):
            logits, g = train_eagle.head_forward(head, ids, features)   # g[:, i] stands for h[:, i + 1]
            tops.append(head.vocab_ids[logits.topk(TOP, dim=-1).indices])   # (B, T-1, TOP) target ids
            features = torch.cat([h[:, :1], g], dim=1)
        for b, r in enumerate(batch):
            n, first = r["ids"].numel(), r["first"]
            # entry i predicts ids[i + 2]; outputs start at `first`, whose top-1 the record holds
            out.append(([top[b, first - 2:n - 2] for top in tops], r["topk_ids"][:n - first, 0].long()))
    return out


def accepted(guesses, shape: tuple[int, ...]) -> tuple[int, int]:
    """(drafts accepted, rounds) with greedy verification of `shape`, a round at every output
    position: depth d is reached while every earlier depth's first candidate was right."""
    total = rounds = 0
    for by_depth, truth in guesses:
        n = truth.numel()
        hits = [(by_depth[d][:, :k] == truth[:, None]).any(-1).tolist() for d, k in enumerate(shape)]
        firsts = [(by_depth[d][:, 0] == truth).tolist() for d in range(len(shape))]
        for j in range(n):
            for d in range(len(shape)):
                if j + d >= n or not hits[d][j + d]:
                    break
                total += 1
                if not firsts[d][j + d]:
                    break  # accepted through a later candidate: it has no children
        rounds += n
    return total, rounds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--head", type=Path, help="head directory (default: the model's registered head)")
    p.add_argument("--features", type=Path, help="held-out features (default: train-draft's for the model)")
    p.add_argument("--reps", type=int, default=9)
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    base = common.base_config(args)
    models = common.load_models(base)
    engine = common.make_engine(models, replace(base, spec=SpecConfig(method="none")))
    costs = width_costs(engine, max(1 + sum(shape) for shape in SHAPES), args.reps)
    head_dir = args.head or registered_head(args.model)
    if head_dir is None:
        p.error(f"--head: {args.model} has no registered head")
    head = load_head(head_dir).bind(models.target.embed_tokens)
    features = args.features or cache_root() / "train" / args.model / "eagle" / "features" / "heldout.pt"
    records = load_torch(features)["records"]
    guesses = head_guesses(head, records, DEPTHS)
    shapes = {}
    for shape in SHAPES:
        drafts, rounds = accepted(guesses, shape)
        width = 1 + sum(shape)
        shapes[shape] = {"depth": len(shape), "width": width, "accepted_per_round": drafts / rounds,
                         "cost_vs_plain": costs[width] / costs[1],
                         "bound_vs_plain": (1 + drafts / rounds) / (costs[width] / costs[1])}
    rows = []
    for shape, row in shapes.items():  # against the best chain with no more head passes
        chains = [c["bound_vs_plain"] for s, c in shapes.items() if set(s) == {1} and len(s) <= len(shape)]
        row["bound_vs_best_chain"] = row["bound_vs_plain"] / max(chains)
        rows.append([",".join(map(str, shape)), row["depth"], row["width"], f"{row['cost_vs_plain']:.3f}",
                     f"{row['accepted_per_round']:.3f}", f"{row['bound_vs_plain']:.2f}", f"{row['bound_vs_best_chain']:.3f}"])
    text = common.markdown_table(["drafts per depth", "depth (head passes)", "verify width", "cost / plain step",
                                  "drafts accepted a round", "bound / plain", "bound / best chain no deeper"], rows)
    print(text)
    common.write_result("tree-head-potential", args, header, t0, {
        "head": str(head_dir), "features": str(features), "positions": sum(t.numel() for _, t in guesses),
        "width_costs_s": costs, "shapes": {",".join(map(str, k)): v for k, v in shapes.items()},
        "table_markdown": text},
        common.RESULTS_DIR / f"tree-head-potential-{args.model}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
