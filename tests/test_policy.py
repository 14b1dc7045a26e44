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
            policy.observe(RoundReport(len(alphas), results, spent, sum(ks)))
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


# ---------------------------------------------------------------- costs
def test_size_buckets_are_exact_to_eight_then_shared():
    assert [size_bucket(n) for n in (0, 5, 8, 9, 11, 15, 16, 300)] == [0, 5, 8, 8, 10, 12, 16, 256]


def concave(rows: int, size: int) -> float:
    return 1.0 + 0.3 * rows + 0.2 * size ** 0.8


def measured_cells(cost) -> CostCells:
    cells, rng = CostCells(), random.Random(3)
    for rows, size in {(rng.randrange(1, 9), rng.randrange(0, 33)) for _ in range(25)} | {(r, 0) for r in range(1, 9)}:
        for _ in range(TRUSTED_AT):
            cells.observe(rows, size, cost(rows, size_bucket(size)))
    return cells


@pytest.mark.parametrize("broken", [False, True])
def test_exploring_prices_are_below_the_true_cost_and_the_rest_above(monkeypatch, broken):
    """True cost concave in tokens: a chord between trusted cells and the half-slope step
    past the last price at or below it (a plan that pays is tried); sizes further out at
    their upper bound, at or above it (a plan played there pays at its worst)."""
    if broken:  # the step past the last trusted cell at its full slope plus a margin
        monkeypatch.setattr(costs_mod, "EXPLORE_SLOPE", 3.0)
    cells, wrong = measured_cells(concave), 0
    for rows in range(1, 9):
        prices, own = cells.at(rows), [cells.trusted(rows, b) for b in range(0, 33)]
        last = max(b for b in range(0, 33) if own[b] is not None)
        for size in range(0, 33):
            price, t = prices.price(size), concave(rows, size_bucket(size))
            if own[size] is not None or price is None:
                continue
            step = costs_mod._BUCKETS.index(size_bucket(size)) - costs_mod._BUCKETS.index(size_bucket(last))
            exploring = step <= 1  # a chord below the last trusted cell, or the step past it
            wrong += (price > t + 1e-9) if exploring else (price < t - 1e-9)
    assert (wrong > 0) == broken


def test_exploration_widens_one_bucket_past_what_is_measured():
    cells = CostCells()
    for size, seconds in ((0, 1.0), (2, 1.4)):
        for _ in range(TRUSTED_AT):
            cells.observe(1, size, seconds)
    prices = cells.at(1)
    assert prices.price(1) == pytest.approx(1.2)   # the chord
    assert prices.price(3) == pytest.approx(1.5)   # 1.4 + half of 0.2 per token
    assert prices.price(4) is None                 # further out: no bound yet
    for _ in range(TRUSTED_AT):
        cells.observe(2, 8, 3.0)
    assert cells.at(1).price(4) == 3.0             # ... until a larger cell bounds it


def test_the_largest_priced_size_bounds_every_price():
    cells = CostCells()
    assert cells.at(1).largest_priced() == -1      # nothing measured: nothing priced
    for size in (0, 2):
        for _ in range(TRUSTED_AT):
            cells.observe(1, size, 1.0 + size)
    prices = cells.at(1)
    assert prices.largest_priced() == 3            # the explored bucket (3) is the last priced
    assert prices.price(3) is not None and prices.price(4) is None
    for _ in range(TRUSTED_AT):
        cells.observe(2, 300, 9.0)                 # the last bucket: every size has a bound
    assert cells.at(1).largest_priced() is None


@pytest.mark.parametrize("broken", [False, True])
def test_gains_cut_to_the_priced_sizes_are_the_best_of_all(monkeypatch, broken):
    """The plan asks only for as many gains as a priced pass can carry: they must be the
    first of the whole best-first list (ties in row order)."""
    if broken:  # a row's gains capped one short of the limit
        real = SpeculationPolicy._gains
        monkeypatch.setattr(SpeculationPolicy, "_gains", lambda self, rows, limit=None: real(
            self, [r._replace(available=min(r.available, limit - 1)) for r in rows] if limit else rows, limit))
    rng, differ = random.Random(7), 0
    for _ in range(50):
        policy = SpeculationPolicy(8)
        rows = [RowOffer(f"r{i}", "ngram", rng.randrange(0, 9), 8, key=rng.randrange(3)) for i in range(6)]
        policy.acceptance.alpha = lambda rid, p, key: (0.3, 0.6, 0.6)[key]  # rows tie by key
        full = SpeculationPolicy._gains(policy, rows)
        for limit in range(1, 12):
            differ += policy._gains(rows, limit) != full[:limit]
    assert (differ > 0) == broken


def test_a_cell_is_trusted_at_its_third_timing_and_prices_by_its_median():
    cells = CostCells()
    for s in (1.0, 9.0):
        cells.observe(2, 3, s)
    assert cells.trusted(2, 3) is None
    cells.observe(2, 3, 2.0)
    assert cells.trusted(2, 3) == 2.0  # the stall (9.0) does not move the median


@pytest.mark.parametrize("broken", [False, True])
def test_a_cell_left_unplayed_is_priced_at_todays_level(monkeypatch, broken):
    """Passes slow down 0.15% a round (contexts grow, as at 16 rows). Plain rounds are
    played, then only 3-draft rounds: the plain cell, unplayed for 180 rounds, must still
    be priced at its cost today (by its own timings it was 21% cheap) and so must the
    drafts. The level's lag (a median of 8 rounds over a trend) leaves ~1.5%."""
    if broken:  # the one played cell's relative cost learned from a level only it sets
        monkeypatch.setattr(costs_mod, "_anchored_apart", lambda recent, bucket: True)
    truth = lambda size, t: (1.0 + 0.0015 * t) * (1.08 + 0.03 * size if size else 1.0)  # noqa: E731
    cells, t = CostCells(), 0
    for t in range(12):
        cells.observe(16, 0, truth(0, t))
    for t in range(12, 20):
        cells.observe(16, 0 if t % 2 else 3, truth(0 if t % 2 else 3, t))
    for t in range(20, 200):
        cells.observe(16, 3, truth(3, t))
    prices = cells.at(16)
    assert prices.price(3) == pytest.approx(truth(3, t), rel=0.03)
    assert (prices.price(0) == pytest.approx(truth(0, t), rel=0.03)) != broken


# ---------------------------------------------------------------- the plan
@pytest.mark.parametrize("broken", [False, True])
def test_at_batch_one_the_plan_is_argmax_of_expected_tokens_over_cost(monkeypatch, broken):
    if broken:  # each draft's gain overstated (sqrt of the chance it is reached)
        real = SpeculationPolicy._gains
        monkeypatch.setattr(SpeculationPolicy, "_gains",
                            lambda self, rows, limit=None: [(g ** 0.5, i) for g, i in real(self, rows, limit)])
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


@pytest.mark.parametrize("broken", [False, True])
def test_the_plan_weighs_the_last_size_of_every_bucket(monkeypatch, broken):
    """Sizes 8 and 9 share a cell, 10 costs far more: with drafts nearly always accepted the
    best plan is 9, the last size of its bucket, which the plan must price (it skips only
    sizes whose next one shares their cell)."""
    if broken:  # 10 not known to open a bucket: size 9 is skipped as if 10 cost the same
        monkeypatch.setattr(policy_mod, "BUCKET_STARTS", costs_mod.BUCKET_STARTS - {10})
    policy = SpeculationPolicy(16)
    for size in range(0, 13):
        for _ in range(TRUSTED_AT):
            policy.verify_costs.observe(1, size, 1.0 + 0.01 * size + (5.0 if size >= 10 else 0.0))
    policy.acceptance.alpha = lambda rid, p, key: 0.99
    assert (policy.plan([RowOffer("r", "ngram", 12, 12)]) == [9]) != broken


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


def test_a_round_with_prefill_is_not_priced():
    policy = SpeculationPolicy(16)
    policy.plan([RowOffer("r", "ngram", 4, 4)])
    policy.observe(RoundReport(1, [RowResult("r", "ngram", 0, 2, 1)], None, 2))
    assert policy.verify_costs.snapshot() == [] and policy.verify_costs.at(1).price(2) is None


@pytest.mark.parametrize("broken", [False, True])
def test_a_drained_batch_drafts_at_a_price_it_cannot_exceed(monkeypatch, broken):
    """Drafting measured at 4 rows only; at 2 rows, never measured past plain, a large plan
    is bounded above by the 4-row cells, and it pays even at that bound."""
    if broken:  # no upper bounds from larger batches
        monkeypatch.setattr(CostCells, "at", _own_rows_only(CostCells.at))
    policy = SpeculationPolicy(16)
    cost = linear_cost(1.0, 0.1, 0.02)
    for d in range(0, 17):
        for _ in range(TRUSTED_AT):
            policy.verify_costs.observe(4, d, cost(4, d))
    for _ in range(TRUSTED_AT):
        policy.verify_costs.observe(2, 0, cost(2, 0))
        policy.verify_costs.observe(2, 1, 5.0)  # one draft at 2 rows measured slow: no widening there
    for rid in ("a", "b"):
        for _ in range(50):
            policy.acceptance.observe(rid, "ngram", 0, 4, 4)
    ks = policy.plan([RowOffer("a", "ngram", 4, 4), RowOffer("b", "ngram", 4, 4)])
    assert (sum(ks) > 2) != broken


def _own_rows_only(real):
    def at(self, rows):
        mine = CostCells()
        mine._trusted = {cell: m for cell, m in self._trusted.items() if cell[0] == rows}
        mine._level = self._level
        return real(mine, rows)
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
