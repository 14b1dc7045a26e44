"""Stage 3: train the draft by top-k distillation from the filtered traces.

Each example is prompt + output; the draft is supervised only at the generated positions,
against the target's renormalised top-k distribution there (KL) plus the token the target
actually produced (CE, weight `ce_weight`). The batches of every step are fixed in advance
by a seeded plan, so a resumed run replays exactly the steps it had not done.

Layout of `<work>/train/`:
    settings.json     TrainConfig + the filtered data's fingerprint + target; must match on resume
    checkpoint.pt     model + optimizer + step, rewritten atomically every `checkpoint_every`
    losses.jsonl      one line per step (loss, kl, ce, lr) and per evaluation
    loss.png          the loss curve (train and held-out)
    done.json         written last: steps, seconds, final held-out agreement
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.model.llama import LlamaModel
from verispec.train.config import TrainConfig
from verispec.train.draft import agreement_stats, causal_forward, distill_loss
from verispec.train.store import ensure_same_settings, load_torch, read_json, save_torch, write_json

MICRO_BATCH_TOKENS = 3072  # padded tokens per forward/backward (bounds activation memory)
EVAL_EXAMPLES = 64


def make_example(record: dict, max_seq_len: int) -> dict | None:
    """Inputs (prompt + output minus its last token) and the supervised tail; None if no room."""
    prompt, output = record["prompt_ids"].long(), record["output_ids"].long()
    n = output.numel()
    inputs = torch.cat([prompt, output])[:-1]   # (P + n - 1,)
    cut = max(0, inputs.numel() - max_seq_len)  # drop the start of a long prompt
    if cut >= prompt.numel() - 1:
        return None
    return {"inputs": inputs[cut:], "first": prompt.numel() - 1 - cut, "n": n,
            "topk_ids": record["topk_ids"], "topk_logprobs": record["topk_logprobs"], "targets": output}


def plan_steps(num_tokens: list[int], cfg: TrainConfig) -> list[list[int]]:
    """Example indices of every step: seeded shuffles per epoch, ~tokens_per_step each."""
    if not num_tokens:
        raise ValueError("no training examples: the filtered data is empty")
    steps: list[list[int]] = []
    epoch = 0
    while len(steps) < cfg.steps:
        order = list(range(len(num_tokens)))
        random.Random(f"{cfg.seed}:epoch:{epoch}").shuffle(order)
        current, tokens = [], 0
        for i in order:
            current.append(i)
            tokens += num_tokens[i]
            if tokens >= cfg.tokens_per_step:
                steps.append(current)
                current, tokens = [], 0
                if len(steps) == cfg.steps:
                    break
        if current and len(steps) < cfg.steps:
            steps.append(current)  # a short last step (matters only for tiny data)
        epoch += 1
    return steps


def lr_at(step: int, cfg, floor: float = 0.1) -> float:
    """Linear warm-up over cfg.warmup_steps, then cosine decay to `floor` x the peak cfg.lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def micro_batches(items: list[dict], key: str, budget: int) -> list[list[dict]]:
    """Items grouped longest first so that a group, padded to its longest `item[key]`,
    holds at most `budget` tokens (one item alone may exceed it)."""
    ordered = sorted(items, key=lambda e: -e[key].numel())
    batches, current = [], []
    for e in ordered:
        if current and (len(current) + 1) * current[0][key].numel() > budget:
            batches.append(current)
            current = []
        current.append(e)
    return batches + ([current] if current else [])


def forward_supervised(model: LlamaModel, batch: list[dict]) -> tuple[torch.Tensor, ...]:
    """Draft logits at every supervised position of `batch`, with the matching targets."""
    longest = max(e["inputs"].numel() for e in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)  # (B, T) right-padded
    rows, cols = [], []
    for b, e in enumerate(batch):
        ids[b, : e["inputs"].numel()] = e["inputs"]
        rows.extend([b] * e["n"])
        cols.extend(range(e["first"], e["first"] + e["n"]))
    hidden = causal_forward(model, ids)[torch.tensor(rows), torch.tensor(cols)]  # (N, hidden)
    logits = model.lm_head(hidden)  # (N, V)
    cat = lambda key: torch.cat([e[key] for e in batch])  # noqa: E731
    return logits, cat("topk_ids"), cat("topk_logprobs"), cat("targets")


def train_step(model: LlamaModel, optimizer, examples: list[dict], cfg: TrainConfig, lr: float) -> dict:
    """One optimiser step over `examples` (gradient accumulation over micro-batches)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = sum(e["n"] for e in examples)
    sums = {"loss": 0.0, "kl": 0.0, "ce": 0.0}
    for batch in micro_batches(examples, "inputs", MICRO_BATCH_TOKENS):
        logits, topk_ids, topk_lp, targets = forward_supervised(model, batch)
        loss, parts = distill_loss(logits, topk_ids, topk_lp, targets, cfg.ce_weight)
        weight = logits.shape[0] / total
        (loss * weight).backward()
        for key in sums:
            sums[key] += parts[key] * weight
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return {**sums, "lr": lr, "tokens": total}


@torch.no_grad()
def evaluate(model: LlamaModel, examples: list[dict], cfg: TrainConfig) -> dict:
    """Held-out loss, greedy agreement with the target and top-k overlap (see agreement_stats)."""
    totals = {"positions": 0.0, "greedy_agree": 0.0, "overlap": 0.0, "loss": 0.0}
    for batch in micro_batches(examples, "inputs", MICRO_BATCH_TOKENS):
        logits, topk_ids, topk_lp, targets = forward_supervised(model, batch)
        _, parts = distill_loss(logits, topk_ids, topk_lp, targets, cfg.ce_weight)
        stats = agreement_stats(logits, topk_ids, topk_lp)
        for key in ("positions", "greedy_agree", "overlap"):
            totals[key] += stats[key]
        totals["loss"] += parts["loss"] * stats["positions"]
    n = max(totals["positions"], 1.0)
    return {"loss": totals["loss"] / n, "greedy_agree": totals["greedy_agree"] / n,
            "overlap": totals["overlap"] / n, "positions": int(totals["positions"])}


def load_examples(path: Path, cfg: TrainConfig) -> list[dict]:
    examples = [make_example(r, cfg.max_seq_len) for r in load_torch(path)["records"]]
    return [e for e in examples if e is not None]


def run_train(cfg: TrainConfig, filtered_dir: Path, train_dir: Path, model: LlamaModel,
              target_name: str, progress: bool = True) -> tuple[dict, bool]:
    """Train (or resume) to cfg.steps; returns (done record, ran). Skips a finished run."""
    report = read_json(filtered_dir / "report.json")
    train_dir.mkdir(parents=True, exist_ok=True)
    ensure_same_settings(train_dir / "settings.json", {"config": cfg.to_dict(), "target": target_name,
                         "data": report["fingerprint"]}, "training")
    if (train_dir / "done.json").exists():
        return read_json(train_dir / "done.json"), False
    train = load_examples(filtered_dir / "train.pt", cfg)
    heldout = load_examples(filtered_dir / "heldout.pt", cfg)[:EVAL_EXAMPLES]
    plan = plan_steps([e["n"] for e in train], cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    start = resume(train_dir, model, optimizer, "model")
    log_path = train_dir / "losses.jsonl"
    t0 = time.perf_counter()
    if start == 0 and heldout:
        log_entry(log_path, {"step": 0, "eval": evaluate(model, heldout, cfg)})
    bar = tqdm(total=cfg.steps, initial=start, desc="train draft", disable=not progress, unit="step")
    for step in range(start, cfg.steps):
        stats = train_step(model, optimizer, [train[i] for i in plan[step]], cfg, lr_at(step, cfg))
        log_entry(log_path, {"step": step + 1, **stats})
        bar.set_postfix(loss=f"{stats['loss']:.3f}", kl=f"{stats['kl']:.3f}")
        bar.update(1)
        done_now = step + 1 == cfg.steps
        if heldout and ((step + 1) % cfg.eval_every == 0 or done_now):
            log_entry(log_path, {"step": step + 1, "eval": evaluate(model, heldout, cfg)})
        if (step + 1) % cfg.checkpoint_every == 0 or done_now:
            save_torch(train_dir / "checkpoint.pt", {"step": step + 1, "model": model.state_dict(),
                                                     "optimizer": optimizer.state_dict()})
    bar.close()
    plot_losses(log_path, train_dir / "loss.png")
    evals = [e["eval"] for e in read_losses(log_path) if "eval" in e]
    done = {"steps": cfg.steps, "seconds_this_run": round(time.perf_counter() - t0, 1),
            "eval_first": evals[0] if evals else None, "eval_last": evals[-1] if evals else None}
    write_json(train_dir / "done.json", done)
    return done, True


def resume(train_dir: Path, module: torch.nn.Module, optimizer, key: str) -> int:
    """Load checkpoint.pt's `key` state into `module` (and the optimizer's) if there is one;
    drop losses.jsonl lines written after it, so a resumed log has each step once. Returns
    its step (0 with no checkpoint: the log starts afresh)."""
    path = train_dir / "checkpoint.pt"
    log_path = train_dir / "losses.jsonl"
    if not path.exists():
        log_path.unlink(missing_ok=True)
        return 0
    ckpt = load_torch(path)
    module.load_state_dict(ckpt[key])
    optimizer.load_state_dict(ckpt["optimizer"])
    kept = [e for e in read_losses(log_path) if e["step"] <= ckpt["step"]]
    log_path.write_text("".join(json.dumps(e) + "\n" for e in kept))
    return int(ckpt["step"])


def load_trained(train_dir: Path, model: LlamaModel) -> LlamaModel:
    """Fill `model` (built with the same TrainConfig) with the final checkpoint's weights."""
    if not (train_dir / "done.json").exists():
        raise ValueError(f"training in {train_dir} is not finished; run the train stage first")
    model.load_state_dict(load_torch(train_dir / "checkpoint.pt")["model"])
    return model


def log_entry(path: Path, entry: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def read_losses(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(log_path: Path, png_path: Path) -> None:
    """Training loss per step and held-out loss / greedy agreement per evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = read_losses(log_path)
    steps = [e for e in entries if "loss" in e]
    evals = [e for e in entries if "eval" in e]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([e["step"] for e in steps], [e["loss"] for e in steps], lw=0.8, label="train loss")
    ax1.plot([e["step"] for e in evals], [e["eval"]["loss"] for e in evals], "o-", label="held-out loss")
    ax1.set_xlabel("step")
    ax1.set_ylabel("KL(top-k) + ce_weight * CE")
    ax1.legend()
    ax2.plot([e["step"] for e in evals], [e["eval"]["greedy_agree"] for e in evals], "o-",
             label="greedy agreement")
    ax2.plot([e["step"] for e in evals], [e["eval"]["overlap"] for e in evals], "s-",
             label="top-k overlap (T=1)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("held-out, per position")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
