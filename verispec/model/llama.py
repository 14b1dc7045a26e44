"""The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm).

Tokens, positions, attention metadata and a KV store in; logits out. Nothing here knows
about requests, scheduling or speculation. Q/K/V and gate/up projections are fused into
one matrix each (one GEMM instead of three / two per layer on the decode path).

The forward here is plain PyTorch, the reference the fused kernels are tested against.
With `LlamaModel.kernels` set, a pass runs the same modules on the kernels instead
(verispec.model.fused).
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from verispec.model import fused
from verispec.model.attention import AttentionMetadata, KVStore, paged_attention
from verispec.model.config import ModelConfig
from verispec.model.quant import (INT4_FORMATS, INT4_GROUP, ApproxHead, Bf16Linear, Int4Linear, Q8Linear, RefinedHead,
                                  fuse_int4_groups, gguf_int4_groups, gguf_q8_0_head, make_bf16_linear, quantize_model,
                                  quantized_metadata, resolve_weight_format, restore_quantized)

log = logging.getLogger("verispec")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One call: the kernel accumulates in float32 and rounds once (the reference rounds
        # the normalised x, then the product by the weight: one more bf16 rounding).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary embeddings (half-rotation layout), with Llama 3 frequency scaling.

    `cos_sin(positions)` is computed once per pass and shared by every layer. The sine is
    stored with the sign of the rotation folded in, so rotating x is
    x * cos + swap_halves(x) * sin (see `apply_rotary`).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        # On the CPU even inside the meta-device build (`from_state_dict`): a meta arange
        # imports torch's reference implementations, 1.3 s of every cold start.
        steps = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu")
        inv_freq = 1.0 / (cfg.rope_theta ** (steps / cfg.head_dim))
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_scale(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._cos = self._sin = None

    def _table(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < n or self._cos.device != device:
            n = max(n, 2 * (0 if self._cos is None else self._cos.shape[0]), 1024)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=device), self.inv_freq.to(device))
            self._cos = torch.cat([freqs, freqs], dim=-1).cos()             # (n, D)
            self._sin = torch.cat([-freqs, freqs], dim=-1).sin()            # (n, D) signed
            self._rounded = {}
        return self._cos, self._sin

    def _table_in(self, n: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables rounded to `dtype` (the activations'), kept: a step then indexes them
        without converting its rows (two fewer operations a step)."""
        cos, sin = self._table(n, device)
        if dtype not in self._rounded:
            self._rounded[dtype] = (cos.to(dtype), sin.to(dtype))
        return self._rounded[dtype]

    def cos_sin(self, positions: torch.Tensor, max_position: int | None = None,
                dtype: torch.dtype = torch.float32):
        """positions (T,) -> cos, signed sin, each (T, 1, D) in `dtype` (the activations')."""
        if max_position is None:
            max_position = int(positions.max())
        cos_t, sin_t = self._table_in(max_position + 1, positions.device, dtype)
        return cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) -> [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], in x's dtype (as the
    reference does: cos and sin are rounded to it, addcmul accumulates in float32)."""
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # [x2, x1]
    return torch.addcmul(x * cos, swapped, sin)


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> qk (T, H + Hkv, D), q/k-normed where the model has the norms,
        not yet rotated; v (T, Hkv, D). qk is a new tensor of this pass (rotating it in
        place, as the fused path does, touches no weight)."""
        cfg, heads, kv_heads, d = self.cfg, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        qkv = self.qkv_proj.forward(x)                                      # (T, (H + 2 Hkv) D)
        per_head = qkv.view(qkv.shape[0], heads + 2 * kv_heads, d)          # (T, H + 2 Hkv, D)
        if cfg.qk_norm:
            q = self.q_norm.forward(per_head[:, :heads])
            k = self.k_norm.forward(per_head[:, heads: heads + kv_heads])
            qk = torch.cat([q, k], dim=1)                                   # (T, H + Hkv, D)
        else:  # q and k are adjacent in the fused output: rotate them in one go
            qk = per_head[:, : heads + kv_heads]
        return qk, per_head[:, heads + kv_heads:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVStore, context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        heads = self.cfg.num_heads
        qk, v = self.project(x)
        qk = apply_rotary(qk, cos, sin)                                     # (T, H + Hkv, D)
        out = paged_attention(qk[:, :heads], qk[:, heads:], v, self.layer, kv, meta, context)  # (T, H*D)
        return self.o_proj.forward(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class Block(nn.Module):
    """One decoder layer. Sub-modules are called through `.forward` on this hot path:
    nn.Module.__call__'s hook dispatch costs ~2 us a call, ~300 calls per decode step."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, kv, context=None):
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, meta, kv, context)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaModel(nn.Module):
    """forward(token_ids (T,), meta, kv, logits_index (N,)) -> logits (N, V) float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        # The final norm and the LM head run in float32 whatever the body's dtype: bf16
        # logits are spaced 0.125 apart near 25, which manufactures ties between the top
        # two tokens and flips greedy choices. The head has its own float32 weight (for
        # tied embeddings, a float32 copy of the embedding matrix). Quantized and bf16 CPU
        # targets replace it by a RefinedHead: approximate logits from a packed copy, the
        # ones that could be the argmax recomputed with this float32 weight.
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.weight_format = "dense"  # see verispec.model.quant; set by from_state_dict
        self.kernels = None  # verispec.model.kernels' module when the engine enables them
        # With the kernels on, decode and verify passes run the layers in one C++ call
        # (`kernels.DecoderStack`, see verispec.model.fused) when every linear is on a
        # packed kernel; False: never (the per-layer path, which the stack must equal bit
        # for bit).
        self.fused_stack = True

    @property
    def kernels(self):
        return self._kernels

    @kernels.setter
    def kernels(self, ops) -> None:
        """Fused kernels on (the compiled module) or off (None), for every layer at once."""
        self._kernels = ops
        self._stack = None  # fused.decoder_stack's, built from these kernels on first use
        for module in self.modules():
            if isinstance(module, (Int4Linear, Bf16Linear, Q8Linear)):
                module.kernels = ops

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv: KVStore,
                logits_index: torch.Tensor | None = None, return_hidden: bool = False):
        """`return_hidden`: (logits, h) with h (T, hidden) float32 the final-normed hidden
        state of EVERY position (the LM head's input, before the logits_index gather), as
        an EAGLE-style head reads it; off, nothing extra is computed."""
        x = self.embed_tokens(token_ids)  # (T, hidden)
        cos, sin = self.rotary.cos_sin(meta.positions, meta.max_position, x.dtype)  # (T, 1, D), all layers
        if self._kernels is not None:  # these layers on the fused kernels
            return fused.forward(self, x, cos, sin, meta, kv, logits_index, return_hidden)
        context = kv.context_views(meta)  # every layer's K/V context as views, or None (gather)
        for block in self.layers:
            x = block.forward(x, cos, sin, meta, kv, context)
        if return_hidden:
            h = self.norm(x.float())      # (T, hidden)
            return self.lm_head(h if logits_index is None else h[logits_index]), h
        if logits_index is not None:
            x = x[logits_index]           # (N, hidden): only the positions we sample from
        return self.lm_head(self.norm(x.float()))  # (N, V) float32

    def new_kv_store(self, num_slots: int) -> KVStore:
        cfg, w = self.cfg, self.embed_tokens.weight  # the body's dtype, whatever the weight format
        return KVStore(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, w.dtype, w.device)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, hf_state: dict[str, torch.Tensor],
                        dtype: torch.dtype = torch.bfloat16, device="cpu", weight_format: str = "dense",
                        gguf_path: Path | None = None, draft: bool = False, shard=None) -> "LlamaModel":
        """Build on the meta device, then fill with fused weights (no double allocation).

        `weight_format` (see `verispec.model.quant`): "dense" keeps every weight in `dtype`
        (bf16 on the CPU: linear layers packed as `Bf16Linear`s, and a target's head a
        `RefinedHead` over its bf16 rounding); "int8" / "int4" quantize
        the linear layers (int4 from `gguf_path`'s Q4 blocks when it has them) and give the
        head a `RefinedHead`; "auto" picks from `gguf_path`. The
        resolved format is `model.weight_format`. A `draft` model's quantized head is an
        `ApproxHead` (no float32 refinement), and its "auto" is int8 (int4 for a Q4 GGUF).
        `shard` (a tensor-parallel rank's `verispec.distributed.sharding.RankShard`, with
        `cfg` and `hf_state` already that rank's): slices what is read from `gguf_path` alike.
        """
        fmt = resolve_weight_format(weight_format, dtype, gguf_path, draft=draft)
        if weight_format == "auto" and fmt in INT4_FORMATS and any(
                n % INT4_GROUP for n in (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)):
            fmt = "dense"  # the int4 kernel needs in_features in whole groups of 32
        if weight_format == "auto" and torch.device(device).type != "cpu":
            fmt = "dense"  # the packed formats run on verispec's CPU kernels only
        if fmt != "dense" and torch.device(device).type != "cpu":
            raise ValueError(f"weight_format {fmt!r} uses PyTorch's CPU kernels; device must be cpu, got {device}")
        with torch.device("meta"), _skip_init():
            model = cls(cfg)
        # Convert before fusing: the concatenation then moves bf16, not float32, bytes.
        # The head (and, when quantizing, the linear layers' source weights) stay float32.
        head_names = ("lm_head.weight", "model.norm.weight", "norm.weight")
        if cfg.tie_word_embeddings and "lm_head.weight" not in hf_state:
            hf_state = {**hf_state, "lm_head.weight": hf_state["model.embed_tokens.weight"]}

        def wants_f32(name: str) -> bool:
            return name in head_names or (fmt != "dense" and name.endswith("_proj.weight"))

        hf_state = {k: v.to(device=device, dtype=torch.float32 if wants_f32(k) else dtype)
                    for k, v in hf_state.items()}
        state = fuse_hf_state_dict(cfg, hf_state)
        quantized = {}
        if fmt != "dense":
            quantized = {name: state.pop(name) for name in list(state)
                         if name == "lm_head.weight" or (name.endswith(".weight") and
                                                         name.rsplit(".", 2)[-2] in _QUANTIZED_LINEARS)}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [m for m in missing if m not in quantized]
        if unexpected or missing:
            raise ValueError(f"weights do not match the {cfg.family} architecture: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        if fmt != "dense":
            int4_groups = _gguf_int4_groups(cfg, gguf_path, shard) if fmt in INT4_FORMATS and gguf_path else {}
            if draft:
                head = ApproxHead.quantize(quantized["lm_head.weight"], fmt, dtype)
            else:
                q8_0 = gguf_q8_0_head(gguf_path) if gguf_path else None
                if q8_0 is not None and shard is not None:
                    q8_0 = shard.q8_0_head(*q8_0)
                head = RefinedHead.q8_0(*q8_0) if q8_0 is not None else None
            quantize_model(model, quantized, fmt, dtype, int4_groups, head)
        elif dtype == torch.bfloat16 and torch.device(device).type == "cpu":
            _pack_bf16_linears(model)
            if not draft:  # greedy stays the float32 head's; half its bytes a step
                model.lm_head = RefinedHead.bf16(model.lm_head.weight.detach())
        model.rotary = Rotary(cfg).to(device)  # buffers computed on the real device, not meta
        model.weight_format = fmt
        return model.eval()

    def runtime_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, string metadata) that `from_runtime_state` rebuilds this model from."""
        meta = {"weight_format": self.weight_format, "dtype": str(self.embed_tokens.weight.dtype),
                **quantized_metadata(self)}
        return {k: v.contiguous() for k, v in self.state_dict().items()}, meta

    @classmethod
    def from_runtime_state(cls, cfg: ModelConfig, state: dict[str, torch.Tensor],
                           meta: dict[str, str]) -> "LlamaModel":
        """A model from its own `runtime_state()` (fused, converted, quantized): the fast
        path for warm starts, see `verispec.engine.engine.load_model`."""
        with torch.device("meta"), _skip_init():
            model = cls(cfg)
        restore_quantized(model, state, meta)  # quantized or packed bf16 layers
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = Rotary(cfg).to(state["embed_tokens.weight"].device)
        model.weight_format = meta["weight_format"]
        return model.eval()


# Linear layers a quantized weight format replaces (the last name component).
_QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _pack_bf16_linears(model: LlamaModel) -> None:
    """Dense bf16 on the CPU: the body's linear layers in verispec's bf16 kernel layout."""
    for name, module in list(model.named_modules()):
        parent, _, attr = name.rpartition(".")
        if attr in _QUANTIZED_LINEARS:
            setattr(model.get_submodule(parent), attr, make_bf16_linear(module))


def _gguf_int4_groups(cfg: ModelConfig, gguf_path: Path, shard=None) -> dict:
    groups, others = gguf_int4_groups(gguf_path)
    if shard is not None:
        groups = shard.int4_groups(groups)
    if others:
        log.info("int4: %d linear weights of %s are not Q4_0/Q4_1; they are re-quantized "
                 "(round to nearest), e.g. %s", len(others), gguf_path.name, others[0])
    return fuse_int4_groups(cfg.num_layers, groups)


@contextlib.contextmanager
def _skip_init():
    """Skip the modules' random initialisers: every weight is replaced by load_state_dict,
    and on the meta device the initialisers import torch._dynamo (seconds of start-up)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def fuse_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face naming -> ours: drop the `model.` prefix, fuse q/k/v and gate/up."""
    out = {}
    for name, t in sd.items():
        if name.startswith("model."):
            name = name[len("model."):]
        out[name] = t
    if cfg.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [out.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
            if all(x is not None for x in parts):
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat(
            [out.pop(f"{p}mlp.gate_proj.weight"), out.pop(f"{p}mlp.up_proj.weight")], dim=0)
    return out
