"""bench/experiments/tree_head_potential.py's count of the drafts a tree of head guesses
would have accepted (greedy), against a count by hand."""
from __future__ import annotations

import pytest
import torch

from bench_scripts import load

potential = load("experiments/tree_head_potential", "bench_tree_head_potential")


def _record(truth: list[int], first_guesses: list[list[int]], second_guesses: list[list[int]]):
    t = torch.tensor(truth)
    return (torch.tensor(first_guesses), t), (torch.tensor(second_guesses), t)


@pytest.mark.parametrize("broken", [False, True])
def test_a_child_counts_only_under_a_right_first_guess_and_for_the_next_position(monkeypatch, broken):
    if broken:  # the second draft judged against its own position's truth, not the next one's
        def accepted(depth1, depth2, k1, k2):
            total, rounds = 0.0, 0
            for (g1, truth), (g2, _) in zip(depth1, depth2):
                hit1 = (g1[:, :k1] == truth[:, None]).any(-1)
                hit2 = (g1[:, 0] == truth) & (g2[:, :k2] == truth[:, None]).any(-1) if k2 else torch.zeros_like(hit1)
                total, rounds = total + float(hit1.sum() + hit2.sum()), rounds + hit1.numel()
            return total, rounds
        monkeypatch.setattr(potential, "accepted", accepted)
    # position:            0        1        2        3
    truth = [5, 6, 7, 8]
    first = [[5, 1], [2, 6], [7, 3], [4, 9]]   # top-1 right at 0 and 2; top-2 right at 1
    second = [[5, 0], [6, 0], [0, 7], [8, 0]]  # from its own feature, for each position
    d1, d2 = _record(truth, first, second)
    assert potential.accepted([d1], [d2], 1, 0) == (2.0, 4)      # positions 0, 2
    assert potential.accepted([d1], [d2], 2, 0) == (3.0, 4)      # and 1 as a second candidate
    # a child under a right top-1 at position i judges position i + 1: 0 -> 1 (6), 2 -> 3 (8)
    assert (potential.accepted([d1], [d2], 1, 1) != (4.0, 4)) == broken
