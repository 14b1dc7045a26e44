"""Target/draft tokenizer compatibility: identical, padded embeddings, and refused pairs."""
from __future__ import annotations

import logging

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from verispec.model.config import ModelConfig
from verispec.model.tokenizer import Tokenizer, TokenizerMeta
from verispec.spec.compat import check_pair, check_pair_cli

BASE_VOCAB = ["<|endoftext|>", "<|im_end|>", "a", "b", "c", "d", "Ġ", "ab", "cd", "Ġab", "abcd"]
BASE_MERGES = [("a", "b"), ("c", "d"), ("Ġ", "ab"), ("ab", "cd")]


def make_tokenizer(vocab=BASE_VOCAB, merges=BASE_MERGES, eos=(1,), specials=(0, 1)) -> Tokenizer:
    """A small byte-level-style BPE tokenizer with control tokens, built from scratch."""
    backend = Backend(models.BPE({t: i for i, t in enumerate(vocab)}, list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(vocab[i], special=True, normalized=False) for i in specials])
    meta = TokenizerMeta(bos_token_id=None, eos_token_ids=tuple(eos), add_bos_token=False, chat_template=None)
    return Tokenizer(backend, meta)


def make_config(vocab_rows: int, family="qwen2") -> ModelConfig:
    return ModelConfig(family=family, vocab_size=vocab_rows, hidden_size=16, intermediate_size=32,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)


N = len(BASE_VOCAB)


def test_identical_tokenizers_are_compatible():
    verdict = check_pair(make_tokenizer(), make_tokenizer(), make_config(N), make_config(N))
    assert verdict.ok and verdict.shared_vocab_size == N, verdict.reason


def test_padded_embeddings_are_compatible_over_the_shared_rows(caplog):
    """Qwen2.5-style: same tokenizer, embedding tables padded to different sizes."""
    with caplog.at_level(logging.INFO, logger="verispec"):
        verdict = check_pair(make_tokenizer(), make_tokenizer(), make_config(N + 9), make_config(N + 5))
    assert verdict.ok and verdict.shared_vocab_size == N + 5
    assert "padded embeddings" in verdict.reason and "masked" in verdict.reason
    assert any("padded embeddings" in r.getMessage() for r in caplog.records)


def test_embedding_smaller_than_the_tokenizer_is_refused():
    verdict = check_pair(make_tokenizer(), make_tokenizer(), make_config(N), make_config(N - 1))
    assert not verdict.ok and "draft embedding has" in verdict.reason and verdict.shared_vocab_size == 0


def test_one_changed_token_string_is_refused_with_its_index():
    vocab = list(BASE_VOCAB)
    vocab[8] = "dc"
    draft = make_tokenizer(vocab=vocab, merges=[("a", "b"), ("d", "c"), ("Ġ", "ab")])
    verdict = check_pair(make_tokenizer(), draft, make_config(N), make_config(N))
    assert not verdict.ok and "token 8 differs" in verdict.reason and "'cd'" in verdict.reason


def test_extra_token_is_refused():
    draft = make_tokenizer(vocab=BASE_VOCAB + ["abab"], merges=BASE_MERGES + [("ab", "ab")])
    verdict = check_pair(make_tokenizer(), draft, make_config(N + 1), make_config(N + 1))
    assert not verdict.ok and f"token {N}" in verdict.reason and "only in the draft" in verdict.reason


def test_different_eos_is_refused():
    verdict = check_pair(make_tokenizer(eos=(1,)), make_tokenizer(eos=(0,)), make_config(N), make_config(N))
    assert not verdict.ok and "EOS differs" in verdict.reason


def test_different_merges_are_refused():
    draft = make_tokenizer(merges=[BASE_MERGES[1], BASE_MERGES[0]] + BASE_MERGES[2:])
    verdict = check_pair(make_tokenizer(), draft, make_config(N), make_config(N))
    assert not verdict.ok and "merges differ at rank 0" in verdict.reason


def test_different_special_tokens_are_refused():
    verdict = check_pair(make_tokenizer(), make_tokenizer(specials=(0,)), make_config(N), make_config(N))
    assert not verdict.ok and "special" in verdict.reason


def test_check_pair_cli_on_the_default_model(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    ok, message = check_pair_cli("smollm2-135m-instruct", "smollm2-135m-instruct")
    assert ok and message.startswith("compatible") and "49152 tokens" in message
    assert not list(tmp_path.glob("*/model.safetensors"))  # loads no weights
