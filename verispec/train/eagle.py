"""EAGLE-style head training: features from the target, distillation, export.

Reads the filtered traces (prompt + the target's own output, with its top-k log-probs at
every generated position) and runs in three resumable steps under `<work>/eagle/`:

    features/   the target's final-normed hidden state h_i at every position of every
                trace (bf16), from the same model the engine runs (weight format included:
                the head must read at serving time what it was trained on); vocab.json,
                the N most frequent output tokens of the training traces (the head's vocabulary)
    train/      settings.json, checkpoint.pt, losses.jsonl, done.json
    export      `save_head` into <cache>/heads/<target>/ (or --out)

Head entry i reads (t_{i+1}, h_i) and is supervised where t_{i+2} is a generated token:
    KL(p || q) with p the target's distribution at position i+1 restricted to the head's
               vocabulary (softmax of its LM head's N rows at h_{i+1}: exact over the
               subset, where the traces' top-k would truncate it), q the head's softmax
    + ce_weight * CE of t_{i+2} (when inside the vocabulary)
    + feature_weight * smooth-L1(g_i, h_{i+1})  (g_i: the head's output feature)
Teacher forcing: an entry reads the target's h_i; with `own_feature_prob` > 0 that share of
entries reads the head's own g_{i-1} instead, as drafts past the first do at serving time
(EAGLE's training on its own features).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from verispec.model.eagle import EagleHead
from verispec.model.llama import LlamaModel
from verispec.train.distill import log_entry, lr_at, micro_batches, plan_steps, read_losses, resume
from verispec.train.draft import _dense_attention, causal_forward, rope_tables
from verispec.train.store import as_stored, ensure_same_settings, load_torch, read_json, save_torch, write_json


@dataclass(frozen=True)
class EagleConfig:
    """The head's vocabulary and the optimisation."""

    num_draft_vocab: int = 4096      # N: the most frequent output tokens of the training traces
    init_layer: int = -1             # the target layer the head's layer starts from
    steps: int = 600
    tokens_per_step: int = 2048      # supervised tokens per optimiser step, about
    max_seq_len: int = 384           # prompt + output tokens per example (longer: prompt cut)
    lr: float = 1e-3
    warmup_steps: int = 20
    ce_weight: float = 0.2
    feature_weight: float = 1.0
    supervise_prompt: bool = False   # also train on prompt positions (the target's distribution there)
    own_feature_prob: float = 0.0    # share of input features replaced by the head's own prediction
    checkpoint_every: int = 50
    eval_every: int = 100
    seed: int = 0

    def __post_init__(self):
        if not 16 <= self.num_draft_vocab <= 262144:
            raise ValueError(f"num_draft_vocab must be in [16, 262144], got {self.num_draft_vocab}")
        if self.steps < 1 or self.tokens_per_step < 16 or not 0 < self.lr < 1:
            raise ValueError("steps >= 1, tokens_per_step >= 16 and lr in (0, 1) are required")

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------- features
def sequence(record: dict, max_seq_len: int) -> tuple[torch.Tensor, int]:
    """(ids of prompt + output, cut to the last max_seq_len, index of the first output token)."""
    prompt, output = record["prompt_ids"].long(), record["output_ids"].long()
    ids = torch.cat([prompt, output])
    cut = max(0, ids.numel() - max_seq_len)
    return ids[cut:], max(1, prompt.numel() - cut)


FEATURE_BATCH_TOKENS = 8192  # padded tokens per target pass of the features stage


@torch.inference_mode()
def target_features(model: LlamaModel, records: list[dict], max_seq_len: int, progress: str | None = None) -> list[dict]:
    """Per record, in order: ids (T,), first output index, h (T, H) bf16, and the top-k of the
    outputs. Records are batched by length, right-padded (a causal pass: padding after a
    position never changes its state); `progress` names a progress bar (None: none)."""
    items = []
    for index, r in enumerate(records):
        ids, first = sequence(r, max_seq_len)
        items.append({"ids": ids, "first": first, "index": index})
    out: list[dict] = [{} for _ in records]
    for batch in tqdm(micro_batches(items, "ids", FEATURE_BATCH_TOKENS), desc=progress, disable=progress is None):
        padded = torch.zeros(len(batch), batch[0]["ids"].numel(), dtype=torch.long)  # longest first
        for b, e in enumerate(batch):
            padded[b, : e["ids"].numel()] = e["ids"]
        h = causal_forward(model, padded)                             # (B, T, H) float32
        for b, e in enumerate(batch):
            r, n = records[e["index"]], e["ids"].numel()
            n_out = n - e["first"]
            out[e["index"]] = {"ids": e["ids"].to(torch.int32), "first": e["first"], "h": h[b, :n].to(torch.bfloat16),
                               "topk_ids": r["topk_ids"][-n_out:], "topk_logprobs": r["topk_logprobs"][-n_out:]}
    return out


def draft_vocabulary(records: list[dict], n: int) -> list[int]:
    """The n most frequent output tokens (ties by id), sorted by id."""
    counts = Counter(int(t) for r in records for t in r["output_ids"].tolist())
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return sorted(t for t, _ in top)


def run_features(cfg: EagleConfig, filtered_dir: Path, out_dir: Path, model: LlamaModel,
                 progress: bool = True) -> dict:
    """Compute the features once (skipped when done with the same data and settings)."""
    report = read_json(filtered_dir / "report.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    ensure_same_settings(out_dir / "settings.json", {"data": report["fingerprint"], "max_seq_len": cfg.max_seq_len,
                         "num_draft_vocab": cfg.num_draft_vocab}, "features")
    if (out_dir / "done.json").exists():
        return read_json(out_dir / "done.json")
    t0 = time.perf_counter()
    train = load_torch(filtered_dir / "train.pt")["records"]
    heldout = load_torch(filtered_dir / "heldout.pt")["records"]
    vocab = draft_vocabulary(train, cfg.num_draft_vocab)
    covered = _coverage(train, vocab)
    write_json(out_dir / "vocab.json", {"vocab_ids": vocab, "train_output_coverage": covered})
    for name, records in (("heldout", heldout), ("train", train)):
        feats = target_features(model, records, cfg.max_seq_len, f"features ({name})" if progress else None)
        save_torch(out_dir / f"{name}.pt", {"records": feats})
    done = {"train": len(train), "heldout": len(heldout), "vocab": len(vocab),
            "train_output_coverage": covered, "seconds": round(time.perf_counter() - t0, 1)}
    write_json(out_dir / "done.json", done)
    return done


def _coverage(records: list[dict], vocab: list[int]) -> float:
    keep = set(vocab)
    tokens = [int(t) for r in records for t in r["output_ids"].tolist()]
    return sum(t in keep for t in tokens) / max(1, len(tokens))


# ---------------------------------------------------------------------- the head
def init_head(target: LlamaModel, vocab_ids: list[int], init_layer: int = -1) -> EagleHead:
    """A float32 head: its layer a copy of a target layer, its LM head the target's rows of
    `vocab_ids`, its norm the target's final norm, fc random; bound to the target's embedding."""
    head = EagleHead(target.cfg, torch.tensor(vocab_ids))
    layer = target.layers[init_layer]
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            src = layer.get_submodule(name.rsplit(".", 1)[0])
            p.copy_(_dense_weight(src, name.rsplit(".", 1)[1]))
        head.norm.weight.copy_(target.norm.weight.float())
        head.lm_head.weight.copy_(_dense_weight(target.lm_head, "weight")[head.vocab_ids])
        torch.nn.init.normal_(head.fc.weight, std=0.02)
        h = target.cfg.hidden_size  # start near "the feature passes through"
        head.fc.weight[:, h:] += torch.eye(h)
    return head.bind(target.embed_tokens)


def _dense_weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A float32 copy of a (possibly packed or quantized) linear's or norm's parameter."""
    if name == "weight" and not isinstance(getattr(module, "weight", None), torch.Tensor):
        eye = torch.eye(module.in_features)   # rows of I @ W^T + b: the weight, plus the bias
        out = module.forward(eye.to(torch.bfloat16) if _wants_bf16(module) else eye).float()
        bias = getattr(module, "bias", None)
        return (out - bias.float() if bias is not None else out).T.contiguous()
    return getattr(module, name).detach().float().clone()


def _wants_bf16(module) -> bool:
    return type(module).__name__ in ("Int4Linear", "Bf16Linear")


def head_forward(head: EagleHead, ids: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced dense pass: ids (B, T), h (B, T, H) -> (logits (B, T-1, N), g (B, T-1, H)) of
    entries 0..T-2 (entry i reads ids[i + 1] and h[i])."""
    x = head.inputs(ids[:, 1:], h[:, :-1].float())                    # (B, T-1, H)
    cos, sin = rope_tables(head, x.shape[1], x.device)
    block = head.layer
    x = x + _dense_attention(block.self_attn, block.input_layernorm(x), cos, sin)
    x = x + block.mlp(block.post_attention_layernorm(x))
    g = head.norm(x)
    return head.lm_head(g), g


def teacher_rows(target: LlamaModel, vocab_ids) -> torch.Tensor:
    """The target's LM head rows of the head's vocabulary (N, H) float32: the teacher's logits."""
    return _dense_weight(target.lm_head, "weight")[torch.as_tensor(vocab_ids)]


def head_loss(head: EagleHead, batch: list[dict], cfg: EagleConfig, remap: torch.Tensor,
              teacher: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The loss over a right-padded batch of feature records; `remap` (V,) target id -> head
    index or -1; `teacher` (N, H) the target's LM head rows of the head's vocabulary."""
    longest = max(r["ids"].numel() for r in batch)
    H = batch[0]["h"].shape[1]
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    h = torch.zeros(len(batch), longest, H)
    rows, cols, top1 = [], [], []
    for b, r in enumerate(batch):
        n, first = r["ids"].numel(), r["first"]
        ids[b, :n], h[b, :n] = r["ids"].long(), r["h"].float()
        # entry i predicts ids[i + 2]: generated tokens at first.. -> entries first - 2..
        lo = 0 if cfg.supervise_prompt else max(0, first - 2)
        rows += [b] * (n - 2 - lo)
        cols += range(lo, n - 2)
        # the target's top-1 over the full vocabulary where the traces have it (outputs); -2 elsewhere
        top1 += [-2] * max(0, first - 2 - lo) + r["topk_ids"][max(0, lo + 2 - first):, 0].long().tolist()
    logits, g = head_forward(head, ids, _mixed_inputs(head, ids, h, cfg.own_feature_prob))
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    logits, g = logits[rows_t, cols_t], g[rows_t, cols_t]            # (M, N), (M, H)
    target_next = h[rows_t, cols_t + 1]                               # (M, H)
    sampled = remap[ids[rows_t, cols_t + 2]]                          # (M,)
    top1 = torch.tensor(top1)
    top1_sub = torch.where(top1 >= 0, remap[top1.clamp(min=0)], top1)  # -1: outside the subset
    return _loss_terms(logits, g, target_next, sampled, top1_sub, teacher, cfg)


def _mixed_inputs(head: EagleHead, ids: torch.Tensor, h: torch.Tensor, prob: float) -> torch.Tensor:
    """h with a random share `prob` of positions i >= 1 replaced by the head's own output at
    i - 1 (its prediction of h_i, from a teacher-forced pass without gradient): drafts past
    the first read such features at serving time, which pure teacher forcing never shows."""
    if prob <= 0:
        return h
    with torch.no_grad():
        _, g = head_forward(head, ids, h)                             # g[:, i] stands for h[:, i + 1]
    own = torch.cat([h[:, :1], g], dim=1)                             # own[:, i] stands for h[:, i]
    return torch.where(torch.rand(h.shape[0], h.shape[1], 1) < prob, own, h)


def _loss_terms(logits, g, target_next, sampled, top1_sub, teacher, cfg: EagleConfig):
    """KL to the target's distribution over the subset + CE + smooth-L1 on the next
    feature; also greedy agreement with the target's top-1 over the full vocabulary."""
    logq = torch.log_softmax(logits, dim=-1)                          # (M, N)
    logp = torch.log_softmax(target_next @ teacher.T, dim=-1)        # (M, N)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    ok = sampled >= 0
    ce = -logq[ok].gather(1, sampled[ok, None]).mean() if ok.any() else logits.sum() * 0
    feat = F.smooth_l1_loss(g, target_next)
    loss = kl + cfg.ce_weight * ce + cfg.feature_weight * feat
    scored = top1_sub != -2                                           # generated positions
    agree = (logits.argmax(-1)[scored] == top1_sub[scored]).float().sum().item()  # top-1 outside: never
    return loss, {"loss": loss.item(), "kl": kl.item(), "ce": ce.item(), "feat": feat.item(),
                  "agree": agree, "positions": float(scored.sum())}


# ---------------------------------------------------------------------- training loop
MICRO_BATCH_TOKENS = 4096   # a micro-batch's padded tokens (the head's activations are small)
LR_FLOOR = 0.05             # the cosine decays to this fraction of the peak rate


def segment_lr(step: int, cfg: EagleConfig, segments: list[list[int]]) -> float:
    """The learning rate at `step`: each segment [a, b) of the schedule warms up and decays
    on its own (a run extended past its steps restarts warm-up and cosine where it ended)."""
    for a, b in segments:
        if a <= step < b:
            return lr_at(step - a, replace(cfg, steps=b - a), LR_FLOOR)
    raise ValueError(f"step {step} is outside the schedule {segments}")


def train_steps(head: EagleHead, records: list[dict], cfg: EagleConfig, optimizer, teacher: torch.Tensor,
                start: int = 0, on_step=None, segments: list[list[int]] | None = None) -> None:
    """Steps start..cfg.steps of the seeded plan (a prefix of a longer run's plan: the same
    examples at each step whatever cfg.steps is); `on_step(step, stats)` after each."""
    remap = _remap(head)
    plan = plan_steps([r["ids"].numel() - r["first"] for r in records], cfg)
    params = [p for p in head.parameters() if p.requires_grad]
    segments = segments or [[0, cfg.steps]]
    for step in range(start, cfg.steps):
        lr = segment_lr(step, cfg, segments)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        chosen = [records[i] for i in plan[step]]
        total = sum(r["ids"].numel() for r in chosen)
        sums: dict[str, float] = {}
        for batch in micro_batches(chosen, "ids", MICRO_BATCH_TOKENS):
            loss, parts = head_loss(head, batch, cfg, remap, teacher)
            weight = sum(r["ids"].numel() for r in batch) / total
            (loss * weight).backward()
            for key, v in parts.items():
                sums[key] = sums.get(key, 0.0) + (v if key in ("agree", "positions") else v * weight)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if on_step is not None:
            on_step(step, {**sums, "lr": lr})


def _remap(head: EagleHead) -> torch.Tensor:
    vocab = head._embed[0].weight.shape[0]
    remap = torch.full((vocab,), -1, dtype=torch.long)
    remap[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    return remap


@torch.no_grad()
def evaluate(head: EagleHead, records: list[dict], cfg: EagleConfig, teacher: torch.Tensor) -> dict:
    """Held-out loss and top-1 agreement with the target (the greedy acceptance of a first
    draft: teacher-forced, every input feature the target's)."""
    cfg = replace(cfg, own_feature_prob=0.0)
    remap, sums = _remap(head), {"loss": 0.0, "agree": 0.0, "positions": 0.0}
    for batch in micro_batches(records, "ids", MICRO_BATCH_TOKENS):
        _, parts = head_loss(head, batch, cfg, remap, teacher)
        sums["loss"] += parts["loss"] * parts["positions"]
        sums["agree"] += parts["agree"]
        sums["positions"] += parts["positions"]
    n = max(1.0, sums["positions"])
    return {"loss": sums["loss"] / n, "greedy_agree": sums["agree"] / n, "positions": int(n)}


def run_train(cfg: EagleConfig, features_dir: Path, train_dir: Path, head: EagleHead, target_name: str,
              teacher: torch.Tensor, progress: bool = True) -> dict:
    """Train (or resume) to cfg.steps; returns done.json's record (skips a finished run).
    A finished run asked for more steps continues from its last weights (`extend_schedule`)."""
    train_dir.mkdir(parents=True, exist_ok=True)
    settings = {"config": cfg.to_dict(), "target": target_name, "features": read_json(features_dir / "settings.json")}
    segments = extend_schedule(train_dir, settings)
    ensure_same_settings(train_dir / "settings.json", settings, "head training")
    if (train_dir / "done.json").exists():
        return read_json(train_dir / "done.json")
    records = load_torch(features_dir / "train.pt")["records"]
    heldout = load_torch(features_dir / "heldout.pt")["records"]
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    start = resume(train_dir, head, optimizer, "head")
    log_path, t0 = train_dir / "losses.jsonl", time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=start, desc="train head", disable=not progress, unit="step")
    if start == 0:
        log_entry(log_path, {"step": 0, "eval": evaluate(head, heldout, cfg, teacher)})

    def on_step(step: int, stats: dict) -> None:
        log_entry(log_path, {"step": step + 1, **stats})
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", agree=f"{stats['agree'] / max(1, stats['positions']):.3f}")
        last = step + 1 == cfg.steps
        if (step + 1) % cfg.eval_every == 0 or last:
            log_entry(log_path, {"step": step + 1, "eval": evaluate(head, heldout, cfg, teacher)})
        if (step + 1) % cfg.checkpoint_every == 0 or last:
            save_torch(train_dir / "checkpoint.pt", {"step": step + 1, "head": head.state_dict(),
                                                     "optimizer": optimizer.state_dict()})
    train_steps(head, records, cfg, optimizer, teacher, start, on_step, segments)
    bar.close()
    evals = [e["eval"] for e in read_losses(log_path) if "eval" in e]
    done = {"steps": cfg.steps, "schedule": segments, "seconds_this_run": round(time.perf_counter() - t0, 1),
            "eval_first": evals[0] if evals else None, "eval_last": evals[-1] if evals else None}
    write_json(train_dir / "done.json", done)
    return done


def extend_schedule(train_dir: Path, settings: dict) -> list[list[int]]:
    """The run's schedule segments ([[0, steps]] for a run planned in one go). When a
    finished run is asked for more steps and nothing else changed, its settings take the new
    step count, a segment [trained, steps] is added (schedule.json) and done.json goes, so
    training resumes from the last checkpoint with a fresh warm-up and cosine: not the weights
    a run planned at the new length from the start would reach, which provenance records."""
    path, schedule = train_dir / "settings.json", train_dir / "schedule.json"
    steps = settings["config"]["steps"]
    old = read_json(path) if path.exists() else None
    trained = old["config"]["steps"] if old else steps
    segments = read_json(schedule)["segments"] if schedule.exists() else [[0, trained]]
    if old is None or steps == trained or {**old, "config": {**old["config"], "steps": steps}} != as_stored(settings):
        return segments                      # new, unchanged, or ensure_same_settings names the difference
    if steps < trained:
        raise ValueError(f"head training in {train_dir} ran to {trained} steps; --steps must be more to extend "
                         f"it (a head cannot be untrained), or use a new --work-dir")
    if not (train_dir / "done.json").exists():
        raise ValueError(f"head training in {train_dir} has not finished its {trained} steps; finish it with "
                         f"--steps {trained} before extending it")
    segments = [seg for seg in segments if seg[1] <= trained] + [[trained, steps]]
    write_json(schedule, {"segments": segments})
    write_json(path, settings)
    (train_dir / "done.json").unlink()
    return segments


# ---------------------------------------------------------------------- the CLI stage
def run_eagle_cli(args, work: Path) -> int:
    """`verispec train-draft eagle`: features, training and export in turn, each resumable."""
    from verispec.config import EngineConfig
    from verispec.engine.engine import load_model
    from verispec.model import kernels
    from verispec.model.eagle import save_head
    from verispec.spec.eagle import heads_root

    cfg = EagleConfig(num_draft_vocab=args.draft_vocab, steps=args.steps, tokens_per_step=args.tokens_per_step,
                      lr=args.lr, feature_weight=args.feature_weight, supervise_prompt=args.supervise_prompt,
                      own_feature_prob=args.own_feature_prob)
    # The target as the engine serves it (dtype, weight format, kernels): the head reads
    # at serving time the features it was trained on.
    engine_cfg = EngineConfig(model=args.target)
    target, _, _ = load_model(args.target, engine_cfg)
    target.kernels = kernels.load(required=False)
    progress = not args.no_progress
    feats = run_features(cfg, work / "filtered", work / "eagle" / "features", target, progress)
    print(f"features: {feats['train']} train / {feats['heldout']} held-out traces; vocabulary {feats['vocab']} "
          f"tokens cover {feats['train_output_coverage']:.3f} of the training outputs")
    vocab = read_json(work / "eagle" / "features" / "vocab.json")["vocab_ids"]
    torch.manual_seed(cfg.seed)
    head = init_head(target, vocab, cfg.init_layer)
    done = run_train(cfg, work / "eagle" / "features", work / "eagle" / "train", head, args.target,
                     teacher_rows(target, vocab), progress)
    if (work / "eagle" / "train" / "checkpoint.pt").exists():
        head.load_state_dict(load_torch(work / "eagle" / "train" / "checkpoint.pt")["head"])
    print(f"train: {done['steps']} steps; held-out greedy agreement {done['eval_first']['greedy_agree']:.3f} -> "
          f"{done['eval_last']['greedy_agree']:.3f}")
    out = Path(args.out).expanduser() if args.out else heads_root() / args.target
    provenance = {"target": args.target, "weight_format": target.weight_format, "train": cfg.to_dict(),
                  "done": done, "features": feats, "filter_report": read_json(work / "filtered" / "report.json"),
                  "traces": read_json(work / "traces" / "settings.json"),
                  "command": f"verispec train-draft eagle --draft-vocab {cfg.num_draft_vocab} --steps {cfg.steps} "
                             f"--tokens-per-step {cfg.tokens_per_step} --lr {cfg.lr} "
                             f"--feature-weight {cfg.feature_weight}"
                             + (" --supervise-prompt" if cfg.supervise_prompt else "")
                             + f" --own-feature-prob {cfg.own_feature_prob}"}
    save_head(head, out, provenance)
    size_mb = (out / "head.safetensors").stat().st_size / 2**20
    print(f"export: {out} ({size_mb:.1f} MiB)")
    return 0
