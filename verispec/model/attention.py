"""Attention over the paged KV pool.

The KV of every model lives in one preallocated tensor per layer, indexed by *slot*
(slot = block_id * block_size + offset; the block tables are managed by `cache/`). A
forward pass receives the new tokens of all rows flattened into one dimension T (no
padding in the linear layers), writes their K/V at `slot_mapping`, then each row attends
to its own context gathered through `context_slots`.

Rolling a row back by n tokens is O(1): its context length simply shrinks, and the stale
slots are never read again (the mask below only admits key positions <= the query's
position, and keys are gathered in position order) until a later write overwrites them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# `enable_gqa` arrived in torch 2.5; on 2.4 the KV heads are expanded explicitly.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class KVStore:
    """One preallocated K and V tensor for all layers of one model."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # Not zeroed (a memset of the whole pool costs seconds at start-up): every slot a
        # row reads was written first, except slot 0, which padded context entries point
        # at. Those are masked, but 0 * NaN is NaN, so slot 0 must hold finite values.
        self.k = torch.empty(shape, dtype=dtype, device=device)  # (L, S, Hkv, D)
        self.v = torch.empty(shape, dtype=dtype, device=device)  # (L, S, Hkv, D)
        self.k[:, 0].zero_()
        self.v[:, 0].zero_()
        # Per-layer views, indexed in Python: no tensor op per layer to select one.
        self.k_layers, self.v_layers = list(self.k.unbind(0)), list(self.v.unbind(0))

    def context_views(self, meta: "AttentionMetadata") -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a one-row pass over consecutive slots: every layer's context keys and values
        as views (L, 1, Hkv, C, D), built once per pass; None when attention must gather."""
        if meta.context_start is None:
            return None
        window = slice(meta.context_start, meta.context_start + meta.context_slots.shape[1])
        return self.k[:, window].unsqueeze(1).transpose(2, 3), self.v[:, window].unsqueeze(1).transpose(2, 3)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class AttentionMetadata:
    """Per-forward tensors shared by every layer (built once per step, never global).

    positions:     (T,)  position of each new token in its row
    slot_mapping:  (T,)  KV slot each new token writes
    context_slots: (B, C) slots of each row's context, in position order, padded with 0
    context_start: first slot of the context when there is one row and its slots are
                   consecutive (a fresh pool hands out consecutive blocks): attention then
                   reads a view of the pool instead of gathering a copy per layer; else None
    query_index:   (B, Q) index into the flat T dimension of each row's queries (padded
                   entries point at a real token and are discarded), or None when every
                   row has exactly Q queries laid out row-major (the common decode case)
    gather_index:  (T,)  flat position in the padded (B*Q) layout of each real token
    attn_mask:     (B, 1, Q, C) bool, True where query may attend to key; None when one
                   row decodes one token (it sees its whole context)
    max_position:  max(positions), known on the host (sizing the rotary table needs no sync)
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_slots: torch.Tensor
    query_index: torch.Tensor | None
    gather_index: torch.Tensor | None
    attn_mask: torch.Tensor | None
    num_rows: int
    max_query_len: int
    max_position: int = None
    context_start: int | None = None

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], positions: list[list[int]],
              slots: list[list[int]], context_slots: list[list[int]],
              device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Build from per-row Python lists (the engine's bookkeeping).

        Row b has query_lens[b] new tokens at `positions[b]` written to `slots[b]`, and
        attends over context_lens[b] keys (its whole context including the new tokens),
        whose slots in position order are `context_slots[b]`.
        """
        num_rows = len(query_lens)
        q_max, c_max = max(query_lens), max(context_lens)
        flat_pos = [p for row in positions for p in row]
        flat_slots = [s for row in slots for s in row]
        ctx = torch.zeros(num_rows, c_max, dtype=torch.long)
        for b, row in enumerate(context_slots):
            ctx[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        context_start = None
        if num_rows == 1 and int(ctx[0, -1]) - int(ctx[0, 0]) == c_max - 1 and \
                (c_max == 1 or bool((ctx[0, 1:] - ctx[0, :-1] == 1).all())):
            context_start = int(ctx[0, 0])
        pos_t = torch.tensor(flat_pos, dtype=torch.long)
        if all(q == q_max for q in query_lens):
            query_index = gather_index = None
            q_pos = pos_t.view(num_rows, q_max)  # (B, Q)
        else:
            starts = [0]
            for q in query_lens[:-1]:
                starts.append(starts[-1] + q)
            qi = torch.tensor([[s + min(j, q - 1) for j in range(q_max)]
                               for s, q in zip(starts, query_lens)], dtype=torch.long)
            query_index = qi  # (B, Q)
            gather_index = torch.tensor([b * q_max + j for b, q in enumerate(query_lens)
                                         for j in range(q)], dtype=torch.long)  # (T,)
            q_pos = pos_t[qi]  # (B, Q) padded queries repeat the row's last position
        mask = None
        if not (num_rows == 1 and q_max == 1 and flat_pos[0] == c_max - 1):
            key_pos = torch.arange(c_max)  # (C,)
            ctx_len = torch.tensor(context_lens, dtype=torch.long)
            mask = ((key_pos[None, None, :] <= q_pos[:, :, None]) &
                    (key_pos[None, None, :] < ctx_len[:, None, None])).unsqueeze(1).to(device)  # (B, 1, Q, C)
        return cls(
            positions=pos_t.to(device), slot_mapping=torch.tensor(flat_slots, dtype=torch.long).to(device),
            context_slots=ctx.to(device),
            query_index=None if query_index is None else query_index.to(device),
            gather_index=None if gather_index is None else gather_index.to(device),
            attn_mask=mask, num_rows=num_rows, max_query_len=q_max,
            max_position=max(flat_pos), context_start=context_start)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    kv: KVStore, meta: AttentionMetadata,
                    context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Write the new K/V into the pool, then attend each row over its own context.

    q: (T, H, D); k, v: (T, Hkv, D) for the new tokens; `context`: `kv.context_views(meta)`
    (None: gather through meta.context_slots). Returns (T, H * D).
    """
    k_pool, v_pool = kv.k_layers[layer], kv.v_layers[layer]  # (S, Hkv, D) each
    k_pool.index_copy_(0, meta.slot_mapping, k)
    v_pool.index_copy_(0, meta.slot_mapping, v)
    num_rows, q_len, heads = meta.num_rows, meta.max_query_len, q.shape[1]
    if context is not None:  # one row, consecutive slots: views of the pool, no copy
        keys, values = context[0][layer], context[1][layer]                 # (1, Hkv, C, D) each
    else:
        keys = k_pool[meta.context_slots].transpose(1, 2)    # (B, Hkv, C, D)
        values = v_pool[meta.context_slots].transpose(1, 2)  # (B, Hkv, C, D)
    if meta.query_index is None:
        qp = q.view(num_rows, q_len, heads, -1).transpose(1, 2)  # (B, H, Q, D)
    else:
        qp = q[meta.query_index].transpose(1, 2)                 # (B, H, Q, D)
    if _SDPA_HAS_GQA:
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=meta.attn_mask,
                                             enable_gqa=True)  # (B, H, Q, D)
    else:
        groups = qp.shape[1] // keys.shape[1]
        out = F.scaled_dot_product_attention(
            qp, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1),
            attn_mask=meta.attn_mask)  # (B, H, Q, D)
    out = out.transpose(1, 2).reshape(num_rows * q_len, -1)  # (B*Q, H*D)
    return out if meta.gather_index is None else out[meta.gather_index]
