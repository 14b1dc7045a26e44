"""Tokenizer: encode/decode vs transformers, chat template, BOS/EOS rules, incremental detokenizer."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from verispec.model.loader import load_config_and_tokenizer, resolve_model
from verispec.model.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerMeta

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\tTabs\tand\r\nwindows newlines\n\n\nand    runs   of spaces   ",
    "naïve café résumé — “quotes” ‘single’ …",
    "日本語のテキストと中文文本，还有한국어도 있어요.",
    "emoji: 😀🎉👩‍👩‍👧‍👦 🇫🇷 ✅",
    "don't I'll we're they've SHE'S",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "math: x^2 + y_1 = z; π≈3.14159, e^{iπ}+1=0",
    "",
    " ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a haiku about café 😀."}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour"}],
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        _, tokenizer = load_config_and_tokenizer(resolve_model("smollm2-135m-instruct"))
        yield tokenizer


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' tokenizer for the same GGUF (tests only; never in the runtime path)."""
    import transformers
    source = resolve_model("smollm2-135m-instruct")
    return transformers.AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)


# --- encode / decode ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_decode_of_encode_round_trips(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_smollm_pre_tokenizer_isolates_digits(tok, hf_tok):
    """GGUF `pre = smollm` (llama.cpp, and SmolLM2's own tokenizer.json) splits every digit
    off before the GPT-2 split, so a space run before a number stays one piece. transformers'
    GGUF path ignores `pre` for this vocabulary and splits the run; we follow the model."""
    ids = tok.encode("x  12")
    assert [tok.backend.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1", "2"]
    assert hf_tok("x  12")["input_ids"] != ids  # the known transformers divergence


def test_special_tokens_are_whole_and_skipped_when_decoding(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_bos_eos_and_vocab_of_the_default_model(tok):
    assert tok.bos_token_id == 1 and tok.eos_token_ids[0] == 2  # <|im_end|> ends an instruct turn
    assert 0 in tok.eos_token_ids  # <|endoftext|>: llama.cpp stops on it too
    assert tok.vocab_size == 49152 and tok.encode("hi")[0] != tok.bos_token_id  # add_bos_token False
    strings = tok.token_strings()
    assert len(strings) == 49152 and strings[2] == "<|im_end|>" and strings[1000] == tok.backend.id_to_token(1000)
    assert tok.merges()[0] == ("Ġ", "t") and len(tok.merges()) == 48900


def _bos_tokenizer(add_bos: bool) -> Tokenizer:
    backend = Backend(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    meta = TokenizerMeta(bos_token_id=0, eos_token_ids=(3,), add_bos_token=add_bos, chat_template=None)
    return Tokenizer(backend, meta)


def test_bos_is_added_only_when_the_metadata_says_so():
    assert _bos_tokenizer(True).encode("a b") == [0, 1, 2]
    assert _bos_tokenizer(True).encode("a b", add_special_tokens=False) == [1, 2]
    assert _bos_tokenizer(False).encode("a b") == [1, 2]


def test_hf_directory_metadata(tmp_path):
    """tokenizer_config + generation_config of an HF checkpoint: EOS list, template, BOS rule."""
    backend = Backend(models.WordLevel({"<s>": 0, "</s>": 1, "<eot>": 2, "a": 3, "[UNK]": 4}, unk_token="[UNK]"))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True,
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    t = Tokenizer.from_file(tmp_path)
    assert t.eos_token_ids == (2, 1) and t.bos_token_id == 0 and t.encode("a") == [0, 3]
    assert t.apply_chat_template([{"role": "user", "content": "a"}]) == "<s>a"


def test_hf_directory_sampling_defaults(tmp_path):
    """generation_config.json's sampling values become the meta's sampling_defaults (the
    server's defaults with --generation-config auto); invalid ones are left out."""
    backend = Backend(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": 1, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "repetition_penalty": 1.05, "min_p": 2.0, "max_new_tokens": 99}))
    t = Tokenizer.from_file(tmp_path)
    assert t.meta.sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                        "repetition_penalty": 1.05}
    assert isinstance(t.meta.sampling_defaults["top_k"], int)


def test_sampling_defaults_skip_what_a_request_could_not_send():
    from verispec.model.tokenizer import sampling_defaults_from
    assert sampling_defaults_from({}) == {}
    assert sampling_defaults_from({"temperature": "0.5", "top_p": 0, "top_k": 1.5, "min_p": True,
                                   "repetition_penalty": 0, "eos_token_id": 2}) == {}
    assert sampling_defaults_from({"temperature": 0, "top_k": 40.0, "min_p": 0.05}) == {
        "temperature": 0.0, "top_k": 40, "min_p": 0.05}


def test_default_model_has_no_sampling_defaults(tok):
    """The default GGUF carries no sampling values: the server's defaults stay neutral for it."""
    assert tok.meta.sampling_defaults == {}


# --- chat template -------------------------------------------------------------------------------

@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_equals_transformers(tok, hf_tok, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref


def test_encode_chat_equals_transformers(tok, hf_tok):
    for messages in CONVERSATIONS:
        ref = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert tok.encode_chat(messages) == list(ref)


def test_chat_template_sandbox_helpers():
    import jinja2

    backend = Backend(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                "{{ messages | tojson }}")
    t = Tokenizer(backend, TokenizerMeta(None, (), False, template))
    assert t.apply_chat_template([{"role": "user", "content": "<é>"}]) == '[{"role": "user", "content": "<é>"}]'
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        t.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        t.apply_chat_template(["not a dict"])


# --- incremental detokenizer --------------------------------------------------------------------

STREAM_TEXT = "Olá 世界! 😀🎉 données — 한국어 🇫🇷 fin.\n  code: x = '日本' + \"😀\""


def _stream(tok, prompt_ids, ids, chunk_sizes):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas, i = [], 0
    for size in chunk_sizes:
        if i >= len(ids):
            break
        deltas.append(detok.push(ids[i:i + size]))
        i += size
    if i < len(ids):
        deltas.append(detok.push(ids[i:]))
    deltas.append(detok.flush())
    return deltas


def test_multibyte_characters_really_split_across_tokens(tok):
    """Guard for the tests below: naive per-token decoding of this text emits U+FFFD."""
    ids = tok.encode(STREAM_TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_deltas_concatenate_to_the_full_decode(tok, seed):
    rng = random.Random(seed)
    ids = tok.encode(STREAM_TEXT)
    sizes = [1] * len(ids) if seed == 0 else [rng.randint(1, 4) for _ in ids]
    deltas = _stream(tok, [], ids, sizes)
    assert "".join(deltas) == tok.decode(ids) == STREAM_TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_after_a_prompt(tok):
    prompt = tok.encode_chat([{"role": "user", "content": "Say hi in Japanese 🙂"}])
    ids = tok.encode("こんにちは 👋<|im_end|>")
    deltas = _stream(tok, prompt, ids, [1] * len(ids))
    assert "".join(deltas) == "こんにちは 👋" and not any("\ufffd" in d for d in deltas)


def test_incremental_window_stays_small(tok):
    ids = tok.encode(STREAM_TEXT * 20)
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        detok.push([i])
        assert len(detok._ids) <= 12  # only a short context window is ever decoded


# --- SentencePiece GGUFs (Llama 2 / Mistral): a synthetic vocabulary ---------------------------------

SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "llo", "▁hel", "▁hello",
              "▁w", "or", "▁wor", "ld", "▁world", "lo", "el"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    """A GGUF with a tiny SentencePiece vocabulary: specials, 256 byte tokens, scored pieces."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_tokenizer_model, "llama"),
                       (w.add_token_list, tokens), (w.add_token_types, types),
                       (w.add_token_scores, [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_unk_token_id, 0)):
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def spm_tok(spm_gguf):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(spm_gguf.parent / "cache"))
        return load_config_and_tokenizer(resolve_model(str(spm_gguf)))[1]


@pytest.fixture(scope="module")
def spm_ref(spm_gguf):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)


@pytest.mark.parametrize("text", ["hello world", "hello  world", "héllo wörld", "world hello", "hello\nworld"])
def test_sentencepiece_gguf_encodes_like_transformers(spm_tok, spm_ref, text):
    assert spm_tok.encode(text) == spm_ref(text)["input_ids"]
    assert spm_tok.decode(spm_tok.encode(text)) == text


def test_sentencepiece_space_prefix_and_byte_fallback(spm_tok):
    """BOS is added (SentencePiece default); a leading space stays a piece, as SentencePiece and
    llama.cpp do; characters outside the vocabulary fall back to <0xXX> byte tokens."""
    pieces = lambda text: [spm_tok.backend.id_to_token(i) for i in spm_tok.encode(text)]
    assert pieces(" hello") == ["<s>", "▁", "▁hello"]
    assert pieces("hé") == ["<s>", "▁h", "<0xC3>", "<0xA9>"]
    assert spm_tok.decode(spm_tok.encode(" hello é")) == " hello é"


def test_a_tokenizer_that_rendered_a_chat_pickles_and_renders_the_same_elsewhere(tok):
    import pickle
    messages = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages)              # compiles the template
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.apply_chat_template(messages) == text and copy.encode_chat(messages) == tok.encode_chat(messages)
