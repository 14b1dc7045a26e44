"""What a pass costs, measured: per row count a level (what its passes cost now) and per
cell its cost relative to that level, with bounds for the cells not measured yet.

A verify cell is (batch rows, drafted tokens in the batch); a draft cell is (rows that
draft, draft depth). Sizes above 8 share buckets (10, 12, 16, 20, 24, 32, ...): a cell
per exact size would take too long to fill where they cost almost alike. A cell is
trusted once it holds `TRUSTED_AT` timings.

Why a level: a pass's time drifts with the machine and with its rows' context (a batch's
round costs more at the end of its answers than at the start), alike for every size.
Priced by each cell's own recent timings, a cell played now was compared with one played
long ago: the plain cell went stale while drafting was chosen, and drafts where a pass
is bound by compute were priced well below their cost. So a timing feeds its row count's
level (the timing over its cell's relative cost: what a reference pass would have cost;
the median of the last LEVEL_WINDOW, which ignores a stall) and its cell's relative cost
(the timing over the level; the median of the cell's last WINDOW). A cell's price is
level x relative cost. The two cannot be told apart from one cell alone: while a row
count has played only one trusted cell for LEVEL_WINDOW rounds, that cell's relative
cost stays as it was and the level follows it. A row count's first cell is its reference
(relative cost 1).

Cells without trusted timings are priced so that exploring widens one step at a time
from what is measured. At a given row count: a size between two trusted cells at their
chord (a lower bound where cost grows concavely with tokens, as a weight-streaming pass
does); the next bucket past the largest trusted one at that cell's cost plus
EXPLORE_SLOPE of the last measured cost per token, so widening stops where even half the
last increment no longer pays; sizes further out at their upper bound (a pass costs no
less with more rows or tokens: the cheapest trusted cell with no fewer of either), so a
plan there is played only if it pays at its worst (a drained batch still drafts).
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque

WINDOW = 16        # relative costs kept per cell: a stable median; what a cell costs relative moves slowly
LEVEL_WINDOW = 8   # rounds per level: the median of 8 rejects a stall and follows a drift within ~4
TRUSTED_AT = 3     # a median of three already rejects one stall
EXPLORE_SLOPE = 0.5  # the next size is tried if it pays at half the last cost per token
_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)
BUCKET_STARTS = frozenset(_BUCKETS[1:])   # sizes priced apart from the size below them


def size_bucket(size: int) -> int:
    """The largest bucket boundary <= size (sizes past the last share it)."""
    return _BUCKETS[_bucket_index(size)]


def _bucket_index(size: int) -> int:
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    return bisect.bisect_right(_BUCKETS, size) - 1


class CostCells:
    """Relative costs by (rows, size bucket) and a level per row count; prices with bounds for
    untrusted cells. A cell's key holds its bucket's index in _BUCKETS, so `at` fills its
    per-bucket arrays without a search."""

    def __init__(self) -> None:
        self._relative: dict[tuple[int, int], deque] = {}
        self._trusted: dict[tuple[int, int], float] = {}   # cell -> median relative cost, once trusted
        # rows -> its last rounds as (bucket, what a reference pass would have cost, cell trusted)
        self._recent: dict[int, deque] = {}
        self._level: dict[int, float] = {}    # rows -> the median of those

    def observe(self, rows: int, size: int, seconds: float) -> None:
        if rows < 1 or seconds < 0:
            raise ValueError(f"need rows >= 1 and seconds >= 0, got {rows}, {seconds}")
        i = _bucket_index(size)
        cell, level = (rows, i), self._level.get(rows)
        recent = self._recent.setdefault(rows, deque(maxlen=LEVEL_WINDOW))
        relative = self._relative.setdefault(cell, deque(maxlen=WINDOW))
        if not level:   # the row count's first timing (or only zero ones): its reference
            relative.append(1.0)
        elif cell not in self._trusted or _anchored_apart(recent, i):
            relative.append(seconds / level)
        if len(relative) >= TRUSTED_AT:
            self._trusted[cell] = statistics.median(relative)
        rel = self._trusted.get(cell)
        # an untrusted cell cannot say what a reference pass costs: the level stays (the first timing starts it)
        reference = seconds / rel if rel else level or seconds
        recent.append((i, reference, rel is not None))
        self._level[rows] = statistics.median([s for _, s, _ in recent])

    def trusted(self, rows: int, size: int) -> float | None:
        rel = self._trusted.get((rows, _bucket_index(size)))
        return None if rel is None else rel * self._level[rows]

    def at(self, rows: int) -> "RowPrices":
        """Prices of every size at `rows`, built in one pass over the trusted cells."""
        n = len(_BUCKETS)
        own: list[float | None] = [None] * n
        upper: list[float | None] = [None] * n
        level = self._level
        for (r, i), rel in self._trusted.items():
            if r >= rows:
                price = rel * level[r]
                if r == rows:
                    own[i] = price
                if upper[i] is None or price < upper[i]:
                    upper[i] = price
        for i in range(n - 2, -1, -1):  # no more than a costlier-or-equal bucket
            if upper[i + 1] is not None and (upper[i] is None or upper[i + 1] < upper[i]):
                upper[i] = upper[i + 1]
        return RowPrices(own, _exploring(own, upper))

    def snapshot(self) -> list[dict]:
        return [{"rows": r, "size": _BUCKETS[i], "median_s": round(rel * self._level[r], 6),
                 "n": len(self._relative[(r, i)])} for (r, i), rel in sorted(self._trusted.items())]


def _anchored_apart(recent: deque, bucket: int) -> bool:
    """Whether a trusted cell other than `bucket` set part of the level: only then does a
    timing of `bucket` say what it costs relative to the others."""
    return any(b != bucket and trusted for b, _, trusted in recent)


def _exploring(own: list, upper: list) -> list:
    """Upper bounds, with the chords between trusted cells and one step past the last."""
    bound = list(upper)
    known = [i for i, m in enumerate(own) if m is not None]
    for a, b in zip(known, known[1:]):
        for i in range(a + 1, b):
            share = (_BUCKETS[i] - _BUCKETS[a]) / (_BUCKETS[b] - _BUCKETS[a])
            bound[i] = own[a] + share * (own[b] - own[a])
    if known and known[-1] + 1 < len(own):
        last = known[-1]
        slope = 0.0
        if len(known) > 1:
            prev = known[-2]
            slope = max(0.0, (own[last] - own[prev]) / (_BUCKETS[last] - _BUCKETS[prev]))
        bound[last + 1] = own[last] + EXPLORE_SLOPE * slope * (_BUCKETS[last + 1] - _BUCKETS[last])
    return bound


class RowPrices:
    """price(size) -> seconds: the cell's median when trusted, else its exploring price
    (`_exploring`); None when there is none."""

    __slots__ = ("_own", "_bound")

    def __init__(self, own: list, bound: list):
        self._own, self._bound = own, bound

    def price(self, size: int) -> float | None:
        i = _bucket_index(size)
        median = self._own[i]
        return median if median is not None else self._bound[i]

    def largest_priced(self) -> int | None:
        """The largest size with a price (-1: none; None: every size has one)."""
        for i in range(len(_BUCKETS) - 1, -1, -1):
            if self._own[i] is not None or self._bound[i] is not None:
                return None if i == len(_BUCKETS) - 1 else _BUCKETS[i + 1] - 1
        return -1


class WindowedMedian:
    """The median of the last WINDOW values; 0 before any: optimistic, as an unmeasured cost
    cell is priced, so the first use measures it. The policy keeps two: a draft model's
    catch-up seconds per token, and each timed proposer's `draft_share`."""

    def __init__(self) -> None:
        self._values: deque = deque(maxlen=WINDOW)

    def add(self, value: float) -> None:
        self._values.append(value)

    def value(self) -> float:
        return statistics.median(self._values) if self._values else 0.0


def draft_share(rows: int, depth: int, seconds: float, batch: int, verify_s: float) -> float:
    """What one drafted token of a timed proposer cost, in rows of the verify pass: its
    pass's seconds per (row, depth) over the verify pass's seconds per row (a head whose
    pass is 5% of a one-row step: ~0.05)."""
    return (seconds / (rows * depth)) / (verify_s / batch)
