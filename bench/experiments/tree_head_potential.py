"""Could a tree of head drafts pay on the Qwen2.5-Coder pair? A bound, measured without building it.

`tree_potential.py` bounded trees of prompt-lookup drafts on the default model, where every
verify token costs ~1 ms of compute. A 1.5B target at batch 1 streams its weights once a
pass whatever the width, so extra verify tokens cost little; and an EAGLE-style head ranks
its whole vocabulary, so its second and third guesses are there for free. This measures both
sides for a trained head:

Cost: the target's batch-1 forward of w query tokens after ~300 tokens of context, relative
to w = 1 (the median of `--reps` timings; widths interleaved, so a slow spell of the machine
lands on all of them).
Benefit, on the head's held-out traces (`train-draft eagle`'s `heldout.pt`; greedy, exact at
depths 1 and 2): at every output position, whether the target's top-1 is among the head's
top-k1 (depth 1, teacher-forced: the target's own feature, as a first draft reads) and,
where the head's top-1 was right, whether the next top-1 is among the head's top-k2 from its
own feature (depth 2, as a second draft reads). A shape (k1, k2) is a tree of k1 depth-1
candidates and k2 children under the first; (1, 0) and (1, 1) are chains of 1 and 2 drafts.
Accepted drafts a round are counted exactly; its verify width is 1 + k1 + k2. The bound
ignores the tree's attention mask and the head's own passes (one a depth: equal for a chain
and a tree of equal depth), and held-out agreement runs above live acceptance (0.43 vs 0.34
for the first draft, docs/benchmarks.md), so compare shapes, not absolute speed-ups.

    .venv/bin/python bench/experiments/tree_head_potential.py --threads 2 --max-load 1.5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
import common  # noqa: E402

from verispec.config import SpecConfig  # noqa: E402
from verispec.engine.runner import RowInput  # noqa: E402
from verispec.model.eagle import load_head  # noqa: E402
from verispec.model.fetch import cache_root  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402
from verispec.spec.eagle import registered_head  # noqa: E402
from verispec.train import eagle as train_eagle  # noqa: E402
from verispec.train.distill import micro_batches  # noqa: E402
from verispec.train.store import load_torch  # noqa: E402

SHAPES = ((1, 0), (2, 0), (3, 0), (4, 0), (1, 1), (2, 1), (3, 1), (3, 2), (4, 3), (6, 4))
TOP = 8  # the head's guesses kept per position


def width_costs(engine, max_width: int, reps: int) -> dict[int, float]:
    """Seconds of one batch-1 forward of w = 1..max_width query tokens after ~300 tokens of
    context: per width the median of `reps` timings, the widths taken in turn each rep."""
    context = list(range(1000, 1300))
    engine.add_request("ctx", context, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    cached = engine.kv.open_sequence("probe", context + [5])   # the context's KV from the prefix cache
    engine.kv.allocate_slots("probe", cached, len(context) + 1 + max_width)
    table = engine.kv.block_table("probe")
    times: dict[int, list[float]] = {w: [] for w in range(1, max_width + 1)}
    for _ in range(reps):
        for w in times:
            row = RowInput(list(range(2000, 2000 + w)), len(context), table, 0)
            t0 = time.perf_counter()
            engine.target.forward([row])
            times[w].append(time.perf_counter() - t0)
    return {w: statistics.median(t) for w, t in times.items()}


@torch.no_grad()
def head_guesses(head, records: list[dict], own_features: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per held-out record: (the head's top-TOP target ids at each output position, the
    target's top-1 there), positions in order; own_features: every input feature the head's
    prediction of it (a second draft's), else the target's (a first draft's)."""
    cfg = train_eagle.EagleConfig(num_draft_vocab=len(head.vocab_ids), own_feature_prob=1.0 if own_features else 0.0)
    out = []
    for batch in micro_batches(records, "ids", train_eagle.MICRO_BATCH_TOKENS):
        longest = max(r["ids"].numel() for r in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        h = torch.zeros(len(batch), longest, batch[0]["h"].shape[1])
        for b, r in enumerate(batch):
            ids[b, :r["ids"].numel()], h[b, :r["ids"].numel()] = r["ids"].long(), r["h"].float()
        logits, _ = train_eagle.head_forward(head, ids, train_eagle._mixed_inputs(head, ids, h, cfg.own_feature_prob))
        top = head.vocab_ids[logits.topk(TOP, dim=-1).indices]           # (B, T-1, TOP) target ids
        for b, r in enumerate(batch):
            n, first = r["ids"].numel(), r["first"]
            # entry i predicts ids[i + 2]; outputs start at `first`, whose top-1 the record holds
            out.append((top[b, first - 2:n - 2], r["topk_ids"][:n - first, 0].long()))
    return out


def accepted(depth1, depth2, k1: int, k2: int) -> tuple[float, int]:
    """(drafts accepted, rounds) over every position: greedy verification of shape (k1, k2)."""
    total, rounds = 0.0, 0
    for (guess1, truth), (guess2, _) in zip(depth1, depth2):
        hit1 = (guess1[:, :k1] == truth[:, None]).any(-1)
        first = guess1[:, 0] == truth
        hit2 = torch.zeros_like(hit1)
        if k2:  # the next position's guesses from the head's own feature, under its top-1
            hit2[:-1] = first[:-1] & (guess2[1:, :k2] == truth[1:, None]).any(-1)
        total += float(hit1.sum() + hit2.sum())
        rounds += hit1.numel()
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
    widest = max(1 + k1 + k2 for k1, k2 in SHAPES)
    costs = width_costs(engine, widest, args.reps)
    head_dir = args.head or registered_head(args.model)
    if head_dir is None:
        p.error(f"--head: {args.model} has no registered head")
    head = load_head(head_dir).bind(models.target.embed_tokens)
    features = args.features or cache_root() / "train" / args.model / "eagle" / "features" / "heldout.pt"
    records = load_torch(features)["records"]
    depth1, depth2 = head_guesses(head, records, False), head_guesses(head, records, True)
    rows, shapes = [], {}
    chain = {}
    for k1, k2 in SHAPES:
        drafts, rounds = accepted(depth1, depth2, k1, k2)
        width = 1 + k1 + k2
        tokens = 1 + drafts / rounds
        bound = tokens / (costs[width] / costs[1])
        if k1 == 1:
            chain[1 if not k2 else 2] = bound
        shapes[f"{k1},{k2}"] = {"width": width, "accepted_per_round": drafts / rounds, "cost_vs_plain": costs[width] / costs[1],
                                "bound_vs_plain": bound}
    for name, s in shapes.items():
        depth = 1 if name.endswith(",0") else 2
        s["bound_vs_chain"] = s["bound_vs_plain"] / chain[depth]
        rows.append([name, s["width"], f"{s['cost_vs_plain']:.3f}", f"{s['accepted_per_round']:.3f}",
                     f"{s['bound_vs_plain']:.2f}", f"{s['bound_vs_chain']:.3f}"])
    text = common.markdown_table(["k1,k2", "verify width", "cost / plain step", "drafts accepted a round",
                                  "bound / plain", "bound / chain of equal depth"], rows)
    print(text)
    common.write_result("tree-head-potential", args, header, t0, {
        "head": str(head_dir), "features": str(features), "positions": sum(t.numel() for _, t in depth1),
        "width_costs_s": costs, "shapes": shapes, "table_markdown": text},
        common.RESULTS_DIR / f"tree-head-potential-{args.model}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
