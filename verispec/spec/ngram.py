"""Prompt-lookup proposer: continue the sequence the way it continued last time.

For each row, take the longest suffix n-gram of the token history (n from max_n down to
min_n) that occurred earlier, and propose the (up to k) tokens that followed its most
recent earlier occurrence. It has no probabilities: the rejection sampler treats its
drafts as one-hot q, which is exact because the drafts are a deterministic function of
the history.

Each sequence keeps an index {n-gram: start of its latest occurrence that has a
following token}, extended with the tokens appended since the last call, so a step
costs O(new tokens * number of n), not a scan of the history.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

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

    def lookup(self, tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the most recent earlier match of the longest suffix,
        and that suffix's length n (0: no match)."""
        longest = min(max_n, len(tokens) - 1)
        keys = suffix_keys(tokens, len(tokens) - 1, longest)
        latest = self.latest_start
        for n in range(longest, min_n - 1, -1):
            start = latest.get(keys[n - 1])
            if start is not None:
                return tokens[start + n:start + n + k], n
        return [], 0


class NgramProposer:
    """Prompt lookup (n-gram matching against the row's own history), a `Proposer`.

    `offer` looks every row up once, up to its budget; `draft` hands out the first k tokens
    of that lookup, so a round costs one lookup per row.
    """

    name = "ngram"
    timed = False       # a dictionary lookup: microseconds, not a model pass
    has_probs = False   # deterministic drafts: one-hot q

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not isinstance(min_n, int) or min_n < 1:
            raise ValueError(f"min_n must be an integer >= 1, got {min_n!r}")
        if not isinstance(max_n, int) or max_n < min_n:
            raise ValueError(f"max_n must be an integer >= min_n ({min_n}), got {max_n!r}")
        self.max_n = max_n
        self.min_n = min_n
        self._indexes: dict[Hashable, _SeqIndex] = {}
        self._offered: dict[Hashable, list[int]] = {}  # this round's lookups, by request

    def offer(self, rows: Sequence, budgets: Sequence[int]) -> list[Offer]:
        """Each row's lookup up to its budget; the key is the matched suffix's length n, the
        best predictor of acceptance (longer matches are accepted far more often)."""
        if len(budgets) != len(rows):
            raise ValueError(f"ks must be one budget per row ({len(rows)}), got {len(budgets)}")
        offered, offers = {}, []
        for r, budget in zip(rows, budgets):
            tokens, n = self._propose_one(r.request_id, r.all_ids, budget)
            offered[r.request_id] = tokens
            offers.append(Offer(len(tokens), 0, n))
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
        return [self._propose_one(seq.seq_id, seq.token_ids, k) for seq, k in zip(histories, ks)]

    def forget(self, seq_id: Hashable) -> None:
        """Drop a finished (or preempted) sequence's index; unknown ids are ignored."""
        self._indexes.pop(seq_id, None)
        self._offered.pop(seq_id, None)

    def _propose_one(self, seq_id: Hashable, tokens: list[int], k: int) -> tuple[list[int], int]:
        index = self._indexes.get(seq_id)
        if index is None or len(tokens) < index.num_tokens:
            # New sequence, or its history shrank (recomputed after preemption): rebuild.
            index = self._indexes[seq_id] = _SeqIndex()
        index.extend(tokens, self.min_n, self.max_n)
        return index.lookup(tokens, self.min_n, self.max_n, k) if k > 0 else ([], 0)
