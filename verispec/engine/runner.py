"""ModelRunner: turns per-row work (token ids at positions, block tables) into one forward.

Target and draft models each have a runner and their own KV store; both index the KV by
the same slots (the same block tables), which keeps the draft's cache in lockstep with the
target's without a second block manager.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.model.attention import AttentionMetadata, kernel_query_limit
from verispec.model.llama import LlamaModel


@dataclass
class RowInput:
    """One row of a forward: `token_ids` at positions start.. start+len-1."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    logits_from: int          # return logits for query positions [logits_from, len(token_ids))

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_slots: int, block_size: int, vocab_limit: int | None = None):
        self.model = model
        self.kv = model.new_kv_store(num_slots)
        self.block_size = block_size
        # Rows of the output matrix past the real vocabulary are never produced (padded
        # embeddings): slice them off so target and draft distributions share one support.
        self.vocab_limit = vocab_limit
        self.device = model.embed_tokens.weight.device

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def forward(self, rows: list[RowInput], hidden: bool = False):
        """Run all rows in one pass; returns per-row logits (n_i, V) float32. `hidden`:
        (per-row logits, per-row final-normed hidden states (len(token_ids), hidden)
        float32 of every position of the row, logits_from or not)."""
        ids, q_lens, logits_index, offset = [], [], [], 0
        for r in rows:
            n = len(r.token_ids)
            ids.extend(r.token_ids)
            q_lens.append(n)
            logits_index.extend(range(offset + r.logits_from, offset + n))
            offset += n
        limit = kernel_query_limit(self.model.kernels, self.model.embed_tokens.weight.dtype, self.model.cfg.head_dim)
        if self.model.kernels is not None and max(q_lens) <= limit:  # every row in the attention kernel
            meta = AttentionMetadata.kernel_only([r.start for r in rows], q_lens, [r.block_table for r in rows],
                                                 self.block_size, self.device)
        else:
            positions = [list(range(r.start, r.end)) for r in rows]
            ctx_slots = [self.slots(r.block_table, 0, r.end) for r in rows]
            meta = AttentionMetadata.build(q_lens, [r.end for r in rows], positions,
                                           [c[r.start:] for c, r in zip(ctx_slots, rows)], ctx_slots, self.device,
                                           limit)
        every = len(logits_index) == offset  # every position's logits (decoding): no gather
        # return_hidden only when asked: a model stand-in without the option still runs plain passes
        out = self.model(_on(self.device, ids), meta, self.kv, None if every else _on(self.device, logits_index),
                         **({"return_hidden": True} if hidden else {}))
        logits, states = out if hidden else (out, None)
        if self.vocab_limit is not None:
            logits = logits[:, : self.vocab_limit]
        per_row = list(logits.split([len(r.token_ids) - r.logits_from for r in rows]))
        return (per_row, list(states.split(q_lens))) if hidden else per_row


def _on(device: torch.device, values: list[int]) -> torch.Tensor:
    """An int64 tensor of `values` on `device`; the host-to-device copy does not wait for
    the device (no sync: the stream orders it before the forward that reads it)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
