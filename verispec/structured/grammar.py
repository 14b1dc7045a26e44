"""Grammar-constrained decoding through llguidance: compile a constraint, walk it per token.

Why llguidance (docs/decisions/structured-output.md): both maintained engines compute a
mask in a small fraction of a decode step on the default model's vocabulary
(`bench/grammar_mask.py`), so mask time does not decide; llguidance is one self-contained
wheel, while xgrammar needs `transformers` (seconds of import, which the tokenizer avoids
on purpose) and `triton`.

Contract with the sampler (`verispec.sampling`): a row's allowed tokens at a scored
position are those the constraint admits after the row's committed output followed by
the tokens treated as generated there (a verify row's accepted drafts, a draft model's own
drafts). The matcher's state only ever advances with committed tokens (`commit`); masks
and draft checks walk forward and roll back, so a rejected draft leaves no trace.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from verispec.structured.spec import StructuredOutput

if TYPE_CHECKING:
    import torch

# JSON may put whitespace between tokens (llguidance's flexible default), but a run of it
# is bounded: a small model can otherwise loop on newlines until max_tokens.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}
# Compiled constraints kept per engine (recently used first); each is a grammar text.
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A constraint that does not compile; the message names `response_format`."""


class GrammarCompiler:
    """Turns StructuredOutput into per-request matchers for one tokenizer and vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]):
        """`tokenizer_json`: the Hugging Face tokenizers JSON; `vocab_size`: the logits'
        width; `eos_ids`: what ends an output once its constraint is complete (required)."""
        if not eos_ids:
            raise GrammarError("response_format: structured output needs the model to have an EOS token")
        self._tokenizer_json = tokenizer_json
        self.vocab_size = max(vocab_size, max(eos_ids) + 1)
        self._eos = list(eos_ids)
        self._tokenizer = None  # llguidance.LLTokenizer, built on first use (~0.2 s)
        self._grammars: OrderedDict[StructuredOutput, str] = OrderedDict()

    def _lltokenizer(self):
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self._eos)
        return self._tokenizer

    def grammar_text(self, spec: StructuredOutput) -> str:
        """llguidance's grammar for `spec` (cached); GrammarError if it cannot be built."""
        text = self._grammars.get(spec)
        if text is not None:
            self._grammars.move_to_end(spec)
            return text
        text = _translate(spec)
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self._lltokenizer())
        if is_error:
            raise GrammarError(f"response_format: the {spec.kind} constraint does not compile: {messages[0]}")
        self._grammars[spec] = text
        if len(self._grammars) > CACHE_SIZE:
            self._grammars.popitem(last=False)
        return text

    def matcher(self, spec: StructuredOutput) -> "RequestGrammar":
        import llguidance

        m = llguidance.LLMatcher(self._lltokenizer(), self.grammar_text(spec), log_level=0)
        if m.is_error():
            raise GrammarError(f"response_format: the {spec.kind} constraint does not compile: {m.get_error()}")
        return RequestGrammar(m, self.vocab_size)


def _translate(spec: StructuredOutput) -> str:
    import llguidance

    if spec.kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"response_format: the JSON schema is not valid: {exc}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.source))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


class RequestGrammar:
    """One request's position in its constraint: the matcher after its committed output.

    `committed` counts the output tokens consumed; the histories the sampler passes start
    with exactly those tokens (the request's output), so what follows them is what a
    position treats as generated.
    """

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self.committed = 0

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance by tokens the engine appended; RuntimeError if one is outside the
        constraint (the sampler never draws one: that would be a bug, failing this row)."""
        for t in tokens:
            if self._m.is_stopped():  # complete: only EOS is admitted (ignore_eos runs on)
                self.committed += 1
                continue
            if not self._m.consume_token(t):
                raise RuntimeError(f"token {t} is outside the request's structured-output constraint: "
                                   f"{self._m.get_error()}")
            self.committed += 1

    def valid_prefix(self, output: Sequence[int], drafts: Sequence[int]) -> int:
        """How many of `drafts` the constraint admits after `output` (no state change)."""
        extra = list(output[self.committed:])
        if extra and self._m.try_consume_tokens(extra) != len(extra):
            raise RuntimeError("a row's output left its structured-output constraint")
        try:
            return self._m.validate_tokens(list(drafts))
        finally:
            if extra:
                self._m.rollback(len(extra))

    def bitmasks(self, extras: Sequence[Sequence[int]]) -> "torch.Tensor":
        """(len(extras), ceil(V / 32)) int32 packed allowed-token masks, one per position:
        extras[i] is what position i treats as generated after the committed output.
        Positions of one verify row extend each other, so the walk reuses the common prefix.
        The engine cuts drafts at the constraint, so every extra is normally admitted."""
        import llguidance.torch as llt

        out = llt.allocate_token_bitmask(len(extras), self.vocab_size)
        walked: list[int] = []
        try:
            for i, extra in enumerate(extras):
                keep = _common_prefix(walked, extra)
                if keep < len(walked):
                    self._m.rollback(len(walked) - keep)
                    del walked[keep:]
                rest = list(extra[keep:])
                took = self._m.try_consume_tokens(rest) if rest else 0
                walked.extend(rest[:took])
                if took == len(rest):
                    llt.fill_next_token_bitmask(self._m, out, i)
                # else: the position follows a token the constraint refuses, whose p is 0, so
                # verification stops before it and its (all-allowed) mask is never drawn from
        finally:
            if walked:
                self._m.rollback(len(walked))
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def allowed_tokens(positions: Sequence[tuple[RequestGrammar, Sequence[int]]], vocab: int) -> "torch.Tensor":
    """(N, vocab) bool: the tokens each position's constraint admits; positions[i] is
    (grammar, tokens treated as generated after its committed output). Consecutive
    positions of one grammar are walked together."""
    import numpy
    import torch

    packed, start = [], 0
    while start < len(positions):
        g = positions[start][0]
        end = start
        while end < len(positions) and positions[end][0] is g:
            end += 1
        packed.append(g.bitmasks([extra for _, extra in positions[start:end]]))
        start = end
    words = (packed[0] if len(packed) == 1 else torch.cat(packed)).numpy()  # (N, W) int32
    # bit j of word w is token 32 w + j: little-endian bytes, bits least significant first
    bits = numpy.unpackbits(words.astype("<i4", copy=False).view(numpy.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab]).view(torch.bool)  # 0/1 bytes: no copy
    if allowed.shape[1] < vocab:  # logits wider than the constraint's vocabulary: never admitted
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed
