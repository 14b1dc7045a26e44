"""An EAGLE-style draft head: one decoder layer over the target's final hidden states.

At position i the head reads f_i, the target's final-normed hidden state there (the LM
head's input; past the verified tokens, the head's own output at i - 1 stands in for it),
and the embedding of the token after it, t_{i+1}:

    x_i = fc([embed(t_{i+1}); f_i])          (2H -> H)
    g_i = norm(Block(x_i))                   one Llama layer, with its own one-layer KV
    logits_i = lm_head(g_i)                  over `vocab_ids`: N of the target's V tokens

g_i is trained to be the target's f_{i+1}, and logits_i its distribution of t_{i+2}. The
embedding is the target's, frozen and shared (bound with `bind`, never copied or saved).
The head runs in float32 (the reference, and training), or with `pack` on verispec's
bf16 kernels like a dense bf16 target: half the bytes a pass streams; its outputs (logits,
features) are float32 either way.

On disk (`save_head` / `load_head`): `head.safetensors` (fc, layer, norm, lm_head,
vocab_ids; bf16 weights) and `head.json` (shape + provenance), written last.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn as nn

from verispec.model.attention import AttentionMetadata, KVStore, kernel_query_limit
from verispec.model.config import ModelConfig
from verispec.model.llama import Block, RMSNorm, Rotary

WEIGHTS, META = "head.safetensors", "head.json"


class EagleHead(nn.Module):
    """forward(token_ids (T,), features (T, H), meta, kv, last (B,) or None) -> (logits (B, N), g (B, H))."""

    def __init__(self, cfg: ModelConfig, vocab_ids: torch.Tensor):
        super().__init__()
        self.cfg = cfg = replace(cfg, num_layers=1)  # the target's shapes, one layer
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = Block(cfg, 0)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, len(vocab_ids), bias=False)
        self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long))  # head index -> target id
        self.rotary = Rotary(cfg)
        self._embed: list[nn.Embedding] = []  # the target's, outside the module tree (not saved)
        self.dtype = torch.float32  # of the body's activations and KV (bf16 once packed)
        self.ops = None             # verispec's kernels once packed: the attention kernel too
        self.stack = None           # the layer + final norm as one kernels.DecoderStack call (`pack`)

    def pack(self, ops, int4: bool = False) -> "EagleHead":
        """Every linear on verispec's kernels (`ops`), the body in bf16: packed bf16 weights,
        or with `int4` round-to-nearest int4 groups (a quarter of the bytes a pass streams;
        for an int4 target, whose own layers are int4 too)."""
        from verispec.model.quant import make_bf16_linear, make_int4_linear, quantize_int4
        for parent, name in ((self, "fc"), (self.layer.self_attn, "qkv_proj"), (self.layer.self_attn, "o_proj"),
                             (self.layer.mlp, "gate_up_proj"), (self.layer.mlp, "down_proj"), (self, "lm_head")):
            linear = getattr(parent, name)
            bias = None if linear.bias is None else linear.bias.detach()  # Qwen2's q/k/v bias
            packed = (make_int4_linear(quantize_int4(linear.weight.data), bias, torch.bfloat16) if int4
                      else make_bf16_linear(linear))
            packed.kernels = ops
            setattr(parent, name, packed)
        for norm in (self.layer.input_layernorm, self.layer.post_attention_layernorm):
            norm.weight.data = norm.weight.data.to(torch.bfloat16)
        self.dtype, self.ops = torch.bfloat16, ops
        from types import SimpleNamespace

        from verispec.model.fused import build_stack
        self.stack = build_stack(SimpleNamespace(cfg=self.cfg, layers=[self.layer]), ops)
        return self

    def bind(self, embedding: nn.Embedding) -> "EagleHead":
        """Use the target's token embedding (shared, frozen)."""
        if embedding.weight.shape[1] != self.cfg.hidden_size or embedding.weight.shape[0] <= int(self.vocab_ids.max()):
            raise ValueError(f"the head (hidden {self.cfg.hidden_size}, token ids up to {int(self.vocab_ids.max())}) "
                             f"does not fit an embedding of shape {tuple(embedding.weight.shape)}")
        self._embed[:] = [embedding]
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # frozen: training never reaches into the target
            return self._embed[0](token_ids).to(self.dtype)

    def inputs(self, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """x = fc([embed(t_{i+1}); f_i]): (..., ) ids and (..., H) features -> (..., H)."""
        return self.fc(torch.cat([self.embed(token_ids), features.to(self.dtype)], dim=-1))

    @property
    def kernel_queries(self) -> int:
        """Rows of at most this many tokens go to the attention kernel, as a target's with the
        same kernels, dtype and head size would (`kernel_query_limit`; 0 until packed)."""
        return kernel_query_limit(self.ops, self.dtype, self.cfg.head_dim)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata, kv: KVStore,
                last: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One paged pass writing the layer's K/V at meta's slots; logits and output
        features only at the flat indices `last` (each row's final entry; None when every
        row has one entry)."""
        x = self.inputs(token_ids, features)                          # (T, H)
        cos, sin = self.rotary.cos_sin(meta.positions, meta.max_position, x.dtype)
        kq = meta.kernel
        if self.stack is not None and kq is not None and kq.tokens is None and not meta.groups:
            # the layer and the norm in one C++ call, as the target's decoder stack
            g = self.stack.forward(x, cos, sin, kv.k_layers, kv.v_layers, meta.slot_mapping, kq.context_slots,
                                   kq.rows, kq.lens, self.cfg.head_dim ** -0.5,
                                   final_norm=self.norm.weight.float())   # (T, H) float32
            g = g if last is None else g[last]                        # (B, H)
        else:
            g = self._layer_and_norm(x, cos, sin, meta, kv, last)    # (B, H) float32
        return self.lm_head(g.to(self.dtype)).float(), g              # (B, N), (B, H)

    def _layer_and_norm(self, x, cos, sin, meta: AttentionMetadata, kv: KVStore, last) -> torch.Tensor:
        """`forward`'s layer and final norm at `last` without the stack: (B, H) float32. Once
        packed, on the kernels' per-layer path as a packed target's layers (the attention
        kernel takes meta's kernel queries, SDPA its groups; the stack's result bit for bit)."""
        if self.ops is None:
            x = self.layer.forward(x, cos, sin, meta, kv)                          # (T, H)
            return self.norm.forward((x if last is None else x[last]).float())
        from verispec.model.fused import kernel_block
        x, mlp_out = kernel_block(self.layer, x, None, cos, sin, meta, kv, kv.context_views(meta), self.ops)
        if last is not None:
            x, mlp_out = x[last], mlp_out[last]                                    # (B, H) each
        return self.ops.rms_norm(x, self.norm.weight.float(), self.norm.eps, mlp_out)  # the residual add fused

    def new_kv_store(self, num_slots: int, device) -> KVStore:
        cfg = self.cfg
        return KVStore(1, num_slots, cfg.num_kv_heads, cfg.head_dim, self.dtype, device)


def save_head(head: EagleHead, out_dir: Path, provenance: dict) -> Path:
    """Write the head at `out_dir` (replacing an older one); the folder appears complete or not at all."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    building = out_dir.with_name(f"{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    try:
        state = {k: (v if k == "vocab_ids" else v.to(torch.bfloat16)).contiguous()
                 for k, v in head.state_dict().items() if not k.startswith("rotary.")}
        save_file(state, str(building / WEIGHTS))
        meta = {"config": asdict(head.cfg), "num_draft_vocab": len(head.vocab_ids), **provenance}
        (building / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(building, out_dir)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return out_dir


def load_head(directory: str | Path, device="cpu") -> EagleHead:
    """The head saved in `directory`, in float32 on `device` (unbound: call `bind`)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / META).is_file():
        raise FileNotFoundError(f"{directory} holds no draft head ({META} missing)")
    meta = json.loads((directory / META).read_text())
    cfg = ModelConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in meta["config"].items()})
    state = load_file(str(directory / WEIGHTS))
    head = EagleHead(cfg, state["vocab_ids"])
    head.load_state_dict({k: v if k == "vocab_ids" else v.float() for k, v in state.items()})
    return head.to(device).eval()
