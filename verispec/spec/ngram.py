"""Prompt-lookup proposer: continue the sequence the way it continued last time.

For each row, take the longest suffix n-gram of the token history (n from max_n down to
min_n) that occurred earlier, and propose the (up to k) tokens that followed its most
recent earlier occurrence. It has no probabilities: the rejection sampler treats its
drafts as one-hot q, which is exact because the drafts are a deterministic function of
the history.

Each sequence keeps an index {n-gram: start of its latest occurrence that has a
following token}, extended with the tokens appended since the last call, so a step
costs O(new tokens * number of n), not a scan of the history. The index is C++
(ngram_index.cpp) where it builds, else `PythonIndex`, the reference it matches exactly:
a round's lookups run just after the forward pass has flushed the caches, where each
Python dict probe costs several cache misses and a flat table's one.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Protocol

from verispec.native import CppExtension
from verispec.spec.proposer import Offer


class TokenHistory(Protocol):
    """What the proposer reads from a sequence: a stable id and its append-only tokens."""

    seq_id: Hashable
    token_ids: list[int]  # prompt + output so far


_DIGIT = 32  # bits a token takes in an n-gram's key (token ids below 2^32 - 1)


def suffix_keys(tokens: Sequence[int], end: int, longest: int) -> list[int]:
    """Keys of the n-grams ending at tokens[end], n = 1..longest, shortest first.

    An n-gram's key is one int: token + 1 in one 32-bit digit per position, the newest
    lowest, so n-grams of any lengths have distinct keys (no digit is 0: a key has n
    digits). Each longer key is the shorter one with one digit more: a shift and an or
    where a tuple would be a slice and an allocation. Suffix decoding's own histories
    (suffix.py) key their n-grams the same way."""
    keys, key = [], 0
    for n in range(longest):
        key |= (tokens[end - n] + 1) << (_DIGIT * n)
        keys.append(key)
    return keys


class _SeqIndex:
    """n-gram key -> latest start position, over n-grams that end before the last token."""

    __slots__ = ("latest_start", "num_tokens")

    def __init__(self) -> None:
        self.latest_start: dict[int, int] = {}
        self.num_tokens = 0  # history length the index was last extended to

    def extend(self, tokens: list[int], min_n: int, max_n: int) -> None:
        """Index every n-gram that gained a following token since the last call."""
        # An n-gram ending at e has a follower once the history is longer than e + 1.
        # Earlier calls indexed ends up to num_tokens - 2; now index up to len - 2, in
        # increasing order so later occurrences overwrite earlier ones.
        latest = self.latest_start
        for end in range(max(self.num_tokens - 1, 0), len(tokens) - 1):
            for n, key in enumerate(suffix_keys(tokens, end, min(max_n, end + 1)), 1):
                if n >= min_n:
                    latest[key] = end - n + 1
        self.num_tokens = len(tokens)

    def lookup(self, tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
        """(start, n) of the most recent earlier occurrence of the longest suffix (its
        continuation begins at start + n); (0, 0) for none."""
        longest = min(max_n, len(tokens) - 1)
        keys = suffix_keys(tokens, len(tokens) - 1, longest)
        latest = self.latest_start
        for n in range(longest, min_n - 1, -1):
            start = latest.get(keys[n - 1])
            if start is not None:
                return start, n
        return 0, 0


class PythonIndex:
    """Every sequence's `_SeqIndex`, by id: the reference ngram_index.cpp matches, and the
    index where no C++ compiler is."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._seqs: dict[Hashable, _SeqIndex] = {}

    def spans(self, ids: Sequence[Hashable], histories: Sequence[list[int]],
              budgets: Sequence[int]) -> list[tuple[int, int]]:
        """Per row: extend sequence ids[i]'s index to histories[i] (a shorter history than
        the index has seen starts it over), then, where budgets[i] > 0, its `lookup`."""
        spans = []
        for seq_id, tokens, budget in zip(ids, histories, budgets):
            index = self._seqs.get(seq_id)
            if index is None or len(tokens) < index.num_tokens:
                index = self._seqs[seq_id] = _SeqIndex()
            index.extend(tokens, self.min_n, self.max_n)
            spans.append(index.lookup(tokens, self.min_n, self.max_n) if budget > 0 else (0, 0))
        return spans

    def forget(self, seq_id: Hashable) -> None:
        self._seqs.pop(seq_id, None)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs


class NativeIndex:
    """ngram_index.cpp's index behind `PythonIndex`'s interface: the C++ side numbers
    sequences, this side maps ids to those numbers."""

    def __init__(self, module, min_n: int, max_n: int):
        self._index = module.NgramIndex(min_n, max_n)
        self._handles: dict[Hashable, int] = {}

    def spans(self, ids: Sequence[Hashable], histories: Sequence[list[int]],
              budgets: Sequence[int]) -> list[tuple[int, int]]:
        handles = []
        for seq_id in ids:
            handle = self._handles.get(seq_id)
            if handle is None:
                handle = self._handles[seq_id] = self._index.add()
            handles.append(handle)
        return self._index.spans(handles, histories, budgets)

    def forget(self, seq_id: Hashable) -> None:
        handle = self._handles.pop(seq_id, None)
        if handle is not None:
            self._index.drop(handle)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._handles


_NATIVE = CppExtension("prompt lookup's C++ index", Path(__file__).with_name("ngram_index.cpp"),
                       "verispec_ngram", ["-O2"], fallback="the Python index (the same drafts)")


def make_index(min_n: int, max_n: int, native: bool | None = None):
    """The C++ index (built on first use) or the Python one: native None takes the C++ one
    if it builds, True requires it, False never builds it."""
    if native is not False:
        module = _NATIVE.load(required=bool(native))
        if module is not None:
            return NativeIndex(module, min_n, max_n)
    return PythonIndex(min_n, max_n)


class NgramProposer:
    """Prompt lookup (n-gram matching against the row's own history), a `Proposer`.

    `offer` looks every row up once, up to its budget; `draft` hands out the first k tokens
    of that lookup, so a round costs one lookup per row. `native`: as `make_index`, called
    here: prompt lookup is the default method's, so its C++ index is compiled (once per
    machine) while the engine starts, not in a first request's step.
    """

    name = "ngram"
    timed = False       # a hash lookup: microseconds, not a model pass
    has_probs = False   # deterministic drafts: one-hot q

    def __init__(self, max_n: int = 4, min_n: int = 1, native: bool | None = None):
        if not isinstance(min_n, int) or min_n < 1:
            raise ValueError(f"min_n must be an integer >= 1, got {min_n!r}")
        if not isinstance(max_n, int) or max_n < min_n:
            raise ValueError(f"max_n must be an integer >= min_n ({min_n}), got {max_n!r}")
        self.max_n = max_n
        self.min_n = min_n
        self.index: PythonIndex | NativeIndex = make_index(min_n, max_n, native)
        self._offered: dict[Hashable, list[int]] = {}  # this round's lookups, by request

    def offer(self, rows: Sequence, budgets: Sequence[int]) -> list[Offer]:
        """Each row's lookup up to its budget; the key is the matched suffix's length n, the
        best predictor of acceptance (longer matches are accepted far more often)."""
        if len(budgets) != len(rows):
            raise ValueError(f"ks must be one budget per row ({len(rows)}), got {len(budgets)}")
        histories = [r.all_ids for r in rows]
        spans = self.index.spans([r.request_id for r in rows], histories, budgets)
        offered, offers = {}, []
        for r, tokens, budget, (start, n) in zip(rows, histories, budgets, spans):
            drafts = tokens[start + n:start + n + budget] if n else []
            offered[r.request_id] = drafts
            offers.append(Offer(len(drafts), 0, n))
        self._offered = offered
        return offers

    def prepare(self, rows: Sequence) -> int:
        return 0

    def draft(self, rows: Sequence, ks: Sequence[int]) -> list[tuple[list[int], None]]:
        return [(self._offered.get(r.request_id, [])[:k], None) for r, k in zip(rows, ks)]

    def rollback(self, req) -> None:
        """Nothing to undo: the index only ever reads committed history."""

    def lookup_matches(self, histories: Sequence[TokenHistory], ks: Sequence[int]) -> list[tuple[list[int], int]]:
        """Up to ks[i] proposed tokens per history, each with the length n of the suffix it
        matched (0: none)."""
        if len(ks) != len(histories) or any(not isinstance(n, int) or n < 0 for n in ks):
            raise ValueError(f"ks must be one integer >= 0 per history ({len(histories)}), got {ks!r}")
        spans = self.index.spans([seq.seq_id for seq in histories], [seq.token_ids for seq in histories], ks)
        return [(seq.token_ids[start + n:start + n + k], n) if n else ([], 0)
                for seq, k, (start, n) in zip(histories, ks, spans)]

    def forget(self, seq_id: Hashable) -> None:
        """Drop a finished (or preempted) sequence's index; unknown ids are ignored."""
        self.index.forget(seq_id)
        self._offered.pop(seq_id, None)
