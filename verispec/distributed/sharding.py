"""Which slice of each weight a tensor-parallel rank holds (Megatron's layout).

Every rank builds an ordinary `LlamaModel` from its slice of the Hugging Face state dict
and `RankShard.config()`: the same hidden size, 1/N of the heads, KV heads and MLP width,
and a contiguous 1/N of the vocabulary. Slicing the weights before the model is built
keeps every weight format and kernel path unchanged: int4 groups of 32 along the input
features are the same groups whole or sliced (a GGUF's Q4 blocks are sliced with them);
int8's per-row scales of a row-parallel layer come from the rank's columns only, a finer
quantization than one process's, so int8 TP weights are not one process's bit for bit;
the head's refinement bounds are computed from the rank's rows, which keeps them proven.

    weight (HF name)            slice              layer kind          collective
    q_proj / k_proj / v_proj    rows: heads        column-parallel     none
      (and their biases)
    o_proj                      columns: heads     row-parallel        all-reduce of its output
    gate_proj / up_proj         rows: MLP width    column-parallel     none
    down_proj                   columns: width     row-parallel        all-reduce of its output
    embed_tokens                rows: vocabulary   vocab-parallel      all-reduce (one owner per token)
    lm_head (or the tied        rows: vocabulary   vocab-parallel      gather of the logits to rank 0
      embedding)
    norms, q_norm / k_norm      whole              replicated          none

Heads are split in contiguous runs, so the query heads of a rank are exactly the ones
that read its KV heads (GQA groups stay whole). The vocabulary is split in runs of
ceil(V / N) rows (the last may be shorter), so V need not be divisible by N.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from verispec.model.config import ModelConfig
from verispec.model.quant import INT4_GROUP, Int4Groups

# (HF name suffix, dimension sliced, what it is sliced by)
_SLICED = (
    ("self_attn.q_proj.weight", 0, "heads"), ("self_attn.q_proj.bias", 0, "heads"),
    ("self_attn.k_proj.weight", 0, "kv_heads"), ("self_attn.k_proj.bias", 0, "kv_heads"),
    ("self_attn.v_proj.weight", 0, "kv_heads"), ("self_attn.v_proj.bias", 0, "kv_heads"),
    ("self_attn.o_proj.weight", 1, "heads"),
    ("mlp.gate_proj.weight", 0, "mlp"), ("mlp.up_proj.weight", 0, "mlp"),
    ("mlp.down_proj.weight", 1, "mlp"),
    ("embed_tokens.weight", 0, "vocab"), ("lm_head.weight", 0, "vocab"),
)


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """ValueError naming the field when `world` ranks cannot split `cfg` evenly."""
    fields = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
              "intermediate_size": cfg.intermediate_size}
    bad = [f"{name} ({value})" for name, value in fields.items() if value % world]
    if bad:
        allowed = [n for n in range(1, cfg.num_heads + 1) if all(v % n == 0 for v in fields.values())]
        raise ValueError(f"tensor_parallel_size {world} must divide the model's {' and '.join(bad)}; "
                         f"allowed values for {cfg.name or cfg.family}: {allowed}")


def check_int4_split(cfg: ModelConfig, world: int) -> None:
    """ValueError when a rank's row-parallel inputs (o_proj, down_proj) are not whole int4
    groups of 32: an explicit int4 format cannot quantize them ("auto" picks dense then)."""
    widths = {"num_heads * head_dim": cfg.num_heads * cfg.head_dim, "intermediate_size": cfg.intermediate_size}
    bad = [f"{name} / {world} = {value // world}" for name, value in widths.items() if (value // world) % INT4_GROUP]
    if bad:
        raise ValueError(f"an int4 weight format under tensor_parallel_size {world} needs each rank's "
                         f"{' and '.join(bad)} in whole groups of {INT4_GROUP}; use weight_format dense or int8")


@dataclass(frozen=True)
class RankShard:
    """Rank `rank` of `world`: its slices of a model whose whole config is `full`."""

    full: ModelConfig
    rank: int
    world: int

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank}")
        check_divisible(self.full, self.world)

    @property
    def vocab_width(self) -> int:
        """Rows of every rank's vocabulary run but possibly the last (the gather's width)."""
        return -(-self.full.vocab_size // self.world)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, stop) of the token ids this rank's embedding and head rows hold."""
        start = min(self.rank * self.vocab_width, self.full.vocab_size)
        return start, min(start + self.vocab_width, self.full.vocab_size)

    def config(self) -> ModelConfig:
        """The rank's model: 1/N of the heads, KV heads and MLP width, its vocabulary run."""
        start, stop = self.vocab_range
        cfg, n = self.full, self.world
        return replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                       intermediate_size=cfg.intermediate_size // n, vocab_size=stop - start)

    def _run(self, by: str) -> tuple[int, int]:
        """[start, stop) along a sliced dimension, in rows or columns of the weight."""
        cfg = self.full
        if by == "vocab":
            return self.vocab_range
        width = {"heads": cfg.num_heads * cfg.head_dim, "kv_heads": cfg.num_kv_heads * cfg.head_dim,
                 "mlp": cfg.intermediate_size}[by] // self.world
        return self.rank * width, (self.rank + 1) * width

    def index(self, name: str, ndim: int) -> tuple[slice, ...] | None:
        """The rank's slice of the HF-named weight `name` (as an index), None: whole."""
        for suffix, dim, by in _SLICED:
            if name.endswith(suffix):
                start, stop = self._run(by)
                return (slice(None),) * dim + (slice(start, stop),) + (slice(None),) * (ndim - dim - 1)
        return None

    def int4_groups(self, groups: dict[str, Int4Groups]) -> dict[str, Int4Groups]:
        """A GGUF's Q4 groups (HF names) sliced like the weights they quantize: rows as
        they are; columns in whole groups of 32 (a slice that cuts a group is an error)."""
        out = {}
        for name, g in groups.items():
            index = self.index(name, 2)
            if index is None:
                out[name] = g
            elif index[0] != slice(None):
                out[name] = Int4Groups(g.q[index[0]], g.scale[index[0]], g.min[index[0]])
            else:
                cols = index[1]
                if cols.start % INT4_GROUP or cols.stop % INT4_GROUP:
                    raise ValueError(f"{name}: this rank's columns [{cols.start}, {cols.stop}) cut the "
                                     f"GGUF's int4 groups of {INT4_GROUP}; use weight_format dense or int8")
                groups_ = slice(cols.start // INT4_GROUP, cols.stop // INT4_GROUP)
                out[name] = Int4Groups(g.q[:, cols].contiguous(), g.scale[:, groups_].contiguous(),
                                       g.min[:, groups_].contiguous())
        return out

    def q8_0_head(self, scale: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A GGUF Q8_0 head's (block scales, codes), this rank's vocabulary rows."""
        start, stop = self.vocab_range
        return scale[start:stop].contiguous(), codes[start:stop].contiguous()
