"""The speculation policy alone (pure Python): acceptance estimates, cost bounds, the plan,
exploration, against simulated rounds with known acceptance and costs.

Each property is paired with an injected bug that its check catches.
"""
from __future__ import annotations

import random

import pytest

from verispec.spec import acceptance as acceptance_mod
from verispec.spec import costs as costs_mod
from verispec.spec import policy as policy_mod
from verispec.spec.acceptance import AcceptanceModel, expected_tokens
from verispec.spec.costs import TRUSTED_AT, CostCells, size_bucket
from verispec.spec.policy import RoundReport, RowOffer, RowResult, SpeculationPolicy


def linear_cost(base: float, per_row: float, per_draft: float):
    return lambda rows, drafts: base + per_row * rows + per_draft * drafts


def simulate(policy: SpeculationPolicy, alphas: list[float], cost, rounds: int, seed: int = 0,
             k_max: int = 4, fixed_k: int | None = None) -> float:
    """Rounds of len(alphas) rows that never end, each row's drafts accepted with its own
    alpha per position; returns tokens per second over the last half (past warm-up)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for n in range(rounds):
        offers = [RowOffer(f"r{i}", "ngram", k_max, k_max, adaptive=fixed_k is None) for i in range(len(alphas))]
        ks = [fixed_k] * len(alphas) if fixed_k is not None else policy.plan(offers)
        results = []
        for i, (a, k) in enumerate(zip(alphas, ks)):
            accepted = 0
            while accepted < k and rng.random() < a:
                accepted += 1
            results.append(RowResult(f"r{i}", "ngram", 0, k, accepted))
        spent = cost(len(alphas), sum(ks)) * rng.uniform(0.97, 1.03)
        if fixed_k is None:
            policy.observe(RoundReport(len(alphas), results, spent, sum(ks), total_s=spent))
        if n >= rounds // 2:
            tokens += sum(1 + r.accepted for r in results)
            seconds += spent
    return tokens / seconds


def best_fixed(alphas, cost, rounds=400, k_max=4) -> float:
    return max(simulate(SpeculationPolicy(16), alphas, cost, rounds, fixed_k=k) for k in range(k_max + 1))


# ---------------------------------------------------------------- acceptance
def geometric_rounds(model: AcceptanceModel, alpha: float, k: int, rounds: int, rng) -> None:
    for _ in range(rounds):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        model.observe("r", "ngram", 0, k, accepted)


@pytest.mark.parametrize("broken", [False, True])
def test_fully_accepted_rounds_are_censored_not_failures(monkeypatch, broken):
    if broken:  # a failure counted on every round, accepted in full or not
        monkeypatch.setattr(acceptance_mod.Counts, "observe", lambda self, d, a, h: (
            setattr(self, "successes", self.successes * 0.5 ** (d / h) + a),
            setattr(self, "failures", self.failures * 0.5 ** (d / h) + 1.0)))
    errors = []
    for alpha in (0.3, 0.6, 0.9):
        model = AcceptanceModel()
        geometric_rounds(model, alpha, 2, 400, random.Random(1))
        errors.append(abs(model.alpha("r", "ngram", 0) - alpha))
    assert (max(errors) > 0.1) == broken, errors


def test_a_request_starts_from_its_proposers_pool_for_the_key():
    model = AcceptanceModel()
    geometric_rounds(model, 0.9, 4, 200, random.Random(2))
    assert model.alpha("new", "ngram", 0) > 0.8        # the pool's estimate for key 0
    assert model.alpha("new", "ngram", 3) == acceptance_mod.COLD_ALPHA  # another key: cold
    assert model.alpha("new", "draft", 0) == acceptance_mod.COLD_ALPHA  # another proposer: cold


@pytest.mark.parametrize("broken", [False, True])
def test_a_parked_request_relaxes_to_the_pool_and_drafts_again(monkeypatch, broken):
    if broken:
        monkeypatch.setattr(AcceptanceModel, "declined", lambda self, rid, key: None)
    policy = SpeculationPolicy(16)
    cost = linear_cost(1.0, 0.0, 0.3)
    for n in range(TRUSTED_AT):  # costs known at every size
        for d in range(5):
            policy.verify_costs.observe(1, d, cost(1, d))
    for _ in range(30):  # a bad stretch: nothing accepted
        policy.acceptance.observe("r", "ngram", 0, 4, 0)
    for _ in range(200):  # meanwhile other requests show drafting pays
        policy.acceptance.observe("other", "ngram", 0, 4, 4)
    drafted = 0
    for _ in range(200):
        ks = policy.plan([RowOffer("r", "ngram", 4, 4)])
        drafted += ks[0]
        policy.observe(RoundReport(1, [RowResult("r", "ngram", 0, ks[0], 0)], None, ks[0]))
    assert (drafted > 0) != broken


# ---------------------------------------------------------------- costs
def test_size_buckets_are_exact_to_eight_then_shared():
    assert [size_bucket(n) for n in (0, 5, 8, 9, 11, 15, 16, 300)] == [0, 5, 8, 8, 10, 12, 16, 256]


@pytest.mark.parametrize("broken", [False, True])
def test_exploring_prices_stay_below_and_safe_prices_above_the_true_cost(monkeypatch, broken):
    """True cost concave in tokens: the chords and the half-slope step price at or below it
    (so a plan that pays is tried), the upper bounds at or above it (so a plan played
    without exploring pays at its worst)."""
    if broken:  # the two sides swapped
        real = CostCells.at
        monkeypatch.setattr(CostCells, "at", lambda self, rows, optimistic: real(self, rows, not optimistic))
    true = lambda rows, size: 1.0 + 0.3 * rows + 0.2 * size ** 0.8  # noqa: E731
    cells, rng = CostCells(), random.Random(3)
    for rows, size in {(rng.randrange(1, 9), rng.randrange(0, 33)) for _ in range(25)} | {(r, 0) for r in range(1, 9)}:
        for _ in range(TRUSTED_AT):
            cells.observe(rows, size, true(rows, size_bucket(size)))
    wrong = checked = 0
    for rows in range(1, 9):
        low, high = cells.at(rows, True), cells.at(rows, False)
        for size in range(0, 33):
            lo, trusted = low.price(size)
            hi, _ = high.price(size)
            if trusted:
                continue
            t = true(rows, size_bucket(size))
            checked += 1
            wrong += (lo is not None and lo > t + 1e-9 and hi != lo) or (hi is not None and hi < t - 1e-9)
    assert checked and (wrong > 0) == broken


def test_exploration_widens_one_bucket_past_what_is_measured():
    cells = CostCells()
    for size, seconds in ((0, 1.0), (2, 1.4)):
        for _ in range(TRUSTED_AT):
            cells.observe(1, size, seconds)
    prices = cells.at(1, True)
    assert prices.price(1) == (pytest.approx(1.2), False)   # the chord
    assert prices.price(3) == (pytest.approx(1.5), False)   # 1.4 + half of 0.2 per token
    assert prices.price(4) == (None, False)                  # further out: no bound
    assert cells.at(1, False).price(1) == (1.4, False)       # safe: the next trusted cell up


def test_a_cell_is_trusted_at_its_third_timing_and_prices_by_its_median():
    cells = CostCells()
    for s in (1.0, 9.0):
        cells.observe(2, 3, s)
    assert cells.trusted(2, 3) is None
    cells.observe(2, 3, 2.0)
    assert cells.trusted(2, 3) == 2.0  # the stall (9.0) does not move the median


# ---------------------------------------------------------------- the plan
@pytest.mark.parametrize("broken", [False, True])
def test_at_batch_one_the_plan_is_argmax_of_expected_tokens_over_cost(monkeypatch, broken):
    if broken:  # each draft's gain overstated (sqrt of the chance it is reached)
        real = SpeculationPolicy._gains
        monkeypatch.setattr(SpeculationPolicy, "_gains",
                            lambda self, rows: [(g ** 0.5, i) for g, i in real(self, rows)])
    rng, misses = random.Random(4), 0
    for case in range(40):
        alpha, per_draft = rng.uniform(0.1, 0.95), rng.uniform(0.02, 0.6)
        policy = SpeculationPolicy(16)
        for d in range(9):
            for _ in range(TRUSTED_AT):
                policy.verify_costs.observe(1, d, 1.0 + per_draft * d)
        policy.acceptance.alpha = lambda rid, p, key: alpha
        k = policy.plan([RowOffer("r", "ngram", 8, 8)])[0]
        best = max(range(9), key=lambda j: expected_tokens(alpha, j) / (1.0 + per_draft * j))
        misses += k != best
    assert (misses > 0) == broken


@pytest.mark.parametrize("alphas,cost", [
    ([0.8], linear_cost(1.0, 0.0, 0.08)),               # drafting pays: k = 4
    ([0.2], linear_cost(1.0, 0.0, 0.3)),                # it does not: k = 0
    ([0.7, 0.3, 0.5, 0.9], linear_cost(1.0, 0.5, 0.1)),  # a batch with rows apart
])
def test_cold_start_reaches_the_best_fixed_k_in_simulation(alphas, cost):
    adaptive = simulate(SpeculationPolicy(16), alphas, cost, 800, seed=5)
    assert adaptive >= 0.97 * best_fixed(alphas, cost)


def test_the_simulation_catches_a_policy_that_ignores_acceptance(monkeypatch):
    monkeypatch.setattr(AcceptanceModel, "alpha", lambda self, rid, p, key: 0.95)
    cost = linear_cost(1.0, 0.0, 0.3)
    assert simulate(SpeculationPolicy(16), [0.2], cost, 800, seed=5) < 0.97 * best_fixed([0.2], cost)


@pytest.mark.parametrize("broken", [False, True])
def test_past_its_budget_the_policy_plays_only_what_pays_at_its_worst(monkeypatch, broken):
    """An explored plan that loses is charged what it lost; once the charges pass the budget,
    a size with no upper bound is no longer tried."""
    if broken:  # exploration never charged
        monkeypatch.setattr(SpeculationPolicy, "_charge_exploration", lambda self, s, n: None)
    policy = SpeculationPolicy(16)
    for _ in range(TRUSTED_AT):
        policy.observe(RoundReport(1, [], 1.0, 0, total_s=1.0))  # plain at batch 1: 1 s
    tried = 0
    for n in range(60):
        offer = [RowOffer(f"r{n}", "ngram", 1, 1)]  # a new request each round: cold alpha
        ks = policy.plan(offer)
        tried += ks[0]
        seconds = 1.0 + 0.9 * ks[0]  # drafting nearly doubles the round and is never accepted
        policy.verify_costs = CostCells()  # (and is never trusted: every round explores anew)
        for _ in range(TRUSTED_AT):
            policy.verify_costs.observe(1, 0, 1.0)
        policy.observe(RoundReport(1, [RowResult(f"r{n}", "ngram", 0, ks[0], 0, finished=True)],
                                   seconds, ks[0], total_s=seconds))
    assert (tried < 10) != broken, tried


def test_a_round_with_prefill_is_not_priced():
    policy = SpeculationPolicy(16)
    policy.plan([RowOffer("r", "ngram", 4, 4)])
    policy.observe(RoundReport(1, [RowResult("r", "ngram", 0, 2, 1)], None, 2, total_s=5.0))
    assert policy.verify_costs.snapshot() == [] and policy.verify_costs.at(1, True).price(2) == (None, False)


@pytest.mark.parametrize("broken", [False, True])
def test_after_the_budget_a_small_batch_drafts_at_a_price_it_cannot_exceed(monkeypatch, broken):
    """A drain: drafting measured at 4 rows only; at 2 rows, never measured, its price is
    bounded above by the 4-row cells, and it pays even at that bound."""
    if broken:  # no upper bound from larger batches: untrusted cells unpriced
        monkeypatch.setattr(CostCells, "at", _lower_only(CostCells.at))
    policy = SpeculationPolicy(16)
    policy.explore_debt_s = 1e9  # budget spent
    cost = linear_cost(1.0, 0.1, 0.02)
    for d in range(0, 17):
        for _ in range(TRUSTED_AT):
            policy.verify_costs.observe(4, d, cost(4, d))
    for rows in (1, 2):
        for _ in range(TRUSTED_AT):
            policy.verify_costs.observe(rows, 0, cost(rows, 0))
    for rid in ("a", "b"):
        for _ in range(50):
            policy.acceptance.observe(rid, "ngram", 0, 4, 4)
    ks = policy.plan([RowOffer("a", "ngram", 4, 4), RowOffer("b", "ngram", 4, 4)])
    assert (sum(ks) > 0) != broken


def _lower_only(real):
    def at(self, rows, optimistic):
        prices = real(self, rows, True)
        if not optimistic:
            prices._bound = [None] * len(prices._bound)
        return prices
    return at


def test_fixed_k_rows_draft_their_k_within_what_is_available():
    policy = SpeculationPolicy(16)
    rows = [RowOffer("a", "ngram", 2, 4, adaptive=False), RowOffer("b", "ngram", 6, 4, adaptive=False),
            RowOffer("c", None, 0, 0)]
    assert policy.plan(rows) == [2, 4, 0]


def test_the_policy_modules_stay_small():
    import inspect
    lines = sum(len(inspect.getsource(m).splitlines()) for m in (acceptance_mod, costs_mod, policy_mod))
    assert lines <= 700
