"""The draft model: a few of the target's layers, its embeddings, and a dense training forward.

The draft is an ordinary Llama-family model (same tokenizer, same width, fewer layers), so
the engine's existing draft-model proposer runs it with `--draft-model`. It starts from the
target's embeddings (tied to the LM head), final norm and a chosen subset of its layers:
from there a short distillation only has to teach the kept layers to stand in for the
dropped ones.

`causal_forward` is the training (and teacher-scoring) forward: the model's own modules
(norms, fused projections, MLP) and rotary frequencies, with dense causal attention over a
padded batch in place of the engine's paged attention. Right padding never changes earlier positions, and
the export test checks that the engine's paged forward gives the same logits.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from verispec.model.config import ModelConfig
from verispec.model.llama import Attention, LlamaModel


def draft_config(target_cfg: ModelConfig, layers: tuple[int, ...], name: str = "") -> ModelConfig:
    """The target's config with only `layers` kept; raises naming the valid range."""
    bad = [i for i in layers if not 0 <= i < target_cfg.num_layers]
    if bad or not layers:
        raise ValueError(f"layers must be target layer indices in [0, {target_cfg.num_layers - 1}], "
                         f"got {list(layers)}")
    return replace(target_cfg, num_layers=len(layers), name=name or f"{target_cfg.name}-draft")


def draft_state_from_target(target_state: dict[str, torch.Tensor], layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """HF-named draft weights: every non-layer tensor, and target layer layers[j] as layer j."""
    out = {}
    for name, t in target_state.items():
        if ".layers." not in name:
            out[name] = t
    for j, i in enumerate(layers):
        prefix = f"model.layers.{i}."
        found = False
        for name, t in target_state.items():
            if name.startswith(prefix):
                out[f"model.layers.{j}." + name[len(prefix):]] = t
                found = True
        if not found:
            raise ValueError(f"target state has no tensors for layer {i} (names 'model.layers.{i}.*')")
    return out


def build_draft(target_cfg: ModelConfig, target_state: dict[str, torch.Tensor], layers: tuple[int, ...],
                train_embeddings: bool = False) -> LlamaModel:
    """A float32 draft initialised from the target; the embedding / LM head frozen unless asked."""
    cfg = draft_config(target_cfg, layers)
    # Copies: training must never write into the target's tensors (from_state_dict assigns them).
    state = {k: v.detach().clone() for k, v in draft_state_from_target(target_state, layers).items()}
    model = LlamaModel.from_state_dict(cfg, state, dtype=torch.float32)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # one parameter, so one update
    for p in (model.embed_tokens.weight, model.lm_head.weight):
        p.requires_grad_(train_embeddings)
    return model


def rope_tables(model: LlamaModel, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, 1, D) for positions 0..seq-1 from the model's own inverse frequencies.

    Built here from `rotary.inv_freq` (half-rotation layout, as in Hugging Face Llama) rather
    than through the engine's rotary helpers, which are tuned for the paged decode path;
    the export test pins the two paths to the same logits.
    """
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=device),
                        model.rotary.inv_freq.to(device))  # (T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)              # (T, D)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, D) -> x * cos + rotate_half(x) * sin, computed in float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def _dense_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cfg = attn.cfg
    batch, seq, _ = x.shape
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(batch, seq, cfg.num_heads, cfg.head_dim)     # (B, T, H, D)
    k = k.view(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # (B, T, Hkv, D)
    v = v.view(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # (B, T, Hkv, D)
    if cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)  # (B, H, T, D)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, attn.q_size))


def causal_forward(model: LlamaModel, token_ids: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states (B, T, hidden) in float32 for right-padded ids (B, T)."""
    cos, sin = rope_tables(model, token_ids.shape[1], token_ids.device)  # (T, 1, D) each
    x = model.embed_tokens(token_ids)  # (B, T, hidden)
    for block in model.layers:
        x = x + _dense_attention(block.self_attn, block.input_layernorm(x), cos, sin)
        x = x + block.mlp(block.post_attention_layernorm(x))
    return model.norm(x.float())  # (B, T, hidden)


def distill_loss(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                 sampled_ids: torch.Tensor, ce_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Top-k distillation: KL(p_topk || q) with p renormalised over the target's top k, + CE.

    logits: (N, V) draft logits; topk_ids, topk_logprobs: (N, k) the target's; sampled_ids:
    (N,) the tokens the target actually produced. q is the draft's full softmax, so mass it
    puts outside the target's top k is penalised through the normaliser.
    """
    logq = torch.log_softmax(logits.float(), dim=-1)        # (N, V)
    logp = torch.log_softmax(topk_logprobs.float(), dim=-1)  # (N, k) renormalised top-k
    kl = (logp.exp() * (logp - logq.gather(1, topk_ids.long()))).sum(-1).mean()
    ce = -logq.gather(1, sampled_ids.long()[:, None]).mean()
    loss = kl + ce_weight * ce
    return loss, {"loss": loss.item(), "kl": kl.item(), "ce": ce.item()}


@torch.no_grad()
def agreement_stats(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> dict[str, float]:
    """Sums over positions: greedy agreement (draft argmax == target argmax) and overlap.

    `overlap` is sum_i min(p_i, q_i) over the target's top k (p renormalised): a lower bound
    on the per-position acceptance 1 - TV(p, q) of sampling at temperature 1.
    """
    q = torch.softmax(logits.float(), dim=-1)             # (N, V)
    p = torch.softmax(topk_logprobs.float(), dim=-1)      # (N, k)
    greedy = (q.argmax(-1) == topk_ids[:, 0].long()).float().sum()
    overlap = torch.minimum(p, q.gather(1, topk_ids.long())).sum()
    return {"positions": float(logits.shape[0]), "greedy_agree": float(greedy), "overlap": float(overlap)}
