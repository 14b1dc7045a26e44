"""The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm).

Tokens, positions, attention metadata and a KV store in; logits out. Nothing here knows
about requests, scheduling or speculation. Q/K/V and gate/up projections are fused into
one matrix each (one GEMM instead of three / two per layer on the decode path).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from verispec.model.attention import AttentionMetadata, KVStore, paged_attention
from verispec.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotary embeddings (half-rotation layout), with Llama 3 frequency scaling."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        # Explicitly on the CPU: under the meta-device context used to build the model,
        # arange would go through torch._refs and import torch._dynamo (seconds of start-up).
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
            emb = torch.cat([freqs, freqs], dim=-1)  # (n, D)
            self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q: (T, H, D), k: (T, Hkv, D), positions: (T,)."""
        cos_t, sin_t = self._table(int(positions.max()) + 1, q.device)
        cos = cos_t[positions].unsqueeze(1)  # (T, 1, D)
        sin = sin_t[positions].unsqueeze(1)  # (T, 1, D)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


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

    def forward(self, x: torch.Tensor, rotary: Rotary, meta: AttentionMetadata, kv: KVStore):
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)     # (T, H, D)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)  # (T, Hkv, D)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)  # (T, Hkv, D)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, meta.positions)
        out = paged_attention(q, k, v, self.layer, kv, meta)  # (T, H, D)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rotary, meta, kv):
        x = x + self.self_attn(self.input_layernorm(x), rotary, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        # tied embeddings, a float32 copy of the embedding matrix).
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv: KVStore,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(token_ids)  # (T, hidden)
        for block in self.layers:
            x = block(x, self.rotary, meta, kv)
        if logits_index is not None:
            x = x[logits_index]           # (N, hidden): only the positions we sample from
        return self.lm_head(self.norm(x.float()))  # (N, V) float32

    def new_kv_store(self, num_slots: int) -> KVStore:
        cfg, w = self.cfg, self.layers[0].self_attn.qkv_proj.weight
        return KVStore(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, w.dtype, w.device)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, hf_state: dict[str, torch.Tensor],
                        dtype: torch.dtype = torch.bfloat16, device="cpu") -> "LlamaModel":
        """Build on the meta device, then fill with fused weights (no double allocation)."""
        with torch.device("meta"), _skip_init():
            model = cls(cfg)
        # Convert before fusing: the concatenation then moves bf16, not float32, bytes.
        head_names = ("lm_head.weight", "model.norm.weight", "norm.weight")
        if cfg.tie_word_embeddings and "lm_head.weight" not in hf_state:
            hf_state = {**hf_state, "lm_head.weight": hf_state["model.embed_tokens.weight"]}
        hf_state = {k: v.to(device=device, dtype=torch.float32 if k in head_names else dtype)
                    for k, v in hf_state.items()}
        state = fuse_hf_state_dict(cfg, hf_state)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or missing:
            raise ValueError(f"weights do not match the {cfg.family} architecture: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        model.rotary = Rotary(cfg).to(device)  # buffers computed on the real device, not meta
        return model.eval()


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
