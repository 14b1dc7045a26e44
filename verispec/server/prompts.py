"""Refuse prompts longer than the context before paying to tokenize them whole.

The tokenizers library holds the interpreter lock for a whole `encode` call: 1 MB of text
takes about half a second, during which the API process answers nobody (no stream, no
/health). `check_length` therefore decides "certainly too long" first, from work bounded
by the context rather than by the body:

1. a text longer than `limit` tokens of the longest token in the vocabulary is refused
   with no tokenizing at all;
2. a long text is counted piece by piece (PIECE_CHARS each, cut before a space that ends
   a word, where the tokenizer's pre-splitting cuts too), stopping as soon as the count
   passes the limit. Each piece is one short call, so the event loop gets the lock back
   between pieces. The count may differ from the whole text's by a few tokens per cut,
   so SLACK_PER_CUT tokens per cut are allowed before refusing: a prompt is refused only
   when it cannot fit.

A text that passes is then tokenized exactly by the caller: at most about `limit` tokens.
Pure Python over any tokenizer with `encode(text, add_special_tokens=False)`.
"""
from __future__ import annotations

from typing import Any

PIECE_CHARS = 8192     # ~2-4 ms of tokenizing per call on a 2-core machine
SHORT_CHARS = 16384    # texts up to this long are tokenized whole without counting first
SLACK_PER_CUT = 8      # tokens by which a cut may change the count (measured: 0-1)
CUT_SEARCH = 256       # how far back from a piece's end to look for a word boundary


class PromptTooLong(ValueError):
    """The text is more than `limit` tokens; `at_least` is a lower bound on its length."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"at least {at_least} tokens; the limit is {limit}")
        self.at_least = at_least
        self.limit = limit


def longest_token_chars(tokenizer: Any) -> int | None:
    """Most characters one token can stand for, or None if the tokenizer cannot say.

    Byte-level vocabularies spell a token with one symbol per byte, and a byte is at most
    one character, so the longest token string bounds it either way."""
    strings = getattr(tokenizer, "token_strings", None)
    if strings is None:
        return None
    return max((len(s) for s in strings()), default=None) or None


def check_length(tokenizer: Any, text: str, limit: int, max_token_chars: int | None) -> None:
    """Raise PromptTooLong if `text` is certainly more than `limit` tokens; else return
    (the caller then tokenizes it exactly). Cost: bounded by `limit`, not by len(text)."""
    if len(text) <= SHORT_CHARS:
        return
    if max_token_chars is not None and len(text) > limit * max_token_chars:
        raise PromptTooLong(-(-len(text) // max_token_chars), limit)
    count, cuts = 0, 0
    for piece in _pieces(text):
        count += len(tokenizer.encode(piece, add_special_tokens=False))
        if count - SLACK_PER_CUT * cuts > limit:
            raise PromptTooLong(count - SLACK_PER_CUT * cuts, limit)
        cuts += 1


def _pieces(text: str):
    """Consecutive pieces of about PIECE_CHARS, each cut just before a space that follows
    a non-space (where byte-level and sentencepiece pre-tokenizers split anyway)."""
    start = 0
    while start < len(text):
        end = min(start + PIECE_CHARS, len(text))
        if end < len(text):
            end = _word_boundary(text, start, end)
        yield text[start:end]
        start = end


def _word_boundary(text: str, start: int, end: int) -> int:
    for i in range(end, max(start + 1, end - CUT_SEARCH), -1):
        if text[i] == " " and not text[i - 1].isspace():
            return i
    return end
