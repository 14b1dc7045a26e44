"""The Llama-family forward on verispec's fused CPU kernels (verispec.model.kernels).

`LlamaModel.forward` hands a pass here when `model.kernels` is set; llama.py keeps the
plain PyTorch forward, the reference these paths are tested against. Two paths, the same
kernels in the same order, so the same logits and K/V bit for bit:

- the decoder stack: every layer and the final norm in one C++ call (`kernels.DecoderStack`),
  for passes whose every query the attention kernel takes, on models whose linears are
  all on packed kernels and have no q/k norms, unless `model.fused_stack` is False;
- the per-layer path, for every other pass: per layer, the residual add fused with the
  next norm, rotary with the K/V write, silu * up, attention through `paged_attention`.

The modules are llama.py's; this module only calls their weights and sub-layers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verispec.model.attention import AttentionMetadata, KVStore, paged_attention
from verispec.model.quant import Bf16Linear, Int4Linear

if TYPE_CHECKING:
    from verispec.model.llama import MLP, Attention, Block, LlamaModel


def forward(model: LlamaModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv: KVStore, logits_index: torch.Tensor | None, return_hidden: bool = False):
    """The layers, final norm and head on `model.kernels`: x (T, hidden) the embeddings,
    cos, sin (T, 1, D) -> logits (N, V) float32, or (logits, h (T, hidden) float32) with
    `return_hidden`, as `LlamaModel.forward`."""
    stack = _stack_for(model, meta)
    if stack is None:
        return _per_layer_forward(model, x, cos, sin, meta, kv, logits_index, return_hidden)
    kq = meta.kernel
    h = stack.forward(x, cos, sin, kv.k_layers, kv.v_layers, meta.slot_mapping, kq.context_slots, kq.rows,
                      kq.lens, model.cfg.head_dim ** -0.5, final_norm=model.norm.weight.float())
    logits = model.lm_head(h if logits_index is None else h[logits_index])  # (N, V) float32
    return (logits, h) if return_hidden else logits


def _stack_for(model: LlamaModel, meta: AttentionMetadata):
    """The decoder stack if it runs this pass, else None: it needs every query of the pass
    in the attention kernel (no SDPA group), `model.fused_stack` on and the layers eligible
    (`build_stack`)."""
    kq = meta.kernel
    if not model.fused_stack or kq is None or kq.tokens is not None or meta.groups:
        return None
    return decoder_stack(model) or None


def _per_layer_forward(model: LlamaModel, x, cos, sin, meta, kv, logits_index, return_hidden=False):
    """`forward` one layer at a time from Python: every pass the stack does not take."""
    ops = model.kernels
    context = kv.context_views(meta)  # every layer's K/V context as views, or None (gather)
    delta = None
    for block in model.layers:
        x, delta = kernel_block(block, x, delta, cos, sin, meta, kv, context, ops)
    if logits_index is not None and not return_hidden:  # only the positions we sample from
        x, delta = x[logits_index], delta[logits_index]
    # the last residual add and the final norm in one kernel (float32 out: the head's input)
    h = ops.rms_norm(x, model.norm.weight.float(), model.norm.eps, delta)
    if not return_hidden:
        return model.lm_head(h)  # (N, V) float32
    return model.lm_head(h if logits_index is None else h[logits_index]), h


def kernel_block(block: Block, x, delta, cos, sin, meta, kv, context, ops):
    """`Block.forward` on the kernels: the residual add of the previous layer's MLP
    (`delta`, None for the first layer) and of this attention each fused with the norm
    after it. Returns (x, this MLP's output), the caller adding the last one."""
    norm1, norm2 = block.input_layernorm, block.post_attention_layernorm
    if delta is None:
        h = ops.rms_norm(x, norm1.weight, norm1.eps)
    else:
        x, h = ops.add_rms_norm(x, delta, norm1.weight, norm1.eps)
    a = _attention(block.self_attn, h, cos, sin, meta, kv, context, ops)
    x, h = ops.add_rms_norm(x, a, norm2.weight, norm2.eps)
    return x, _mlp(block.mlp, h, ops)


def _attention(attn: Attention, x, cos, sin, meta, kv, context, ops) -> torch.Tensor:
    """`Attention.forward` on the kernels: q and k rotated in place (qk is this pass's own
    tensor) and K/V written to the pool in one call, then attention over the pool."""
    qk, v = attn.project(x)
    ops.rotary_store_(qk, v, cos, sin, kv.k_layers[attn.layer], kv.v_layers[attn.layer], meta.slot_mapping)
    out = paged_attention(qk[:, :attn.cfg.num_heads], None, None, attn.layer, kv, meta, context, ops)
    return attn.o_proj.forward(out)


def _mlp(mlp: MLP, x, ops) -> torch.Tensor:
    return mlp.down_proj.forward(ops.silu_mul(mlp.gate_up_proj.forward(x)))


def decoder_stack(model: LlamaModel):
    """The model's layers as one `kernels.DecoderStack`, or False where it cannot run them.
    Built on first use (the weights are final by then) and kept in `model._stack`, which
    setting `model.kernels` clears."""
    if model._stack is None:
        model._stack = build_stack(model, model.kernels) or False
    return model._stack


def build_stack(model: LlamaModel, ops):
    """`ops.DecoderStack` over the model's layers, or None if a layer is not eligible (q/k
    norms, a linear not on a packed kernel)."""
    cfg = model.cfg
    if cfg.qk_norm:
        return None
    stack = ops.DecoderStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        linears = [_linear_spec(m, ops) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if None in linears:
            return None
        stack.add_layer(block.input_layernorm.weight, block.post_attention_layernorm.weight, linears)
    return stack


def _linear_spec(layer: torch.nn.Module, ops):
    """A linear as `DecoderStack.add_layer` takes it, (kind, weights, out_features, bias),
    kind 0: int4, 2: int4 on the 8-bit activation grid, 1: bf16; None if the stack has no
    kernel for it (an int4 layer on 16-bit activations needs the int4 vector path, a bf16
    layer the bf16 one; other layers are not packed)."""
    if isinstance(layer, Int4Linear) and (layer.act_bits == 8 or ops.int4_vector):
        return 0 if layer.act_bits == 16 else 2, [layer.q4, layer.scale, layer.min], layer.out_features, layer.bias
    if isinstance(layer, Bf16Linear) and ops.bf16_vector:
        return 1, [layer.w16], layer.out_features, layer.bias
    return None
