"""Stage 1: the target answers training prompts; keep its tokens and top-k log-probabilities.

Generation runs through verispec's own engine (continuous batching, plain decoding); a
second, teacher-forced pass of the same target over prompt + output then gives the
log-softmax of its logits at every generated position (temperature 1, i.e. the model's own
distribution, whatever the sampling settings were), of which the top k are kept.

Layout of `<work>/traces/`:
    settings.json        TracesConfig (but num_prompts) + prompt source + target; a rerun
                         must match it. num_prompts may change: shard i always holds prompts
                         [i * shard_size, (i + 1) * shard_size) of one fixed order
    shard-00000.pt ...   one file per `shard_size` prompts, written atomically; a rerun
                         skips every shard that exists (the unit of resumption)
    done.json            written last: shard count, examples, tokens
"""
from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.engine.engine import LLMEngine, SpecOverride
from verispec.sampling import SamplingParams
from verispec.train.config import TracesConfig
from verispec.train.draft import causal_forward
from verispec.train.prompts import TrainPrompt
from verispec.train.store import ensure_same_settings, load_torch, save_torch, write_json

log = logging.getLogger("verispec")

_NO_SPEC = SpecOverride(method="none")


@dataclass(frozen=True)
class TracesSummary:
    num_shards: int
    shards_run: int           # 0 when everything was already done
    num_examples: int
    num_output_tokens: int
    seconds: float


def select_prompts(prompts: list[TrainPrompt], tokenizer, cfg: TracesConfig) -> list[tuple[TrainPrompt, list[int]]]:
    """The first `num_prompts` prompts (in the given order) whose chat encoding fits."""
    chosen = []
    for p in prompts:
        ids = tokenizer.encode_chat(list(p.messages))
        if len(ids) <= cfg.max_prompt_tokens:
            chosen.append((p, ids))
            if len(chosen) == cfg.num_prompts:
                break
    if len(chosen) < cfg.num_prompts:
        raise ValueError(f"num_prompts={cfg.num_prompts} but only {len(chosen)} prompts fit in "
                         f"max_prompt_tokens={cfg.max_prompt_tokens}")
    return chosen


def shard_path(traces_dir: Path, index: int) -> Path:
    return traces_dir / f"shard-{index:05d}.pt"


def run_traces(cfg: TracesConfig, traces_dir: Path, prompts: list[TrainPrompt], engine: LLMEngine,
               source: dict, progress: bool = True) -> TracesSummary:
    """Generate every missing shard; idempotent (a finished run does no work when rerun)."""
    t0 = time.perf_counter()
    traces_dir.mkdir(parents=True, exist_ok=True)
    fixed = {k: v for k, v in cfg.to_dict().items() if k != "num_prompts"}  # may grow or shrink
    settings = {"config": fixed, "source": source, "target_model": engine.model_name,
                "logprobs": "log_softmax of the target's logits at temperature 1 (top k kept)"}
    ensure_same_settings(traces_dir / "settings.json", settings, "traces")
    chosen = select_prompts(prompts, engine.tokenizer, cfg)
    shards = [chosen[i: i + cfg.shard_size] for i in range(0, len(chosen), cfg.shard_size)]
    todo = [i for i in range(len(shards)) if not shard_path(traces_dir, i).exists()]
    bar = tqdm(total=len(shards), initial=len(shards) - len(todo), desc="traces (shards)",
               disable=not progress, unit="shard")
    for i in todo:
        records = generate_shard(engine, shards[i], cfg)
        save_torch(shard_path(traces_dir, i), {"records": records})
        bar.update(1)
    bar.close()
    num_examples = num_tokens = 0
    for i in range(len(shards)):
        records = load_torch(shard_path(traces_dir, i))["records"]
        num_examples += len(records)
        num_tokens += sum(int(r["output_ids"].numel()) for r in records)
    write_json(traces_dir / "done.json", {"num_shards": len(shards), "num_examples": num_examples,
                                          "num_output_tokens": num_tokens})
    return TracesSummary(len(shards), len(todo), num_examples, num_tokens, time.perf_counter() - t0)


def generate_shard(engine: LLMEngine, items: list[tuple[TrainPrompt, list[int]]], cfg: TracesConfig) -> list[dict]:
    """Run one shard through the engine (plain decoding), then score the outputs' top k."""
    ids = {}
    for n, (p, prompt_ids) in enumerate(items):
        rid = f"trace-{p.source}-{p.prompt_id}-{n}"
        seed = None if cfg.temperature == 0 else zlib.crc32(f"{cfg.seed}:{p.prompt_id}".encode())
        params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=seed)
        engine.add_request(rid, prompt_ids, params, _NO_SPEC)
        ids[rid] = (p, prompt_ids)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    records = []
    for rid, (p, prompt_ids) in ids.items():
        out = finished[rid]
        if out.error:
            raise RuntimeError(f"the engine failed on prompt {p.prompt_id}: {out.error}")
        records.append({"source": p.source, "prompt_id": p.prompt_id, "prompt_text": p.text,
                        "prompt_ids": torch.tensor(prompt_ids, dtype=torch.int32),
                        "output_ids": torch.tensor(out.token_ids, dtype=torch.int32),
                        "output_text": out.text, "finish_reason": out.finish_reason or ""})
    score_topk(engine.target.model, records, cfg.top_k_logprobs, vocab_limit=engine.target.vocab_limit)
    return records


@torch.inference_mode()
def score_topk(model, records: list[dict], k: int, vocab_limit: int | None = None,
               max_batch_tokens: int = 4096) -> None:
    """Add topk_ids / topk_logprobs (T, k) for each record's generated positions, in place."""
    order = sorted(range(len(records)), key=lambda i: -_seq_len(records[i]))
    batch: list[int] = []
    for i in order + [None]:
        if i is not None and (not batch or (len(batch) + 1) * _seq_len(records[batch[0]]) <= max_batch_tokens):
            batch.append(i)
            continue
        if batch:
            _score_batch(model, [records[j] for j in batch], k, vocab_limit)
        batch = [] if i is None else [i]


def _seq_len(r: dict) -> int:
    return int(r["prompt_ids"].numel() + r["output_ids"].numel())


def _score_batch(model, rows: list[dict], k: int, vocab_limit: int | None) -> None:
    longest = max(_seq_len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)  # (B, T) right-padded
    for b, r in enumerate(rows):
        full = torch.cat([r["prompt_ids"], r["output_ids"]]).long()
        ids[b, : full.numel()] = full
    hidden = causal_forward(model, ids)  # (B, T, hidden)
    for b, r in enumerate(rows):
        p, n = r["prompt_ids"].numel(), r["output_ids"].numel()
        logits = model.lm_head(hidden[b, p - 1: p - 1 + n])  # (n, V): position t predicts output t
        if vocab_limit is not None:
            logits = logits[:, :vocab_limit]
        top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        r["topk_ids"] = top.indices.to(torch.int32)           # (n, k)
        r["topk_logprobs"] = top.values.to(torch.float32)     # (n, k)
