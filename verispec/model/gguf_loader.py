"""GGUF -> Hugging Face layout: config dict, float32 state dict, tokenizer.

A GGUF file carries everything a model needs (hyper-parameters, quantized tensors, the
tokenizer's vocabulary and merges, the chat template) under llama.cpp's names. This module
translates it into the layout of a Hugging Face checkpoint, so that the rest of verispec (and
the weight cache, which *is* such a directory) only ever sees one format:

    config.json         `hf_config_from_gguf`      (LlamaForCausalLM / Qwen2 / Qwen3 keys)
    model.safetensors   `iter_hf_tensors`          (dequantized to float32, HF tensor names)
    tokenizer.json      `build_tokenizer`          (byte-level BPE, pre-tokenizer per `pre`)
    tokenizer_config    `tokenizer_config_from_gguf` (chat template, BOS/EOS, add_bos_token)

Only the cache builder in `loader.py` imports this module, so `gguf` (and its numpy-heavy
quantization code) stays out of the warm start path.
"""
from __future__ import annotations

import logging
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from verispec.model.config import UnsupportedArchitecture

log = logging.getLogger("verispec")

# GGUF `general.architecture` -> HF `architectures[0]`. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# GGUF per-layer tensor suffix -> HF per-layer name (both without the ".weight"/".bias" tail).
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# llama.cpp token types (gguf.TokenType): which vocabulary entries are not plain BPE pieces.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Strings llama.cpp treats as "end of generation" when the file marks them as control tokens.
# Matching it keeps a GGUF's stopping behaviour the same here as in llama.cpp.
_EOG_STRINGS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>",
                "<end_of_turn>", "<|eom_id|>")

# Pre-tokenizer split patterns, keyed by GGUF `tokenizer.ggml.pre`.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                 r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# pre name -> (split regex, isolate every digit first, NFC-normalize)
PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT, False, False),
    "gpt-2": (_GPT2_SPLIT, False, False),
    # SmolLM / StarCoder: every digit is its own piece, then the GPT-2 split.
    "smollm": (_GPT2_SPLIT, True, False),
    "starcoder": (_GPT2_SPLIT, True, False),
    "refact": (_GPT2_SPLIT, True, False),
    # Qwen2/2.5/3: its own split; the original tokenizer.json NFC-normalizes first.
    "qwen2": (_QWEN2_SPLIT, False, True),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, True),
    "llama-bpe": (_LLAMA3_SPLIT, False, False),
    "llama3": (_LLAMA3_SPLIT, False, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False, False),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy / HF order (GGUF lists dims innermost first; reversed here)
    qtype: int              # gguf.GGMLQuantizationType value
    offset: int             # absolute byte offset of the data in the file


class GGUFMetadata:
    """The key/value metadata and tensor directory of one GGUF file."""

    def __init__(self, path: Path, fields: dict, tensors: list[TensorInfo]):
        self.path = path
        self.fields = fields
        self.tensors = tensors
        self.arch = fields.get("general.architecture")
        if self.arch is None:
            raise ValueError(f"{path}: GGUF file has no general.architecture key")

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def arch_key(self, suffix: str, default=None):
        """Read `<arch>.<suffix>`, e.g. `llama.block_count`."""
        return self.fields.get(f"{self.arch}.{suffix}", default)

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}


# GGUF value type -> struct format (8 = string, 9 = array are handled apart).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}


class _Cursor:
    """Sequential little-endian reads from a memory-mapped file."""

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:  # numeric arrays in one read, not element by element
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALAR:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALAR[vtype])


def read_gguf(path: Path) -> GGUFMetadata:
    """Parse a GGUF header: metadata and tensor directory (tensor data is not read).

    Hand-rolled rather than gguf.GGUFReader: that reader builds a numpy view per array
    element, which takes seconds for a 150k-token vocabulary; this takes a fraction of one.
    A header that runs past the end of the file is a ValueError naming the file.
    """
    try:
        return _read_gguf(path)
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: GGUF file is truncated or corrupt ({exc})") from None


def _read_gguf(path: Path) -> GGUFMetadata:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r})")
        cur = _Cursor(mm, 4)
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported; supported: 2, 3")
        n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
        fields = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        align = int(fields.get("general.alignment", 32))
        data_start = cur.pos + (-cur.pos % align)
    tensors = [TensorInfo(n, shape, qtype, data_start + off) for n, shape, qtype, off in infos]
    return GGUFMetadata(Path(path), fields, tensors)


def open_gguf(path: Path) -> GGUFMetadata:
    """Read a GGUF header and check its architecture is one we run."""
    meta = read_gguf(path)
    if meta.arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{path}: unsupported GGUF architecture {meta.arch!r}; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (Mistral GGUFs use 'llama')")
    return meta


def _f32(value: float) -> float:
    """GGUF stores floats as float32; keep the short decimal (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def hf_config_from_gguf(meta: GGUFMetadata, eos_token_ids: list[int]) -> dict:
    """A Hugging Face `config.json` dict for this GGUF."""
    names = meta.tensor_names
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF has a rope_freqs tensor (Llama-3.1-style rope scaling), which the "
                         "GGUF loader does not translate; load the Hugging Face checkpoint instead")
    embd = next((t for t in meta.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{meta.path}: GGUF has no token_embd.weight tensor")
    hidden = int(meta.arch_key("embedding_length"))
    num_heads = int(meta.arch_key("attention.head_count"))
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[meta.arch]],
        "model_type": meta.arch,
        "vocab_size": embd.shape[0],  # rows of the embedding (may exceed the tokenizer's)
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_key("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.arch_key("attention.head_count_kv", num_heads)),
        "head_dim": int(meta.arch_key("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": _f32(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.arch_key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_ids,
        "torch_dtype": "float32",
    }
    scaling = _rope_scaling(meta)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _rope_scaling(meta: GGUFMetadata) -> dict | None:
    kind = meta.arch_key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = _f32(meta.arch_key("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta.arch_key("rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": int(original)}
    raise ValueError(f"GGUF rope.scaling.type {kind!r} is not supported; supported: none, linear, yarn")


# --- tensors -------------------------------------------------------------------------------

def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its Hugging Face name, or raise for one we do not know."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in verispec")
    layer, kind, tail = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{tail}"


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (half-split rotary -> interleaved pairs).

    Within each head, HF orders rotary dims as [x0..x_{d/2-1}, y0..y_{d/2-1}]; llama.cpp
    wants [x0, y0, x1, y1, ...]. Kept here (unused at load time) so tests can show that
    skipping `unpermute_from_gguf` changes the weights.
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_for_gguf`: interleaved rotary pairs back to HF's half-split order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_hf_tensors(meta: GGUFMetadata, cfg: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array) per tensor: dequantized, Q/K un-permuted for `llama`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    data = np.memmap(meta.path, dtype=np.uint8, mode="r")
    for t in meta.tensors:
        name = hf_tensor_name(t.name)
        qtype = GGMLQuantizationType(t.qtype)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = t.shape[-1] // block * block_bytes
        rows = int(np.prod(t.shape[:-1], dtype=np.int64))
        raw = data[t.offset:t.offset + rows * row_bytes].reshape(rows, row_bytes)
        w = dequantize(raw, qtype).reshape(t.shape).astype(np.float32, copy=False)
        if meta.arch == "llama":
            # llama.cpp permutes Q/K only for `llama` (interleaved rotary); qwen2/3 use NeoX rope.
            if ".self_attn.q_proj." in name:
                w = unpermute_from_gguf(w, cfg["num_attention_heads"])
            elif ".self_attn.k_proj." in name:
                w = unpermute_from_gguf(w, cfg["num_key_value_heads"])
        yield name, np.ascontiguousarray(w)


# --- tokenizer -----------------------------------------------------------------------------

def gguf_vocab(meta: GGUFMetadata) -> tuple[list[str], list[int]]:
    """Token strings and types, without the trailing `[PADn]` filler rows.

    llama.cpp's converter pads the token list up to the embedding size with UNUSED
    placeholders; the original tokenizer has no such tokens, so they are dropped here.
    """
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    while tokens and types[-1] == TOKEN_UNUSED:
        tokens.pop()
        types.pop()
    return tokens, types


def build_tokenizer(meta: GGUFMetadata):
    """A `tokenizers.Tokenizer` equal to the model's original tokenizer.

    `tokenizer.ggml.model` "gpt2": byte-level BPE with the file's merges and the split
    regex of its `pre` type. "llama": SentencePiece BPE (Llama 2, Mistral), merges rebuilt
    from the token scores.
    """
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported; supported: "
                         "gpt2 (byte-level BPE), llama (SentencePiece BPE)")
    tokens, types = gguf_vocab(meta)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicated string keeps its first id, as llama.cpp does
    tok = builders[kind](meta, vocab, tokens, types)
    # Control tokens (<|im_start|>, <s>) are matched whole and are "special" (skipped when
    # decoding with skip_special_tokens); user-defined ones (<tool_call>) are matched whole only.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED])
    return tok


def _byte_level_bpe(meta: GGUFMetadata, vocab: dict, tokens: list[str], types: list[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    split, split_digits, nfc = PRE_TOKENIZERS[pre]
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split == _GPT2_SPLIT:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if split_digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: GGUFMetadata, vocab: dict, tokens: list[str], types: list[int]):
    """SentencePiece BPE as a `tokenizers` BPE: "▁" for spaces, <0xXX> byte fallback.

    The space prefix goes through a normalizer, so like llama.cpp (and the original Llama 2 /
    Mistral tokenizer.json) it is added at the start and again after every special token.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) < len(tokens):
        raise ValueError(f"{meta.path}: SentencePiece GGUF has {len(scores)} token scores for "
                         f"{len(tokens)} tokens; merges cannot be rebuilt")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, types, scores),
                               unk_token=tokens[unk_id] if unk_id is not None else None,
                               fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + steps)
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a normal token into two
    normal tokens, ranked by the merged token's score (SentencePiece merges best score first)."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_NORMAL}
    ranked = []
    for piece, idx in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[idx], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def eos_token_ids_from_gguf(meta: GGUFMetadata) -> list[int]:
    """EOS first, then EOT/EOM, then control tokens llama.cpp also treats as end of generation."""
    tokens, types = gguf_vocab(meta)
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty == TOKEN_CONTROL and tok in _EOG_STRINGS and i not in ids:
            ids.append(i)
    return ids


def tokenizer_config_from_gguf(meta: GGUFMetadata, eos_token_ids: list[int]) -> dict:
    """The `tokenizer_config.json` fields verispec reads (special tokens, template, BOS rule)."""
    tokens, _ = gguf_vocab(meta)

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    return {
        # SentencePiece vocabularies add BOS unless the file says otherwise (llama.cpp's default).
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token",
                                       meta.get("tokenizer.ggml.model") == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": tokens[eos_token_ids[0]] if eos_token_ids else None,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
