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
    # Whether an EAGLE-style head (verispec.spec.eagle) can draft over this runner: its
    # `forward(rows, hidden=True)` returns the target's final hidden states, and the head
    # can look tokens up in `model.embed_tokens` on its own.
    returns_hidden: bool = True

    def __init__(self, model: LlamaModel, num_slots: int, block_size: int, vocab_limit: int | None = None):
        self.model = model
        self.kv = model.new_kv_store(num_slots)
        self.block_size = block_size
        # Rows of the output matrix past the real vocabulary are never produced (padded
        # embeddings): slice them off so target and draft distributions share one support.
        self.vocab_limit = vocab_limit
        self.device = model.embed_tokens.weight.device

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        return block_slots(block_table, start, end, self.block_size)

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
        meta = row_metadata([r.start for r in rows], q_lens, [r.block_table for r in rows], self.block_size,
                            self.device, limit)
        every = len(logits_index) == offset  # every position's logits (decoding): no gather
        # return_hidden only when asked: a model stand-in without the option still runs plain passes
        out = self.model(_on(self.device, ids), meta, self.kv, None if every else _on(self.device, logits_index),
                         **({"return_hidden": True} if hidden else {}))
        logits, states = out if hidden else (out, None)
        if self.vocab_limit is not None:
            logits = logits[:, : self.vocab_limit]
        per_row = list(logits.split([len(r.token_ids) - r.logits_from for r in rows]))
        return (per_row, list(states.split(q_lens))) if hidden else per_row


def block_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV slots of positions start..end-1 of a row with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def row_metadata(starts: list[int], query_lens: list[int], block_tables: list[list[int]], block_size: int,
                 device: torch.device, kernel_limit: int) -> AttentionMetadata:
    """A pass's attention metadata: row b has query_lens[b] tokens at positions starts[b]..
    over block_tables[b]. Every row goes to the fused kernel when none is longer than
    `kernel_limit` (`kernel_query_limit`; 0: the kernels are off), else `build` sends the
    rows over it to SDPA groups (the others still to the kernel)."""
    if kernel_limit and max(query_lens) <= kernel_limit:
        return AttentionMetadata.kernel_only(starts, query_lens, block_tables, block_size, device)
    ends = [s + q for s, q in zip(starts, query_lens)]
    ctx_slots = [block_slots(t, 0, e, block_size) for t, e in zip(block_tables, ends)]
    return AttentionMetadata.build(query_lens, ends, [list(range(s, e)) for s, e in zip(starts, ends)],
                                   [c[s:] for c, s in zip(ctx_slots, starts)], ctx_slots, device, kernel_limit)


def _on(device: torch.device, values: list[int]) -> torch.Tensor:
    """An int64 tensor of `values` on `device`; the host-to-device copy does not wait for
    the device (no sync: the stream orders it before the forward that reads it)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
