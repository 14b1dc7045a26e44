"""The proposer interface: every proposer returns a `Draft`."""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class Draft(NamedTuple):
    """k proposed tokens per row, with the proposer's distribution when it has one.

    tokens: (B, k) int64 proposed token ids.
    probs:  (B, k, V) float32 draft distribution q at each position, already passed through
            the same `logits_to_probs` as the target; None for proposers without
            probabilities (n-gram), which the rejection sampler treats as one-hot q.
    num_tokens: (B,) int64 how many of the k tokens of each row are real proposals (a
            row may propose fewer, e.g. n-gram with no match); None means all k.
            Entries past a row's num_tokens are padding and are never verified.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    num_tokens: torch.Tensor | None = None


class Proposer(Protocol):
    name: str

    def propose(self, batch, k: int) -> Draft:
        """Propose k tokens for every row of `batch`."""
        ...
