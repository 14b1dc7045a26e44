"""The collectives of a tensor-parallel forward, added to a rank's `LlamaModel` from outside.

`parallelize` wraps three kinds of module of a model built from a rank's slices
(`sharding.RankShard`); the forward in llama.py and fused.py stays the one-process code:

- `RowParallel` around o_proj and down_proj: each rank's product over its slice of the
  input features is a partial sum of the whole product; one all-reduce adds them.
- `VocabParallelEmbedding`: a rank looks up the token ids in its vocabulary run and
  writes zeros for the others; the all-reduce then adds one owner's row to zeros, which
  is exact in any dtype (the embeddings equal one process's bit for bit).
- `GatheredHead` around the LM head (whatever head the weight format made: float32,
  `RefinedHead`, `ApproxHead`): each rank computes the float32 logits of its vocabulary
  run and rank 0 gathers them into the whole (N, V) row. Why the logits and not each
  row's candidates: the sampler, the rejection test and the logit processors want the
  whole distribution anyway, and a gather of float32 logits is the same tensor one
  process computes, so losslessness cannot depend on the sharding. A `RefinedHead` per
  run stays exact for greedy: the argmax token lies in some run, and that run's own
  bound refines it (quant.RefinedHead's proof holds for any subset of the rows).

The decoder stack of fused.py runs every layer in one C++ call and cannot take a
collective mid-stack: `parallelize` turns it off (the per-layer kernel path runs instead).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from verispec.distributed.sharding import RankShard


class Collectives:
    """The rank's collectives on the default process group, and the seconds spent in them
    (waiting for the slowest rank included: what the step pays for being split). On CUDA
    NCCL returns before the reduction ends, so there the seconds are the launches only."""

    def __init__(self, shard: RankShard):
        self.rank, self.world = shard.rank, shard.world
        self.seconds = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x must be this pass's own tensor)."""
        x = x if x.is_contiguous() else x.contiguous()
        start = time.perf_counter()
        dist.all_reduce(x)
        self._spent(start)
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape on each), in rank order, on rank 0; None elsewhere."""
        x = x if x.is_contiguous() else x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        start = time.perf_counter()
        dist.gather(x, parts, dst=0)
        self._spent(start)
        return parts

    def _spent(self, start: float) -> None:
        self.seconds += time.perf_counter() - start


class RowParallel(nn.Module):
    """A row-parallel linear: the wrapped layer over this rank's input features, then the
    all-reduce that adds the ranks' partial outputs. (No bias: o_proj and down_proj have none.)"""

    def __init__(self, layer: nn.Module, comm: Collectives):
        super().__init__()
        self.layer, self.comm = layer, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.layer.forward(x))  # (T, hidden)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of tokens [start, start + rows) on this rank, zeros for the
    rest, summed over the ranks. `weight` is the rank's run (what KV stores read dtype from)."""

    def __init__(self, embedding: nn.Embedding, start: int, comm: Collectives):
        super().__init__()
        self.weight = embedding.weight  # (rows, hidden)
        self.start, self.comm = start, comm

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.start                                      # (T,)
        outside = (local < 0) | (local >= self.weight.shape[0])             # (T,)
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # (T, hidden)
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0))


class GatheredHead(nn.Module):
    """The LM head of this rank's vocabulary run; rank 0 returns the whole (N, V) float32
    logits, the others their own run (which nobody reads)."""

    def __init__(self, head: nn.Module, shard: RankShard, comm: Collectives):
        super().__init__()
        self.head, self.comm = head, comm
        self.vocab_size = shard.full.vocab_size
        start, stop = shard.vocab_range
        # Equal widths for the gather: a shorter last run pads per forward (N varies; the head allocates its output).
        self.padding = shard.vocab_width - (stop - start)                   # 0 on every other rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.head(x)                                                # (N, rows) float32
        parts = self.comm.gather_to_first(F.pad(local, (0, self.padding)) if self.padding else local)
        return local if parts is None else self.join(parts)

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Rank 0: the ranks' (N, width) logits, in rank order, as the (N, V) row."""
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


def parallelize(model: nn.Module, shard: RankShard, comm: Collectives) -> nn.Module:
    """Wrap a rank's model (built from `shard`'s slices) with its collectives, in place.

    `model.cfg` becomes the rank's heads and KV heads (what its KV store holds) with the
    whole vocabulary (what the gathered logits span)."""
    for block in model.layers:
        block.self_attn.o_proj = RowParallel(block.self_attn.o_proj, comm)
        block.mlp.down_proj = RowParallel(block.mlp.down_proj, comm)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, shard.vocab_range[0], comm)
    model.lm_head = GatheredHead(model.lm_head, shard, comm)
    model.fused_stack = False  # the C++ stack has no place for the all-reduces
    model.cfg = replace(model.cfg, vocab_size=shard.full.vocab_size)
    return model
