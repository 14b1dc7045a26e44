"""Simulate the adaptive draft-length controller against known acceptance and costs.

The simulator knows the truth (per-position acceptance alpha, pass costs) and drives the
controller only through its public API, the way the engine does: choose_k, then
observe_acceptance per row and observe_cost per pass with the simulated (noisy) seconds.

Throughput is reported two ways: `rate` (realised committed tokens per simulated second)
and `expected_rate` (the expected tokens E(alpha_true, k) of every round actually played,
per simulated second). Both estimate the same quantity; the second removes the
acceptance-sampling noise, so small differences between policies can be asserted on it.

    .venv/bin/python bench/controller_sim.py          # prints the comparison table
"""
from __future__ import annotations

import math
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from verispec.spec.controller import (  # noqa: E402
    FREE_DRAFT_PROPOSERS, AdaptiveController, ControllerConfig, expected_tokens)


@dataclass(frozen=True)
class CostModel:
    """True mean seconds of the passes of one round (arbitrary time unit)."""

    verify_base: float = 1.0         # a verify pass of up to flat_tokens batch tokens
    verify_per_token: float = 0.2    # each batch token beyond flat_tokens (compute-bound)
    flat_tokens: int = 6             # batch tokens handled at verify_base (memory-bound)
    verify_spec: float = 0.0         # extra fixed cost of a pass that verifies any draft
    draft_base: float = 0.05         # draft pass: fixed part (e.g. the catch-up forward)
    draft_per_token: float = 0.2     # draft pass: per drafted position (sequential forwards)
    noise: float = 0.05              # relative sd of every measured time (log-normal)

    def verify(self, batch_size: int, draft_tokens: int) -> float:
        """A pass over batch_size rows' pending tokens plus draft_tokens drafts in all."""
        return (self.verify_base + (self.verify_spec if draft_tokens else 0.0)
                + self.verify_per_token * max(0, batch_size + draft_tokens - self.flat_tokens))

    def draft(self, batch_size: int, k: int) -> float:
        return self.draft_base + self.draft_per_token * k if k > 0 else 0.0

    def round_seconds(self, batch_size: int, k: int, drafts: bool = True, coverage: float = 1.0) -> float:
        """Mean seconds of one round in which every row asks for k (a share `coverage` gets them)."""
        d = self.draft(batch_size, k) if drafts and k > 0 else 0.0
        return self.verify(batch_size, round(coverage * batch_size * k)) + d


@dataclass(frozen=True)
class Scenario:
    """A workload: true acceptance per phase, costs, batch size and length."""

    name: str
    alphas: tuple[float, ...]        # true alpha per phase, cycled
    cost: CostModel = field(default_factory=CostModel)
    period_tokens: int = 0           # committed tokens per phase (0: stationary, alphas[0])
    batch_size: int = 1
    proposer: str = "draft"
    tokens: int = 3000               # committed tokens per row
    coverage: float = 1.0            # n-gram: chance a row has a match this round (k_max drafts, else 0)
    first_alpha: float | None = None  # position 1's acceptance, alpha the later ones' (None: alpha,
                                      # geometric); n-gram lookups: a coin toss, then mostly right
    # n-gram: a matched round's suffix length n drawn by share, with its own acceptance
    # ((n, share, first, later positions), ...), reported to the controller; () = none
    match_kinds: tuple[tuple[int, float, float, float], ...] = ()

    def yield_of(self, alpha: float, k: int, first: float | None = None) -> float:
        """Expected committed tokens of one row's round of k drafts: 1 + p (1 + alpha + ...
        + alpha^(k - 1)), p the first draft's acceptance (`first`, else the scenario's)."""
        if first is None:
            first = alpha if self.first_alpha is None else self.first_alpha
        return 1.0 + (first * expected_tokens(alpha, k - 1) if k else 0.0)

    def alpha_at(self, committed: int) -> float:
        if not self.period_tokens:
            return self.alphas[0]
        return self.alphas[(committed // self.period_tokens) % len(self.alphas)]

    def oracle_k(self, alpha: float, k_max: int = 8, batch_size: int | None = None) -> int:
        """The k maximising E(alpha, k) / mean round seconds (known truth)."""
        b = batch_size or self.batch_size
        drafts = self.proposer not in FREE_DRAFT_PROPOSERS
        return max(range(k_max + 1),
                   key=lambda k: self.expected_yield(alpha, k) / self.cost.round_seconds(b, k, drafts, self.coverage))

    def expected_yield(self, alpha: float, k: int) -> float:
        """Expected committed tokens of a row asked for k drafts (one common k for all rows)."""
        if self.match_kinds:
            return 1.0 + self.coverage * sum(share * (self.yield_of(a, k, first) - 1.0)
                                             for _, share, first, a in self.match_kinds)
        return 1.0 + self.coverage * (self.yield_of(alpha, k) - 1.0)


@dataclass
class SimResult:
    tokens: int = 0                  # committed tokens, all rows
    expected: float = 0.0            # sum of E(alpha_true, k) over rows and rounds
    seconds: float = 0.0             # simulated clock
    rounds: int = 0
    drafted: int = 0                 # draft tokens verified, all rows
    ks: list[int] = field(default_factory=list)        # k of row 0 per round
    alpha_hat: list[float] = field(default_factory=list)  # row 0's estimate after each round
    committed: list[int] = field(default_factory=list)  # row 0's committed tokens so far

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def expected_rate(self) -> float:
        return self.expected / self.seconds

    def drafted_per_row_round(self, batch_size: int) -> float:
        return self.drafted / (self.rounds * batch_size)

    def modal_k(self, skip: int = 0) -> int:
        return Counter(self.ks[skip:]).most_common(1)[0][0]


def accepted_prefix(rng: random.Random, alpha: float, k: int, first: float | None = None) -> int:
    """Accept each draft position with probability alpha (the first with `first`, if given)
    until the first rejection."""
    a = 0
    while a < k and rng.random() < (first if a == 0 and first is not None else alpha):
        a += 1
    return a


def _noisy(rng: random.Random, seconds: float, noise: float) -> float:
    return seconds * math.exp(rng.gauss(0.0, noise) - noise * noise / 2) if noise else seconds


class Simulation:
    """One workload's rows in lockstep against a controller; `step` plays one round."""

    def __init__(self, controller: AdaptiveController, scenario: Scenario, seed: int = 0):
        self.controller, self.scenario = controller, scenario
        self.rng = random.Random(seed)
        self.ids = [f"{scenario.name}-{seed}-{i}" for i in range(scenario.batch_size)]
        for rid in self.ids:
            controller.start(rid, scenario.proposer)
        self.committed = [0] * scenario.batch_size
        self.result = SimResult()

    @property
    def done(self) -> bool:
        return min(self.committed) >= self.scenario.tokens

    def step(self) -> None:
        """Look up availability, choose_k, accept each row's drafts against the true alpha,
        report, advance the clock."""
        ctl, sc, res = self.controller, self.scenario, self.result
        free = sc.proposer in FREE_DRAFT_PROPOSERS
        # n-gram: the engine looks up every row before choosing k (a match or none); a draft
        # model always delivers what it is asked.
        available = ([ctl.config.k_max if sc.coverage >= 1.0 or self.rng.random() < sc.coverage else 0
                      for _ in self.ids] if free else None)
        kinds = [self._match_kind() if available and available[i] else None for i in range(len(self.ids))]
        matches = [kind[0] if kind else None for kind in kinds]
        ks = ctl.choose_k(self.ids, sc.batch_size, available, **({"matches": matches} if sc.match_kinds else {}))
        drafted_total, deepest, drafting_rows = 0, 0, 0
        for i, rid in enumerate(self.ids):
            alpha, k = sc.alpha_at(self.committed[i]), ks[rid]
            first = sc.first_alpha
            if kinds[i]:
                _, _, first, alpha = kinds[i]
            if available is not None:  # a proposer delivers no more than it has
                k = min(k, available[i])
            a = accepted_prefix(self.rng, alpha, k, first)
            ctl.observe_acceptance(rid, k, a, matches[i] if k else None)
            drafted_total += k
            drafting_rows += k > 0
            res.drafted += k
            deepest = max(deepest, k)
            self.committed[i] += a + 1
            res.tokens += a + 1
            res.expected += sc.yield_of(alpha, k, first)
        res.seconds += self._play_passes(drafted_total, deepest, drafting_rows)
        res.rounds += 1
        res.ks.append(ks[self.ids[0]])
        res.alpha_hat.append(ctl.alpha(self.ids[0]))
        res.committed.append(self.committed[0])

    def _match_kind(self) -> tuple[int, float, float, float] | None:
        """A matched round's kind, drawn by share (None without match kinds)."""
        kinds = self.scenario.match_kinds
        if not kinds:
            return None
        u = self.rng.random() * sum(k[1] for k in kinds)
        for kind in kinds:
            u -= kind[1]
            if u <= 0.0:
                return kind
        return kinds[-1]

    def _play_passes(self, drafted: int, deepest: int, drafting_rows: int) -> float:
        """Time the round's passes, report them to the controller as the engine does (the
        draft pass first, under the rows it drafted for, then the verify pass), return the
        seconds."""
        cost, b, rng = self.scenario.cost, self.scenario.batch_size, self.rng
        seconds = 0.0
        if deepest > 0 and self.scenario.proposer not in FREE_DRAFT_PROPOSERS:
            seconds = _noisy(rng, cost.draft(b, deepest), cost.noise)
            self.controller.observe_cost("draft", drafting_rows, deepest, seconds)
        verify = _noisy(rng, cost.verify(b, drafted), cost.noise)
        self.controller.observe_cost("verify", b, drafted, verify)
        return seconds + verify

    def finish(self) -> SimResult:
        for rid in self.ids:
            self.controller.finish(rid)
        return self.result


def simulate(controller: AdaptiveController, scenario: Scenario, seed: int = 0) -> SimResult:
    """Run one workload through the controller until every row has its tokens."""
    sim = Simulation(controller, scenario, seed)
    while not sim.done:
        sim.step()
    return sim.finish()


def simulate_requests(controller: AdaptiveController, scenarios: list[Scenario], seed: int = 0,
                      measure_from: int = 0) -> SimResult:
    """Run workloads one after another through one controller (a server's requests, each
    started when the last finished); the result sums those from `measure_from` on (the ones
    before are the warm-up)."""
    total = SimResult()
    for i, sc in enumerate(scenarios):
        r = simulate(controller, sc, seed * 1000 + i)
        if i >= measure_from:
            for name in ("tokens", "expected", "seconds", "rounds", "drafted"):
                setattr(total, name, getattr(total, name) + getattr(r, name))
            total.ks += r.ks
    return total


# ---- the printed table ---------------------------------------------------------------

# Cost models (time unit: one memory-bound target pass).
DRAFT = CostModel()                                    # verify flat to 6 tokens, 0.05 + 0.2 k draft
LOCKSTEP_DRAFT = CostModel(verify_per_token=0.05, flat_tokens=1,   # a draft model that runs
                           draft_base=0.25, draft_per_token=0.25)  # k + 1 forwards at 1/4 cost
COSTLY_DRAFT = CostModel(draft_base=0.2, draft_per_token=0.6)
NGRAM_BATCH = CostModel(verify_per_token=0.02, flat_tokens=16, draft_per_token=0.0)
CPU_BATCH = CostModel(verify_per_token=0.065, flat_tokens=16, verify_spec=0.05, draft_per_token=0.0)
SPEC_OVERHEAD = CostModel(verify_per_token=0.01, flat_tokens=16, verify_spec=0.6, draft_per_token=0.0)
# N-gram at batch 1 on the Zen 4 CPU (traced steps 4.3 / 4.9 / 5.7 / 7.8 / 12.8 ms at k = 0 / 1 /
# 2 / 4 / 8): each verified token ~a quarter of a plain step.
NGRAM_CPU = CostModel(verify_per_token=0.24, flat_tokens=1, draft_base=0.0, draft_per_token=0.0)

# N-gram at batch 1 with a verify pass's fixed extra (rejection sampling, bookkeeping): the
# default model's traced steps on GSM8K, ~3.75 / 4.7 / 4.9 / 6.4 ms at k = 0 / 1 / 2 / 3.
NGRAM_CPU_MATH = CostModel(verify_per_token=0.15, flat_tokens=1, verify_spec=0.1, draft_base=0.0,
                           draft_per_token=0.0, noise=0.1)


def short_requests(kinds: list[tuple[float, float, float]], count: int, tokens: int = 123,
                   warm_up: tuple[float, float, float] | None = None, warm_count: int = 4,
                   warm_tokens: int = 16) -> list[Scenario]:
    """A server's run at batch 1: `warm_count` warm-up requests of `warm_tokens` (acceptance
    `warm_up`), then `count` requests of `tokens`, taking turns over `kinds`; each kind is
    (first draft's acceptance, the later positions', the rounds with a lookup match)."""
    def scenario(name: str, kind: tuple[float, float, float], n: int) -> Scenario:
        first, alpha, coverage = kind
        return Scenario(name, (alpha,), NGRAM_CPU_MATH, proposer="ngram", tokens=n, coverage=coverage,
                        first_alpha=first)
    warm = [scenario(f"warm-{i}", warm_up, warm_tokens) for i in range(warm_count)] if warm_up else []
    return warm + [scenario(f"request-{i}", kinds[i % len(kinds)], tokens) for i in range(count)]


# Alike short answers at batch 1 (GSM8K on the default model: the first draft accepted ~0.45,
# then ~0.5, a match in ~70% of rounds; k = 2 best, 1.15x plain, k = 1 and 3 ~2.6% behind),
# after a warm-up of early answer tokens that read low; and requests that differ (quoting
# at 0.9 beside chat at 0.2).
ALIKE_REQUESTS = short_requests([(0.45, 0.5, 0.7)], 4, warm_up=(0.25, 0.35, 0.7))
MIXED_REQUESTS = short_requests([(0.9, 0.95, 0.9), (0.2, 0.3, 0.5)], 12)

SCENARIOS = {sc.name: sc for sc in (
    Scenario("draft a=0.45", (0.45,), DRAFT, tokens=3000),
    Scenario("draft a=0.70", (0.70,), DRAFT, tokens=3000),
    Scenario("draft a=0.90", (0.90,), DRAFT, tokens=3000),
    Scenario("ngram a=0.70 b=8", (0.70,), NGRAM_BATCH, batch_size=8, proposer="ngram", tokens=1000),
    Scenario("ngram a=0.15 b=16", (0.15,), NGRAM_BATCH, batch_size=16, proposer="ngram", tokens=500),
    Scenario("costly draft a=0.6", (0.60,), COSTLY_DRAFT, tokens=3000),
    # Open chat at batch 16 on this CPU: n-gram finds a match in a quarter of the rounds, and
    # every verified token costs ~6% of a plain step (int4 kernels are compute-bound at 16
    # tokens), more than a draft at acceptance 0.5 is worth: plain decoding is best.
    Scenario("ngram a=0.5 coverage=0.25 b=16", (0.50,), CPU_BATCH, batch_size=16, proposer="ngram",
             tokens=500, coverage=0.25),
    # Matches in 30% of the rows, good ones, but any drafting costs a fixed 60% extra: it
    # pays only in rounds where at least 5 rows have a match (about half of them).
    Scenario("ngram a=0.8 coverage=0.3 b=16 overhead", (0.80,), SPEC_OVERHEAD, batch_size=16,
             proposer="ngram", tokens=500, coverage=0.3),
    Scenario("alternating 0.9/0.35", (0.90, 0.35), LOCKSTEP_DRAFT, period_tokens=200, tokens=12000),
    # An n-gram lookup's first token is a coin toss, its continuation mostly right
    # (bench/acceptance_profile.py: a1 0.32-0.51, a3+ 0.67-1.0 on every task): best k = 3.
    Scenario("ngram first=0.4 a=0.85", (0.85,), NGRAM_CPU, proposer="ngram", tokens=3000, first_alpha=0.4),
    # MT-bench at batch 1 by match length (default model, n-gram, k = 4: 70% of matched rounds
    # are 1-token matches, first draft accepted 0.21, 16% 4-token ones at 0.98, then 0.82):
    # a 4-token match is worth drafting deep, a 1-token one hardly at all.
    Scenario("ngram chat match lengths", (0.5,), NGRAM_CPU_MATH, proposer="ngram", tokens=3000, coverage=0.7,
             match_kinds=((1, 0.70, 0.21, 0.38), (2, 0.13, 0.38, 0.42), (3, 0.02, 0.40, 0.40),
                          (4, 0.16, 0.98, 0.82))),
)}


def fixed_rates(scenario: Scenario, seed: int = 0, k_max: int = 8) -> list[float]:
    """expected_rate of fixed k for every k in [0, k_max] (index = k)."""
    return [simulate(AdaptiveController(ControllerConfig(k_max=k_max, adaptive=False, fixed_k=k)),
                     scenario, seed).expected_rate for k in range(k_max + 1)]


def main(seeds: tuple[int, ...] = (0, 1, 2)) -> None:
    shown = (0, 1, 2, 4, 8)
    head = ["adaptive"] + ["plain" if k == 0 else f"k={k}" for k in shown] + ["best fixed", "vs best"]
    print(f"{'scenario':22}" + "".join(f"{c:>11}" for c in head))
    for sc in SCENARIOS.values():
        adaptive = sum(simulate(AdaptiveController(), sc, s).expected_rate for s in seeds) / len(seeds)
        fixed = fixed_rates(sc)
        best = max(range(len(fixed)), key=fixed.__getitem__)
        cells = [f"{adaptive:11.3f}"] + [f"{fixed[k]:11.3f}" for k in shown]
        cells += [f"{fixed[best]:7.3f} k={best}", f"{adaptive / fixed[best] - 1:+11.1%}"]
        print(f"{sc.name:22}" + "".join(cells))
    for name, workload, warm in (("alike short requests", ALIKE_REQUESTS, 4), ("mixed requests", MIXED_REQUESTS, 2)):
        def rate(config: ControllerConfig | None) -> float:
            return sum(simulate_requests(AdaptiveController(config), workload, s, warm).expected_rate
                       for s in seeds) / len(seeds)
        adaptive = rate(None)
        fixed = {k: rate(ControllerConfig(adaptive=False, fixed_k=k)) for k in range(5)}
        best = max(fixed, key=fixed.__getitem__)
        cells = [f"{adaptive:11.3f}"] + [f"{fixed[k]:11.3f}" if k in fixed else f"{'':11}" for k in shown]
        cells += [f"{fixed[best]:7.3f} k={best}", f"{adaptive / fixed[best] - 1:+11.1%}"]
        print(f"{name:22}" + "".join(cells))
    print(f"tokens per simulated second (expected tokens of the rounds played); adaptive is the "
          f"mean over seeds {list(seeds)}; best fixed is over every k in [0, 8] (the two runs of "
          f"requests: [0, 4], after their warm-up requests)")


if __name__ == "__main__":
    main()
