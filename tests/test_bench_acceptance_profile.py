"""bench/acceptance_profile.py's counting: censored positions are not rejections."""
from __future__ import annotations

import pytest

from bench_scripts import load

acceptance_profile = load("acceptance_profile", "acceptance_profile")


def test_positions_past_the_first_rejection_are_not_counted_as_tested():
    # (drafted, accepted): all 3 accepted; 1st rejected; 2 accepted then the 3rd rejected;
    # 2 drafted and both accepted (position 3 never offered)
    got = acceptance_profile.profile([(3, 3), (3, 0), (3, 2), (2, 2)], k=3)
    assert got["tested"] == [4, 3, 2]
    assert got["accepted"] == [3, 3, 1]
    assert got["alpha"] == [0.75, 1.0, 0.5]
    assert got["pooled_alpha"] == 7 / 9


def test_a_geometric_source_gives_a_flat_profile_and_a_rising_one_does_not():
    import random
    rng = random.Random(0)

    def rounds(alphas):
        out = []
        for _ in range(20000):
            a = 0
            while a < len(alphas) and rng.random() < alphas[a]:
                a += 1
            out.append((len(alphas), a))
        return out

    flat = acceptance_profile.profile(rounds([0.6] * 4), k=4)["alpha"]
    assert all(abs(a - 0.6) < 0.03 for a in flat)
    rising = acceptance_profile.profile(rounds([0.4, 0.6, 0.9, 0.9]), k=4)["alpha"]
    assert [round(a, 1) for a in rising] == [0.4, 0.6, 0.9, 0.9]


def test_an_impossible_round_is_rejected():
    with pytest.raises(ValueError, match="accepted <= drafted"):
        acceptance_profile.profile([(2, 3)], k=4)


def test_rounds_are_profiled_per_match_length():
    rounds = [(3, 3, 4), (3, 0, 1), (3, 2, 4), (2, 0, 1), (2, 2, 2)]
    got = acceptance_profile.by_match(rounds, k=3)
    assert sorted(got) == [1, 2, 4]
    assert got[1]["rounds"] == 2 and got[1]["alpha"][0] == 0.0 and got[1]["share"] == 0.4
    assert got[4]["tested"] == [2, 2, 2] and got[4]["accepted"] == [2, 2, 1]
    assert got[2]["alpha"] == [1.0, 1.0, None]
