"""What a pass costs, measured: cells keyed by (rows, size), each the median of its recent
timings, and bounds for the cells not measured yet.

A verify cell is (batch rows, drafted tokens in the batch); a draft cell is (rows that
draft, draft depth). Sizes above 8 share buckets (10, 12, 16, 20, 24, 32, ...): a cell
per exact size would take too long to fill where they cost almost alike. A cell is
trusted once it holds `TRUSTED_AT` timings; its price is their median over the last
`WINDOW`, which ignores the odd stall of a shared machine and follows a drift in speed.

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

WINDOW = 16        # timings kept per cell: enough for a stable median, short enough to follow drift
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
    """Timings by (rows, size bucket); prices with bounds for untrusted cells. A cell's key
    holds its bucket's index in _BUCKETS, so `at` fills its per-bucket arrays without a search."""

    def __init__(self) -> None:
        self._timings: dict[tuple[int, int], deque] = {}
        self._trusted: dict[tuple[int, int], float] = {}   # cell -> median, once trusted

    def observe(self, rows: int, size: int, seconds: float) -> None:
        if rows < 1 or seconds < 0:
            raise ValueError(f"need rows >= 1 and seconds >= 0, got {rows}, {seconds}")
        cell = (rows, _bucket_index(size))
        timings = self._timings.setdefault(cell, deque(maxlen=WINDOW))
        timings.append(seconds)
        if len(timings) >= TRUSTED_AT:
            self._trusted[cell] = statistics.median(timings)

    def trusted(self, rows: int, size: int) -> float | None:
        return self._trusted.get((rows, _bucket_index(size)))

    def at(self, rows: int) -> "RowPrices":
        """Prices of every size at `rows`, built in one pass over the trusted cells."""
        n = len(_BUCKETS)
        own: list[float | None] = [None] * n
        upper: list[float | None] = [None] * n
        for (r, i), median in self._trusted.items():
            if r == rows:
                own[i] = median
            if r >= rows and (upper[i] is None or median < upper[i]):
                upper[i] = median
        for i in range(n - 2, -1, -1):  # no more than a costlier-or-equal bucket
            if upper[i + 1] is not None and (upper[i] is None or upper[i + 1] < upper[i]):
                upper[i] = upper[i + 1]
        return RowPrices(own, _exploring(own, upper))

    def snapshot(self) -> list[dict]:
        return [{"rows": r, "size": _BUCKETS[i], "median_s": round(m, 6), "n": len(self._timings[(r, i)])}
                for (r, i), m in sorted(self._trusted.items())]


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
