"""bench/experiments/tree_head_potential.py's count of the drafts a tree of head guesses
would have accepted (greedy), against a count by hand."""
from __future__ import annotations

import pytest
import torch

from bench_scripts import load

potential = load("experiments/tree_head_potential", "bench_tree_head_potential")


@pytest.mark.parametrize("broken", [False, True])
def test_a_depth_counts_only_under_a_right_first_candidate_and_one_position_on(broken):
    truth = torch.tensor([5, 6, 7, 8])
    depth1 = torch.tensor([[5, 1], [2, 6], [7, 3], [4, 9]])   # top-1 right at 0 and 2; top-2 at 1
    depth2 = torch.tensor([[5, 0], [6, 0], [0, 7], [8, 0]])   # a second draft's guesses, by position
    if broken:  # the second drafts' guesses taken one entry early (an off-by-one in head_guesses)
        depth2 = torch.cat([depth2[:1], depth2[:-1]])
    guesses = [([depth1, depth2], truth)]
    expected = {(1,): 2,       # positions 0, 2
                (2,): 3,       # and 1 through its second candidate
                (1, 1): 4,     # depth 2 under a right first draft at j judges j + 1: 0 -> 1 (6), 2 -> 3 (8)
                (2, 2): 5}     # nothing more under a draft accepted through its second candidate
    wrong = [shape for shape, n in expected.items() if potential.accepted(guesses, shape) != (n, 4)]
    assert bool(wrong) == broken, wrong
