"""Tokenizer: a `tokenizers.Tokenizer` plus the model's BOS/EOS rules and chat template.

Built from a Hugging Face-format directory (`tokenizer.json`, `tokenizer_config.json`,
optional `generation_config.json`, `chat_template.jinja`, `config.json`); GGUF models reach
it through the weight cache, which is such a directory (see `loader.py`). `transformers` is
never imported: it would add seconds to every start.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _BackendTokenizer


@dataclass(frozen=True)
class TokenizerMeta:
    """What the vocabulary alone does not say: special tokens, BOS rule, EOS set, template."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None
    special_tokens: dict = field(default_factory=dict)  # bos_token/eos_token/... -> string
    # The model's recommended sampling values from generation_config.json (temperature,
    # top_p, top_k, min_p, repetition_penalty; only those it sets, and only valid ones): the
    # server's defaults for requests that omit them (`--generation-config auto`).
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (it mentions the variable)."""
        return template_supports_tools(self.chat_template)


class Tokenizer:
    """Text <-> token ids for one model, with its chat template."""

    def __init__(self, backend: _BackendTokenizer, meta: TokenizerMeta):
        self.backend = backend
        self.meta = meta
        self._template = None  # compiled lazily: jinja2 import is only paid by chat users

    def __getstate__(self) -> dict:
        """Pickled without the compiled template (jinja2 templates do not unpickle): a
        tokenizer in use can be sent to another process, which compiles its own."""
        return {**self.__dict__, "_template": None}

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load from an HF-format directory (or a `tokenizer.json` inside one)."""
        path = Path(path)
        directory = path.parent if path.is_file() else path
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{directory}: no tokenizer.json")
        backend = _BackendTokenizer.from_file(str(tok_file))
        return cls(backend, _read_meta(directory, backend))

    # --- ids ------------------------------------------------------------------------------
    @property
    def bos_token_id(self) -> int | None:
        return self.meta.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.meta.eos_token_ids

    @cached_property
    def vocab_size(self) -> int:
        """Number of real tokens (ids 0..vocab_size-1); embeddings may have more rows."""
        return max(self.backend.get_vocab(with_added_tokens=True).values()) + 1

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; prepends BOS only when the model's metadata asks for it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.meta.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special (control) tokens are dropped unless asked for."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat -----------------------------------------------------------------------------
    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tools (see template_supports_tools)."""
        return self.meta.supports_tools

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_vars) -> str:
        """Render a conversation with the model's Jinja chat template, as transformers does.
        `tools`: OpenAI tool definitions ({"type": "function", "function": {...}}), rendered
        by templates that support them (the `tools` variable; None: no tools)."""
        if not self.meta.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"messages[{i}] must be a dict with a 'role' key, got {message!r}")
        if self._template is None:
            self._template = _compile_template(self.meta.chat_template)
        variables = {**self.meta.special_tokens, "tools": tools or None, "documents": None, **template_vars}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Ids of the rendered conversation; the template itself writes any BOS it wants."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.encode(text, add_special_tokens=False)

    # --- for the target/draft compatibility check -------------------------------------------
    def token_strings(self) -> list[str]:
        """Token string of every id in 0..vocab_size-1 ("" for an id the vocabulary skips)."""
        strings = [""] * self.vocab_size
        for token, idx in self.backend.get_vocab(with_added_tokens=True).items():
            if idx < self.vocab_size:
                strings[idx] = token
        return strings

    def merges(self) -> list[tuple[str, str]]:
        """BPE merges in rank order ([] for non-BPE models)."""
        model = json.loads(self.backend.to_str())["model"]
        return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
                for m in model.get("merges", [])]

    def special_token_ids(self) -> tuple[int, ...]:
        """Ids of tokens marked special (skipped by decode)."""
        return tuple(sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special))


def _compile_template(source: str):
    """Compile a chat template in the sandbox transformers uses, with the same helpers."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# --- metadata from the HF files ----------------------------------------------------------------

def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_meta(directory: Path, backend: _BackendTokenizer) -> TokenizerMeta:
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():  # newer HF checkpoints keep the template in its own file
        tok_cfg = {**tok_cfg, "chat_template": jinja_file.read_text(encoding="utf-8")}
    return meta_from_configs(backend, tok_cfg, _read_json(directory / "generation_config.json"),
                             _read_json(directory / "config.json"))


def meta_from_configs(backend: _BackendTokenizer, tok_cfg: dict, gen_cfg: dict,
                      model_cfg: dict) -> TokenizerMeta:
    """TokenizerMeta from the dicts of tokenizer_config.json, generation_config.json, config.json."""
    special = {k: _token_content(tok_cfg.get(k))
               for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    bos_id = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
    if bos_id is None and special["bos_token"]:
        bos_id = backend.token_to_id(special["bos_token"])
    # EOS: generation config first (what HF generate stops on), then the tokenizer's, the model's.
    eos_ids: list[int] = []
    named_eos = backend.token_to_id(special["eos_token"]) if special["eos_token"] else None
    candidates = _as_ids(gen_cfg.get("eos_token_id")) + _as_ids(named_eos) + _as_ids(model_cfg.get("eos_token_id"))
    for idx in candidates:
        if idx not in eos_ids:
            eos_ids.append(idx)
    if "add_bos_token" in tok_cfg:
        add_bos = bool(tok_cfg["add_bos_token"]) and bos_id is not None
    else:  # e.g. Llama 3: the post-processor in tokenizer.json is the rule
        add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
    return TokenizerMeta(bos_token_id=bos_id, eos_token_ids=tuple(eos_ids), add_bos_token=add_bos,
                         chat_template=_chat_template(tok_cfg),
                         special_tokens={k: v for k, v in special.items() if v is not None},
                         sampling_defaults=sampling_defaults_from(gen_cfg))


# generation_config.json key -> (check of a valid value, type): what vLLM's
# `--generation-config auto` takes from it. `do_sample` is ignored, as vLLM does.
_SAMPLING_KEYS = {
    "temperature": (lambda v: v >= 0, float),
    "top_p": (lambda v: 0 < v <= 1, float),
    "top_k": (lambda v: v >= -1 and float(v).is_integer(), int),
    "min_p": (lambda v: 0 <= v <= 1, float),
    "repetition_penalty": (lambda v: v > 0, float),
}


def sampling_defaults_from(gen_cfg: dict) -> dict:
    """The sampling values a generation config recommends; a value that is not a number
    in the request field's range is left out (neutral), never an error on every request."""
    out = {}
    for key, (valid, kind) in _SAMPLING_KEYS.items():
        value = gen_cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            continue
        if valid(value):
            out[key] = kind(value)
    return out


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template references the `tools` variable (transformers' convention
    for templates that render tool definitions)."""
    import re
    return bool(template) and re.search(r"\btools\b", template) is not None


def _chat_template(tok_cfg: dict) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, one `push` at a time.

    Each push decodes only a short window: the ids since `prefix_offset` (a few tokens of
    already-emitted context, needed because decoders such as SentencePiece's change a token's
    text depending on what precedes it). Text that ends in an incomplete UTF-8 character
    (decoded as U+FFFD) is held back until the bytes that complete it arrive.
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prompt_ids = list(prompt_ids)
        self._ids = prompt_ids[-self._CONTEXT_TOKENS:]  # the window; older ids are never re-read
        self._prefix_offset = 0                # window start of the context
        self._read_offset = len(self._ids)     # ids before this are fully emitted
        self._held_chars = 0                   # chars after the read offset already emitted

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids) -> str:
        """Append generated ids; return the newly completed text (may be "")."""
        self._ids.extend(int(i) for i in new_ids)
        # The context may itself end in an incomplete character (a prompt cut mid-character):
        # strip its U+FFFD so the completed character is emitted here, not lost.
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset]).rstrip("\ufffd")
        full_text = self._decode(self._ids[self._prefix_offset:])
        complete = not full_text.endswith("\ufffd")
        visible = full_text if complete else full_text.rstrip("\ufffd")
        delta = visible[len(prefix_text) + self._held_chars:]
        if complete:
            # Slide the window: the new context is the ids just consumed.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._held_chars = 0
            self._trim()
        else:
            self._held_chars += len(delta)
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is held back (incomplete bytes become U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset]).rstrip("\ufffd")
        full_text = self._decode(self._ids[self._prefix_offset:])
        delta = full_text[len(prefix_text) + self._held_chars:]
        self._prefix_offset, self._read_offset, self._held_chars = len(self._ids), len(self._ids), 0
        return delta

    def _trim(self) -> None:
        """Drop ids before the context window so memory and work stay O(window)."""
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
