"""Adaptive draft length: pick k per request from online acceptance and measured cost.

Pure Python (no torch, no model code), so it is unit-tested alone by simulation.

Terms
-----
k            draft tokens asked of the proposer for one row in one round; k = 0 is plain
             decoding (one target token, no proposer call).
width        tokens per row in the target's verify pass, k + 1 (the last committed token
             plus k drafts). A round commits the accepted draft prefix plus one target token
             (recovered or bonus), so a round yields between 1 and k + 1 tokens.
alpha        per-position acceptance: the probability that a draft position is accepted
             given that all earlier ones were (the geometric model of Leviathan et al.).
rate         committed tokens per second. With E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)
             expected tokens per round and T(B, k) the seconds of one round at batch size B,
             a row's rate at k is E(alpha, k) / T(B, k).

Acceptance estimate (per request, decaying per token)
-----------------------------------------------------
A round that drafted d tokens and accepted the first a of them observed a acceptances and,
if a < d, one rejection at position a + 1. Positions a + 2 .. d were never tested: they are
censored, not rejected. The round's likelihood is alpha^a (1 - alpha)^[a < d], so the
sufficient statistics are s = a successes over n = a + [a < d] trials, and the maximum
likelihood estimate over rounds is sum(s) / sum(n). Whether a position is tested depends
only on earlier outcomes (a stopping rule), so every tested position is a Bernoulli(alpha)
draw given the past: E[sum(s)] = alpha * E[sum(n)] (Wald), the estimating equation
sum(s) - alpha * sum(n) has mean zero, and the estimate is consistent with bias
O(1 / window). Two tempting alternatives are biased:
  * accepted / drafted counts censored positions as rejections and reads low
    (alpha = 0.9, d = 8 gives E[a] / d = 0.64);
  * an EWMA of each round's ratio s / n, one step per round, is biased (E[s / n] != alpha
    when d > 1) and its window is a number of rounds, so it shrinks to a handful of tokens
    whenever k collapses to 1 -- the estimate turns noisy exactly when k is small and the
    controller oscillates.
So the sums decay per tested position: each trial multiplies the old weight by
2 ** (-1 / alpha_half_life_tokens), and the window is the same number of tokens whatever k
is. A round with n trials decays the old sums by that factor ** n and adds (s, n) at
equal weight (the order of outcomes inside a round carries no information).

A round with drafted = 0 (k = 0, or n-gram found no match) tested nothing: it adds no
trial, and in particular no rejection. But a request parked at k = 0 learns nothing, so it
would never notice its acceptance rising (measured: on a workload alternating between
alpha 0.9 and 0.35 the controller then gains 2% over the best fixed k instead of 11%). So an untested round
counts as a chance, 1 - 2 ** (-1 / idle_half_life_rounds), that the request's acceptance
has changed to a draw from its proposer's global estimate: the estimate moves that fraction
toward the global one, and its weight toward `prior_weight_tokens`. A parked request so
drifts toward what the workload shows and eventually drafts again; if its acceptance is
still low, that round's evidence sends it back. The controller notices untested rounds
itself: a request passed to choose_k that reports no drafted position before its next
choose_k (k = 0, no n-gram match, k clamped by the engine) gets one such step, whether or
not the engine reports drafted = 0 (which is accepted and records nothing).

Each request starts from its proposer's global estimate, worth `prior_weight_tokens`
trials, and every observation also feeds that global estimate (with a longer half-life), so
new requests start from what the workload has shown rather than from a constant.

Coverage (how often a row gets the drafts it asks for)
------------------------------------------------------
A proposer may return fewer drafts than asked: n-gram lookup finds no match in most rounds
of open chat. Acceptance says nothing about that (an empty round tests nothing), yet the
batch pays the wide verify pass as soon as any row drafts. So each request also keeps its
coverage c = drafted / asked, averaged over rounds that asked for k > 0 (decaying per round,
half-life `coverage_half_life_rounds`, starting from the proposer's global coverage, which
itself starts at 1: optimistic, so drafting is tried before it is written off). A row's
expected yield at k is then 1 + c * (E(alpha, k) - 1). A round that asks for nothing
(k = 0) says nothing about coverage, so, as for acceptance, it counts as a chance
1 - 2 ** (-1 / idle_half_life_rounds) that coverage changed to what the workload shows
(the proposer's global coverage): a request parked at k = 0 after a stretch without
matches (an answer's preamble before it starts quoting the prompt) drafts again later,
instead of never asking again. Without it the controller kept
k > 0 on chat at batch 16 and ran at 0.72x plain decoding (measured, bench/adaptive.py).

Costs (measured, never assumed)
-------------------------------
The engine reports the seconds of every decode round (keyed by batch size and width): the
whole step but the draft pass, so scheduling, n-gram lookup, sampling and bookkeeping,
which grow with the width too, are priced with the verify forward (timing the forward
alone made k > 0 look cheaper than it is at batch 16); and of every draft pass (keyed by
batch size and k). Batch sizes are bucketed to the next power of
two; each (bucket, width) cell is a running mean for its first 1 / cost_ewma samples and
an EWMA after that, so it tracks drift. The plain-decoding pass (width 1) is a cell like
any other. An unmeasured cell is estimated from the measured ones
as the tightest lower bound implied by two physical assumptions: cost never falls when the
batch or the width grows, and cost per row or per token never grows with them (a fixed
overhead plus at most linear work). For a measured cell (b', w') with cost c that gives
    cost(b, w) >= c * min(1, b / b') * min(1, w / w'),
and the estimate is the largest such bound. It interpolates in width (flat from a narrower
measured pass, proportional from a wider one) and scales from neighbouring batch buckets.
Because the estimate is never above the truth it is optimistic, and optimism is the
exploration: an unmeasured k is tried exactly when even its optimistic rate beats the best
known one, and is measured by that round. A pessimistic guess (e.g. a chord across a flat
region) could keep the optimal k from ever being tried. With nothing measured at all the
controller plays fixed_k (the engine times verify passes only in steps without prefill, so
this can last a few steps); the plain pass (width 1) is then tried and measured because its
bound, proportional from the wider pass, is optimistic. Because EWMA only moves cells
that are visited, a small deterministic schedule (a fraction `explore` of rounds) also
re-measures the neighbour of the current width that was measured longest ago, when its
estimated rate is within `explore_within` of the best (a far-behind neighbour is not worth a
round at its price; if acceptance rises, the estimates bring it back into play anyway).

The batch (one verify pass serves every row)
--------------------------------------------
All rows of a step share one verify pass (and one draft pass), and its cost is keyed by
the batch size and the width. The controller therefore picks one common k per step:
    k = argmax_k  sum_r E(alpha_r, k) / T(B, k),
where T(B, k) is the measured verify seconds at width k + 1 plus the draft seconds for k
(charged when any row drafts with a draft model, i.e. a proposer other than n-gram).
Why common, and not a k per row:
  * the cost key is then exact: the cell (B, k + 1) is precisely the work of the pass
    whether the runner pads rows to the widest or packs them ragged; with different k per
    row, one cell would mix passes of different total work;
  * under a pass priced by its widest row, giving any row less than the widest k saves
    nothing, so a per-row choice can only lose (measured in simulation: each row's own
    noisy estimate picks a different k, and all pay for the widest);
  * the sum pools the rows' evidence: a batch of alike requests decides on the average of
    their estimates, which is less noisy than any one of them.
Per-request estimates still matter: they weight the sum, so a batch of mostly
low-acceptance requests drafts less, and a lone request gets exactly its own optimum.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# Proposers whose drafting is a CPU lookup: no draft pass, no draft cost.
FREE_DRAFT_PROPOSERS = frozenset({"ngram"})
COST_KINDS = ("verify", "draft")
_MIN_SECONDS = 1e-12  # guards a rate against a measured 0 s (coarse timers)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected committed tokens of a round drafting k tokens: (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    # The sum 1 + alpha + ... + alpha^k is exact at alpha = 1, where the closed form is 0/0.
    return sum(alpha ** i for i in range(k + 1))


def batch_bucket(batch_size: int) -> int:
    """The power-of-two bucket (next power of two >= batch_size) that costs are keyed by."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


@dataclass(frozen=True)
class ControllerConfig:
    """How the draft length is chosen. Built once, never mutated."""

    k_max: int = 8                     # largest k ever chosen
    adaptive: bool = True              # False: every row drafts fixed_k
    fixed_k: int = 4
    # Starting per-position acceptance per proposer name; the keys are the allowed proposers.
    prior_alpha: dict[str, float] = field(
        default_factory=lambda: {"ngram": 0.5, "draft": 0.7}, hash=False)
    alpha_half_life_tokens: float = 20.0   # per-request window, in tested draft positions
    prior_weight_tokens: float = 8.0       # trials a new request's prior is worth
    prior_half_life_tokens: float = 1024.0 # window of the per-proposer global estimate
    idle_half_life_rounds: float = 32.0    # untested rounds for a request to forget halfway
    coverage_half_life_rounds: float = 16.0  # per-request window of drafted / asked
    cost_ewma: float = 0.1                 # weight of a new timing in its cell's EWMA
    explore: float = 0.03                  # fraction of rounds that re-measure a neighbour k
    explore_within: float = 0.15           # ... if its estimated rate is within this of the best

    def __post_init__(self):
        # Copy so a caller mutating its dict cannot change a built config.
        object.__setattr__(self, "prior_alpha", dict(self.prior_alpha))
        if not isinstance(self.k_max, int) or not 0 <= self.k_max <= 64:
            raise ValueError(f"k_max must be an int in [0, 64], got {self.k_max!r}")
        if not isinstance(self.fixed_k, int) or not 0 <= self.fixed_k <= self.k_max:
            raise ValueError(f"fixed_k must be an int in [0, k_max={self.k_max}], got {self.fixed_k!r}")
        if not self.prior_alpha:
            raise ValueError("prior_alpha must name at least one proposer")
        for name, a in self.prior_alpha.items():
            if not 0.0 <= a < 1.0:
                raise ValueError(f"prior_alpha[{name!r}] must be in [0, 1), got {a}")
        for name in ("alpha_half_life_tokens", "prior_weight_tokens", "prior_half_life_tokens",
                     "idle_half_life_rounds", "coverage_half_life_rounds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 < self.cost_ewma <= 1.0:
            raise ValueError(f"cost_ewma must be in (0, 1], got {self.cost_ewma}")
        if not 0.0 <= self.explore < 1.0:
            raise ValueError(f"explore must be in [0, 1), got {self.explore}")
        if not 0.0 <= self.explore_within <= 1.0:
            raise ValueError(f"explore_within must be in [0, 1], got {self.explore_within}")

    def to_dict(self) -> dict:
        """Plain data, recorded next to benchmark results."""
        return asdict(self)


class AcceptanceEstimator:
    """Decayed maximum-likelihood estimate of per-position acceptance (see module docstring)."""

    def __init__(self, prior_alpha: float, prior_weight: float, half_life_tokens: float):
        self._decay = 0.5 ** (1.0 / half_life_tokens)  # per tested position
        self.successes = prior_alpha * prior_weight
        self.trials = prior_weight
        self.observed_tokens = 0  # tested positions seen, undecayed (for logs)

    def observe(self, drafted: int, accepted: int) -> None:
        """Fold in one round: `accepted` of `drafted` accepted, then one rejection if short."""
        trials = accepted + (1 if accepted < drafted else 0)
        if trials == 0:
            return  # nothing drafted, nothing tested
        keep = self._decay ** trials
        self.successes = self.successes * keep + accepted
        self.trials = self.trials * keep + trials
        self.observed_tokens += trials

    def relax(self, prior_alpha: float, prior_weight: float, keep: float) -> None:
        """One untested round: with probability 1 - keep acceptance changed to a prior draw."""
        value = keep * self.value + (1.0 - keep) * prior_alpha
        self.trials = keep * self.trials + (1.0 - keep) * prior_weight
        self.successes = value * self.trials

    @property
    def value(self) -> float:
        """The estimate: decayed successes over decayed trials."""
        return self.successes / self.trials


class Coverage:
    """Decayed mean of drafted / asked over rounds that asked for drafts (see module docstring).

    The prior counts as `prior_weight` rounds, so the first observed rounds dominate it: an
    EWMA from an optimistic 1.0 needed ~20 rounds at k > 0 to learn that chat rows rarely
    get n-gram drafts, each of them a wide verify pass for the whole batch (measured).
    """

    def __init__(self, prior: float, half_life_rounds: float, prior_weight: float = 2.0):
        self._decay = 0.5 ** (1.0 / half_life_rounds)
        self._prior_weight = prior_weight
        self._sum, self._weight = prior * prior_weight, prior_weight

    def observe(self, asked: int, drafted: int) -> None:
        self._sum = self._sum * self._decay + drafted / asked
        self._weight = self._weight * self._decay + 1.0

    def relax(self, target: float, keep: float) -> None:
        """A round that asked nothing: with probability 1 - keep coverage changed to `target`."""
        value = keep * self.value + (1.0 - keep) * target
        self._weight = keep * self._weight + (1.0 - keep) * self._prior_weight
        self._sum = value * self._weight

    @property
    def value(self) -> float:
        return self._sum / self._weight


class CostTable:
    """EWMA seconds of one pass kind per (batch bucket, width), with optimistic estimates."""

    def __init__(self, ewma: float):
        self._ewma = ewma
        self._cells: dict[tuple[int, int], list] = {}  # (bucket, width) -> [seconds, stamp, n]

    def observe(self, batch_size: int, width: int, seconds: float, stamp: int) -> None:
        """Fold one measured pass into its cell."""
        key = (batch_bucket(batch_size), width)
        cell = self._cells.get(key)
        if cell is None:
            self._cells[key] = [seconds, stamp, 1]
            return
        cell[2] += 1
        # A plain mean until the cell has 1 / ewma samples, so one noisy first timing is
        # not left standing for long; an EWMA after that, so the cell tracks drift.
        cell[0] += max(self._ewma, 1.0 / cell[2]) * (seconds - cell[0])
        cell[1] = stamp

    def stamp(self, bucket: int, width: int) -> int:
        """When the cell was last measured (-1: never)."""
        cell = self._cells.get((bucket, width))
        return -1 if cell is None else cell[1]

    def estimate(self, bucket: int, width: int) -> float | None:
        """Measured EWMA, else the largest lower bound from measured cells, else None."""
        cell = self._cells.get((bucket, width))
        if cell is not None:
            return cell[0]
        best = None
        for (b, w), (seconds, _, _) in self._cells.items():
            bound = seconds * min(1.0, bucket / b) * min(1.0, width / w)
            if best is None or bound > best:
                best = bound
        return best

    def snapshot(self) -> list[dict]:
        """Measured cells as plain data."""
        return [{"batch_bucket": b, "tokens_per_row": w, "seconds": s, "samples": n}
                for (b, w), (s, _, n) in sorted(self._cells.items())]


@dataclass
class _Request:
    proposer: str
    estimator: AcceptanceEstimator
    coverage: Coverage
    awaiting_test: bool = False  # chosen for a round that has not reported a tested position
    asked: bool = False          # reported a round that asked for drafts since the last choose_k


class AdaptiveController:
    """Chooses k per request each engine step; observes acceptance and measured pass times."""

    estimator_cls = AcceptanceEstimator

    def __init__(self, config: ControllerConfig | None = None):
        self.config = config if config is not None else ControllerConfig()
        cfg = self.config
        self._requests: dict[str, _Request] = {}
        self._global = {p: self.estimator_cls(a, cfg.prior_weight_tokens, cfg.prior_half_life_tokens)
                        for p, a in cfg.prior_alpha.items()}
        # Per-proposer coverage new requests start from: a longer window, starting at 1.
        self._global_coverage = {p: Coverage(1.0, 8 * cfg.coverage_half_life_rounds) for p in cfg.prior_alpha}
        self._costs = {kind: CostTable(cfg.cost_ewma) for kind in COST_KINDS}
        self._num_cost_samples = 0
        self._rounds = 0
        self._probes = 0
        self._k_counts = [0] * (cfg.k_max + 1)

    expected_tokens = staticmethod(expected_tokens)

    # ---- request lifecycle -------------------------------------------------------------

    def start(self, request_id: str, proposer: str) -> None:
        """Begin tracking a request; its acceptance starts from the proposer's global estimate."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already started")
        if proposer not in self._global:
            raise ValueError(f"proposer must be one of {sorted(self._global)}, got {proposer!r}")
        cfg = self.config
        prior = self._global[proposer].value
        est = self.estimator_cls(prior, cfg.prior_weight_tokens, cfg.alpha_half_life_tokens)
        coverage = Coverage(self._global_coverage[proposer].value, cfg.coverage_half_life_rounds)
        self._requests[request_id] = _Request(proposer, est, coverage)

    def finish(self, request_id: str) -> None:
        """Stop tracking a request (finished or aborted)."""
        self._request(request_id)
        del self._requests[request_id]

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id {request_id!r} was not started (or already finished)")
        return req

    # ---- observations ------------------------------------------------------------------

    def observe_acceptance(self, request_id: str, drafted: int, accepted: int, asked: int | None = None) -> None:
        """Record one verify round of a request.

        drafted: draft tokens actually proposed and verified for this row (may be fewer than
            the k asked, e.g. 0 when n-gram found no match: no trial, no rejection, and
            reporting it is optional).
        accepted: length of the accepted prefix of those drafts, as the rejection sampler
            decided it (before any stop-string truncation), 0 <= accepted <= drafted.
        asked: the k the proposer was asked for (>= drafted); updates the coverage. None:
            coverage unknown for this round (left as it is).
        """
        if not isinstance(drafted, int) or drafted < 0:
            raise ValueError(f"drafted must be an int >= 0, got {drafted!r}")
        if not isinstance(accepted, int) or not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be an int in [0, drafted={drafted}], got {accepted!r}")
        if asked is not None and (not isinstance(asked, int) or asked < max(drafted, 1)):
            raise ValueError(f"asked must be an int >= max(drafted={drafted}, 1), got {asked!r}")
        req = self._request(request_id)
        if asked is not None:
            req.asked = True
            req.coverage.observe(asked, drafted)
            self._global_coverage[req.proposer].observe(asked, drafted)
        if drafted == 0:
            return  # nothing tested; choose_k relaxes the estimate if the round stays untested
        req.awaiting_test = False
        req.estimator.observe(drafted, accepted)
        self._global[req.proposer].observe(drafted, accepted)

    def observe_cost(self, kind: str, batch_size: int, tokens_per_row: int, seconds: float) -> None:
        """Record the measured seconds of one steady-state pass (exclude warm-up/compile).

        kind "verify": the target pass; tokens_per_row = the widest row's k + 1 (1 = plain).
        kind "draft": the draft model's whole drafting of one round; tokens_per_row = the
            largest k drafted. Not reported for n-gram, whose drafting is free.
        batch_size: rows in that pass.
        """
        if kind not in COST_KINDS:
            raise ValueError(f"kind must be one of {COST_KINDS}, got {kind!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(tokens_per_row, int) or tokens_per_row < 1:
            raise ValueError(f"tokens_per_row must be an int >= 1, got {tokens_per_row!r}")
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        self._num_cost_samples += 1
        self._costs[kind].observe(batch_size, tokens_per_row, seconds, self._num_cost_samples)

    # ---- estimates ---------------------------------------------------------------------

    def alpha(self, request_id: str) -> float:
        """Current per-position acceptance estimate of a request."""
        return self._request(request_id).estimator.value

    def estimated_cost(self, kind: str, batch_size: int, tokens_per_row: int) -> float | None:
        """Seconds of one pass: measured EWMA, else an optimistic bound; None if none measured."""
        if kind not in COST_KINDS:
            raise ValueError(f"kind must be one of {COST_KINDS}, got {kind!r}")
        return self._costs[kind].estimate(batch_bucket(batch_size), tokens_per_row)

    def _round_costs(self, batch_size: int) -> tuple[list[float], list[float]] | None:
        """(verify seconds, draft seconds) per k in [0, k_max]; None when nothing is measured."""
        ks = range(self.config.k_max + 1)
        verify = [self.estimated_cost("verify", batch_size, k + 1) for k in ks]
        if verify[0] is None:
            return None
        # No draft pass measured yet: count drafting as free (optimistic) until one is.
        draft = [0.0] + [self.estimated_cost("draft", batch_size, k) or 0.0 for k in ks[1:]]
        return verify, draft

    # ---- decisions ---------------------------------------------------------------------

    def choose_k(self, request_ids: list[str], batch_size: int) -> dict[str, int]:
        """k in [0, k_max] for each request of this step's batch. Call once per engine step."""
        if not isinstance(batch_size, int) or batch_size < max(1, len(request_ids)):
            raise ValueError(
                f"batch_size must be an int >= max(1, len(request_ids)={len(request_ids)}), "
                f"got {batch_size!r}")
        reqs = [self._request(r) for r in request_ids]
        if not reqs:
            return {}
        keep = 0.5 ** (1.0 / self.config.idle_half_life_rounds)
        for req in reqs:
            if req.awaiting_test:
                self._relax_untested(req)
            if not req.asked:  # parked at k = 0: matches may have appeared since
                req.coverage.relax(self._global_coverage[req.proposer].value, keep)
            req.awaiting_test, req.asked = True, False
        if not self.config.adaptive:
            ks = [self.config.fixed_k] * len(reqs)
        else:
            ks = self._adaptive_ks(reqs, batch_size)
        for k in ks:
            self._k_counts[k] += 1
        return dict(zip(request_ids, ks))

    def _relax_untested(self, req: _Request) -> None:
        """The request's last round tested nothing: its acceptance may have changed since."""
        keep = 0.5 ** (1.0 / self.config.idle_half_life_rounds)
        req.estimator.relax(self._global[req.proposer].value, self.config.prior_weight_tokens, keep)

    def _adaptive_ks(self, reqs: list[_Request], batch_size: int) -> list[int]:
        """One common k maximising the batch's expected tokens per measured second."""
        self._rounds += 1
        costs = self._round_costs(batch_size)
        if costs is None:
            return [self.config.fixed_k] * len(reqs)  # nothing measured yet
        verify, draft = costs
        runs_draft_model = any(r.proposer not in FREE_DRAFT_PROPOSERS for r in reqs)
        if not runs_draft_model:
            draft = [0.0] * len(draft)
        rows = [self._expected_row(r) for r in reqs]
        tokens = [sum(e[k] for e in rows) for k in range(self.config.k_max + 1)]
        k = _best_k(tokens, verify, draft)
        if self._probe_due():
            probe = self._probe_k(k, batch_size)
            # Only a neighbour that could plausibly win is worth a round at its price: at
            # batch 16 a k = 1 pass costs 2x a plain one, and probing it when it is far
            # behind was a steady few percent lost (bench/adaptive.py, chat).
            if probe is not None and _rate(tokens[probe], verify[probe] + draft[probe]) >= \
                    (1.0 - self.config.explore_within) * _rate(tokens[k], verify[k] + draft[k]):
                self._probes += 1
                k = probe
        return [k] * len(reqs)

    def _expected_row(self, req: _Request) -> list[float]:
        """1 + c (E(alpha, k) - 1) for k in [0, k_max] at the request's current estimates."""
        a = min(max(req.estimator.value, 0.0), 1.0)
        c = min(max(req.coverage.value, 0.0), 1.0)
        out, term = [], 1.0
        for _ in range(self.config.k_max + 1):
            out.append((out[-1] if out else 0.0) + term)
            term *= a
        return [1.0 + c * (e - 1.0) for e in out]

    def coverage(self, request_id: str) -> float:
        """Current estimate of the fraction of asked drafts the request's proposer delivers."""
        return self._request(request_id).coverage.value

    def _probe_due(self) -> bool:
        """Deterministic: true on a fraction `explore` of rounds, evenly spread."""
        e = self.config.explore
        return math.floor(self._rounds * e) > math.floor((self._rounds - 1) * e)

    def _probe_k(self, k: int, batch_size: int) -> int | None:
        """The neighbour of k whose verify cell was measured longest ago (None if no neighbour)."""
        bucket = batch_bucket(batch_size)
        table = self._costs["verify"]
        nbrs = [n for n in (k - 1, k + 1) if 0 <= n <= self.config.k_max]
        return min(nbrs, key=lambda n: table.stamp(bucket, n + 1)) if nbrs else None

    # ---- logs --------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Plain-data state for logs and metrics."""
        return {
            "config": self.config.to_dict(),
            "rounds": self._rounds,
            "probes": self._probes,
            "k_counts": list(self._k_counts),
            "global_alpha": {p: e.value for p, e in self._global.items()},
            "global_coverage": {p: c.value for p, c in self._global_coverage.items()},
            "requests": {rid: {"proposer": r.proposer, "alpha": r.estimator.value, "coverage": r.coverage.value,
                               "observed_tokens": r.estimator.observed_tokens}
                         for rid, r in self._requests.items()},
            "costs": {kind: t.snapshot() for kind, t in self._costs.items()},
        }


def _rate(tokens: float, seconds: float) -> float:
    return tokens / max(seconds, _MIN_SECONDS)


def _best_k(tokens: list[float], verify: list[float], draft: list[float]) -> int:
    """argmax_k tokens[k] / (verify[k] + draft[k]); the smallest k on ties."""
    best, best_rate = 0, -1.0
    for k, e in enumerate(tokens):
        r = _rate(e, verify[k] + draft[k])
        if r > best_rate:
            best, best_rate = k, r
    return best
