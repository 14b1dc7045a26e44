"""A proposer written for tests only, to show that adding one is this file plus one
`register_proposer` line: it drafts "the token after the last one" (t + 1 mod V), right
only by chance, and claims to cost time so the policy's timed path runs too."""
from __future__ import annotations

from verispec.spec.proposer import Offer, ProposerContext


class CountingProposer:
    name = "counting"
    timed = True
    has_probs = False

    def __init__(self, context: ProposerContext):
        self.vocab = 48  # the tests' tiny vocabulary
        self.calls: dict[str, int] = {"offer": 0, "prepare": 0, "draft": 0, "rollback": 0, "forget": 0}

    def offer(self, rows, budgets):
        self.calls["offer"] += 1
        return [Offer(b) for b in budgets]

    def prepare(self, rows) -> int:
        self.calls["prepare"] += 1
        return 0

    def draft(self, rows, ks):
        self.calls["draft"] += 1
        return [([(r.all_ids[-1] + 1 + j) % self.vocab for j in range(k)], None) for r, k in zip(rows, ks)]

    def rollback(self, req) -> None:
        self.calls["rollback"] += 1

    def forget(self, request_id: str) -> None:
        self.calls["forget"] += 1
