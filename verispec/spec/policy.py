"""The speculation policy: how many tokens each row drafts this round.

The engine makes two calls: `plan(rows) -> k per row` before drafting, and
`observe(report)` after the round, with what each row accepted and what the passes cost.

The decision maximises expected tokens per second for the whole batch. At batch 1 it is
argmax over k of E(alpha, k) / T(1, k). For a batch: the j-th draft of a row adds
alpha^j expected tokens (the chance its first j drafts are all accepted), so drafts are
handed out best marginal gain first across the rows, and the number handed out, N, is
the one with the highest rate

    (rows + sum of the gains handed out) / (T_verify(rows, N) + T_draft + catch-up charges)

T_verify is the round's measured time less the draft passes (scheduling, sampling and
bookkeeping grow with the batch too, and this policy's own time is in it); T_draft, for
a timed proposer (a draft model), the measured cost of its passes at (rows drafting,
depth). A row that must first catch up (a draft model's KV behind its history) is
charged that one-off cost spread over the rounds it has left. Rows whose request fixed
k (adaptive off) draft min(k, available) and are counted, not chosen for.

Costs not measured yet are priced as `costs.py` explores: one size past the largest
measured one at a time, sizes further out at their upper bound. Acceptance comes from
`acceptance.py`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NamedTuple

from verispec.spec.acceptance import AcceptanceModel, expected_tokens
from verispec.spec.costs import BUCKET_STARTS, CostCells, RowPrices, WindowedMedian, draft_share


# The most draft tokens a request may ask for: a verify row is 1 + k tokens, and past 16
# the chance that every draft is accepted is too small to pay for the pass.
MAX_SPEC_TOKENS = 16


class RowOffer(NamedTuple):
    """One decode row as the policy sees it (no model, no tensors). A tuple: the engine
    builds one per row per step."""

    request_id: str
    proposer: str | None    # None: the request does not speculate
    available: int          # drafts its proposer offers now (0: none)
    k_max: int              # the request's k (its cap when adaptive, its k when not)
    adaptive: bool = True
    catch_up: int = 0       # tokens a one-off pass must compute before it can draft
    key: int = 0            # acceptance class of the offer (n-gram: match length)
    remaining: int = 1      # tokens the request may still generate
    timed: bool = False     # its proposer's passes cost time (priced)


class RowResult(NamedTuple):
    request_id: str
    proposer: str
    key: int
    drafted: int
    accepted: int
    finished: bool = False  # the request ended this round: its own estimate is dropped


@dataclass(frozen=True)
class RoundReport:
    """What one decode round did and cost. verify_s is None for a round that also ran
    prefill chunks: its time says nothing about decode rows alone."""

    batch_size: int
    rows: list[RowResult]
    verify_s: float | None
    drafted: int                                 # draft tokens in the verify pass
    draft_passes: dict = field(default_factory=dict)  # proposer -> (rows, depth, seconds)
    catch_up: tuple[int, float] = (0, 0.0)       # (tokens, seconds) of one-off passes


class SpeculationPolicy:
    def __init__(self, k_max: int):
        self.k_max = k_max
        self.acceptance = AcceptanceModel()
        self.verify_costs = CostCells()
        self.draft_costs: dict[str, CostCells] = {}
        self.draft_shares: dict[str, WindowedMedian] = {}   # timed proposer -> its draft_share
        self.catch_up_cost = WindowedMedian()                # seconds per token of one-off passes
        self.rounds = 0
        self.k_counts = [0] * (k_max + 1)

    # ------------------------------------------------------------------ plan
    def better(self, current: RowOffer, other: RowOffer) -> RowOffer:
        """Of two proposers' offers for one row (method "auto"), the one whose next draft
        nets more tokens: the row's acceptance estimate less what a drafted token of a timed
        proposer costs, in rows of the verify pass (`costs.draft_share`; a lookup's costs nothing);
        then the longer; then `current`. Per position, not expected tokens at full length:
        the latter favours the longest offer, whose extra drafts cost verify time at a lower
        rate."""
        if not other.available:
            return current
        if not current.available:
            return other
        a, b = self._net_acceptance(current), self._net_acceptance(other)
        return other if (b, other.available) > (a, current.available) else current

    def _net_acceptance(self, offer: RowOffer) -> float:
        alpha = self.acceptance.alpha(offer.request_id, offer.proposer, offer.key)
        share = self.draft_shares.get(offer.proposer) if offer.timed else None
        return alpha - share.value() if share is not None else alpha

    def plan(self, rows: list[RowOffer]) -> list[int]:
        """k per row (0 <= k <= available), in the order given."""
        ks = [min(r.k_max, r.available) if not r.adaptive and r.proposer else 0 for r in rows]
        if not any(r.adaptive and r.proposer and r.available for r in rows):
            return ks  # nothing to choose: no prices needed
        verify = self.verify_costs.at(len(rows))
        largest = verify.largest_priced()  # no plan drafting more than this has a price
        gains = self._gains(rows, None if largest is None else largest - sum(ks))
        return self._best(rows, ks, gains, verify) if gains else ks

    def _gains(self, rows: list[RowOffer], limit: int | None = None) -> list[tuple[float, int]]:
        """(alpha^j, row) for the drafts adaptive rows may take, best first (ties in row
        order: the sort is stable), the best `limit` of them (None: all)."""
        if limit is not None and limit <= 0:
            return []
        gains = []
        for i, r in enumerate(rows):
            if r.adaptive and r.proposer and r.available:
                alpha = self.acceptance.alpha(r.request_id, r.proposer, r.key)
                gain = 1.0
                for _ in range(min(r.available, r.k_max, limit or r.k_max)):  # a row's best come first
                    gain *= alpha
                    gains.append((gain, i))
        gains.sort(key=itemgetter(0), reverse=True)
        return gains if limit is None else gains[:limit]

    def _best(self, rows: list[RowOffer], fixed: list[int], gains: list, verify: RowPrices) -> list[int]:
        """The ks with the best expected tokens per priced second (fixed ones if none is
        priced): the first n gains handed out, for the best n."""
        batch = len(rows)
        timed = any(r.timed for r in rows)
        draft_tables = {name: _DraftPrices(cells) for name, cells in self.draft_costs.items()} if timed else {}
        ks = list(fixed)
        tokens = batch + sum(self._fixed_gain(r, k) for r, k in zip(rows, fixed))
        drafted = sum(fixed)
        last = len(gains)
        best_rate, best_n = 0.0, 0  # nothing priced yet: plain measures the baseline cell
        for n in range(last + 1):
            if n:
                gain, i = gains[n - 1]
                ks[i] += 1
                tokens += gain
                drafted += 1
            if not timed and n < last and drafted + 1 not in BUCKET_STARTS:
                continue  # one more draft costs the same (same cell) and adds tokens: it wins
            seconds = self._price(rows, ks, verify, draft_tables) if timed else verify.price(drafted)
            if seconds is not None and seconds > 0 and tokens / seconds > best_rate:
                best_rate, best_n = tokens / seconds, n
        best = list(fixed)
        for _, i in gains[:best_n]:
            best[i] += 1
        return best

    def _fixed_gain(self, row: RowOffer, k: int) -> float:
        if not k:
            return 0.0
        return expected_tokens(self.acceptance.alpha(row.request_id, row.proposer, row.key), k) - 1.0

    def _price(self, rows: list[RowOffer], ks: list[int], verify, draft_tables) -> float | None:
        """Seconds of the round with these ks; None where a part has no price."""
        seconds = verify.price(sum(ks))
        if seconds is None:
            return None
        passes: dict[str, list[int]] = {}  # timed proposer -> [rows drafting, depth]
        for r, k in zip(rows, ks):
            if k and r.timed:
                p = passes.setdefault(r.proposer, [0, 0])
                p[0], p[1] = p[0] + 1, max(p[1], k)
                if r.catch_up:
                    rounds_left = max(1.0, r.remaining / expected_tokens(
                        self.acceptance.alpha(r.request_id, r.proposer, r.key), k))
                    seconds += r.catch_up * self.catch_up_cost.value() / rounds_left
        for name, (n_rows, depth) in passes.items():
            table = draft_tables.get(name)
            cost = table.price(n_rows, depth) if table else None
            if cost is None:  # never measured: a first pass of depth 1 is tried, as free
                if depth != 1:
                    return None
                cost = 0.0
            seconds += cost
        return seconds

    # ------------------------------------------------------------------ observe
    def observe(self, report: RoundReport) -> None:
        """Learn from a round: acceptance of every row that drafted, costs of its passes."""
        for row in report.rows:
            if row.drafted:
                self.acceptance.observe(row.request_id, row.proposer, row.key, row.drafted, row.accepted)
            if row.drafted <= self.k_max:
                self.k_counts[row.drafted] += 1
            if row.finished:
                self.acceptance.forget(row.request_id)
        tokens, seconds = report.catch_up
        if tokens > 0:
            self.catch_up_cost.add(seconds / tokens)
        for name, (n_rows, depth, seconds) in report.draft_passes.items():
            self.draft_costs.setdefault(name, CostCells()).observe(n_rows, depth, seconds)
            if report.verify_s and n_rows and depth:  # a decode-only round: its verify pass is known
                self.draft_shares.setdefault(name, WindowedMedian()).add(
                    draft_share(n_rows, depth, seconds, report.batch_size, report.verify_s))
        if report.verify_s is not None:
            self.verify_costs.observe(report.batch_size, report.drafted, report.verify_s)
        self.rounds += 1

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)

    def snapshot(self) -> dict:
        return {"rounds": self.rounds, "k_counts": list(self.k_counts),
                "alpha_pools": self.acceptance.snapshot(), "verify_cells": self.verify_costs.snapshot(),
                "draft_cells": {n: c.snapshot() for n, c in self.draft_costs.items()},
                "draft_shares": {n: round(share.value(), 4) for n, share in self.draft_shares.items()}}


class _DraftPrices:
    """A timed proposer's pass prices for this plan, one row count's table at a time."""

    def __init__(self, cells: CostCells):
        self._cells, self._tables = cells, {}

    def price(self, rows: int, depth: int) -> float | None:
        table = self._tables.get(rows)
        if table is None:
            table = self._tables[rows] = self._cells.at(rows)
        return table.price(depth)


class RoundTimer:
    """Seconds of a round's phases, taken with one clock: `lap(name)` closes the phase
    that began at the previous lap (or at construction)."""

    def __init__(self) -> None:
        self.start = self._mark = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        return seconds

    def total(self) -> float:
        return time.perf_counter() - self.start
