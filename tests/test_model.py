"""Our Llama-family forward matches Hugging Face transformers on the same weights."""
import random

import pytest
import torch

from verispec.model.attention import AttentionMetadata
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def tiny_hf_model(family: str, tie: bool = False, seed: int = 0):
    import transformers
    cfg_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, rope_theta=10000.0, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so a skipped one would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def run_rows(model: LlamaModel, rows: list[list[int]], chunk: list[int] | None = None, seed: int = 0):
    """Feed each row through our model (in chunks, rows batched together, slots shuffled);
    return per-row logits for every position."""
    rng = random.Random(seed)
    total = sum(len(r) for r in rows)
    slot_perm = list(range(total + 8))
    rng.shuffle(slot_perm)  # scattered slots: the pool layout must not matter
    row_slots, next_slot = [], 0
    for r in rows:
        row_slots.append(slot_perm[next_slot: next_slot + len(r)])
        next_slot += len(r)
    kv = model.new_kv_store(total + 8)
    done = [0] * len(rows)
    out = [[] for _ in rows]
    while any(d < len(r) for d, r in zip(done, rows)):
        active = [b for b, r in enumerate(rows) if done[b] < len(r)]
        qlens = [min(len(rows[b]) - done[b], rng.choice(chunk) if chunk else len(rows[b])) for b in active]
        ids, positions, slots, ctx_slots, ctx_lens = [], [], [], [], []
        for b, q in zip(active, qlens):
            s, e = done[b], done[b] + q
            ids += rows[b][s:e]
            positions.append(list(range(s, e)))
            slots.append(row_slots[b][s:e])
            ctx_slots.append(row_slots[b][:e])
            ctx_lens.append(e)
        meta = AttentionMetadata.build(qlens, ctx_lens, positions, slots, ctx_slots)
        logits = model(torch.tensor(ids), meta, kv)
        off = 0
        for b, q in zip(active, qlens):
            out[b].append(logits[off: off + q])
            off += q
            done[b] += q
    return [torch.cat(o) for o in out]


def save_as_hf_dir(hf, directory) -> None:
    """The model as a Hugging Face-format directory: config.json, safetensors, tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    hf.save_pretrained(directory, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(hf.config.vocab_size)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers_float32(family, tie, tmp_path):
    from verispec.model.loader import load_model_files, resolve_model
    hf = tiny_hf_model(family, tie)
    save_as_hf_dir(hf, tmp_path)
    cfg, state, _ = load_model_files(resolve_model(str(tmp_path)))
    ours = LlamaModel.from_state_dict(cfg, state, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (13, 5, 21)]
    for chunk in (None, [1], [1, 2, 3, 7]):  # whole prefill, token by token, ragged chunks
        got = run_rows(ours, rows, chunk)
        for r, logits in zip(rows, got):
            with torch.no_grad():
                want = hf(torch.tensor([r])).logits[0].float()
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_a_wrong_rotary_layout_is_caught():
    """The comparison above is sensitive: swapping q/k halves (an un-permute bug) fails it."""
    hf = tiny_hf_model("llama")
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    sd = dict(hf.state_dict())
    w = sd["model.layers.0.self_attn.q_proj.weight"]
    d = cfg.head_dim
    sd["model.layers.0.self_attn.q_proj.weight"] = w.view(cfg.num_heads, 2, d // 2, -1).flip(1).reshape(w.shape)
    ours = LlamaModel.from_state_dict(cfg, sd, dtype=torch.float32)
    rows = [list(range(1, 12))]
    got = run_rows(ours, rows)[0]
    with torch.no_grad():
        want = hf(torch.tensor(rows)).logits[0]
    assert (got - want).abs().max() > 1e-3
