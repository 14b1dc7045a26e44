"""How often a row's drafts are accepted: censored, decaying estimates with a pooled prior.

The yield model is one per-position acceptance alpha: a round drafting k tokens is
expected to emit E(alpha, k) = 1 + alpha + ... + alpha^k tokens (the bonus or recovered
token included). A round that drafted k and accepted a is, under that model, a successes
and one failure when a < k; a fully accepted round has no failure: the first rejection
was not reached (censored), so counting it as one would bias alpha down exactly where
drafting pays most. alpha's estimate is (S + w * prior) / (S + F + w).

Estimates are kept per request and per offer key (n-gram: the length of the matched
suffix, which separates acceptance from ~0.2 at n = 1 to ~0.8 at n = 4), each with the
proposer's pooled estimate for that key as its prior. Evidence decays with the tokens
drafted: an answer moves between copying and writing, and old rounds say less about the
next one. (A request parked at k = 0 gets no new evidence and keeps its estimate:
relaxing it toward the pool measured no gain on 128-token answers.)
"""
from __future__ import annotations

from collections.abc import Hashable

# A request's evidence halves every 32 drafted tokens: a few rounds at k = 4 outweigh the
# past, about as fast as an answer changes phase.
HALF_LIFE_TOKENS = 32.0
# The pool is many requests' history: slow, so one odd request barely moves it.
POOL_HALF_LIFE_TOKENS = 2048.0
# The prior counts as 4 drafted tokens: one round of the request's own outweighs it.
PRIOR_WEIGHT = 4.0
# Before any evidence at all: even odds for each drafted token.
COLD_ALPHA = 0.5


def expected_tokens(alpha: float, k: int) -> float:
    """E(alpha, k): tokens a round emits with k drafts, the always-emitted one included."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Counts:
    """Decayed successes and failures of per-position acceptance."""

    __slots__ = ("successes", "failures")

    def __init__(self) -> None:
        self.successes = 0.0
        self.failures = 0.0

    def observe(self, drafted: int, accepted: int, half_life: float) -> None:
        keep = 0.5 ** (drafted / half_life)
        self.successes = self.successes * keep + accepted
        self.failures = self.failures * keep + (1.0 if accepted < drafted else 0.0)

    def alpha(self, prior: float, weight: float) -> float:
        return (self.successes + weight * prior) / (self.successes + self.failures + weight)


class AcceptanceModel:
    """alpha per (request, proposer, key), with the (proposer, key) pool as each one's prior
    (a request under "auto" drafts with several proposers, whose keys mean different things)."""

    def __init__(self) -> None:
        self._requests: dict[str, dict[tuple[str, Hashable], Counts]] = {}
        self._pools: dict[tuple[str, Hashable], Counts] = {}

    def prior(self, proposer: str, key: Hashable) -> float:
        pool = self._pools.get((proposer, key))
        return COLD_ALPHA if pool is None else pool.alpha(COLD_ALPHA, PRIOR_WEIGHT)

    def alpha(self, request_id: str, proposer: str, key: Hashable) -> float:
        counts = self._requests.get(request_id, {}).get((proposer, key))
        prior = self.prior(proposer, key)
        return prior if counts is None else counts.alpha(prior, PRIOR_WEIGHT)

    def observe(self, request_id: str, proposer: str, key: Hashable, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted or drafted < 1:
            raise ValueError(f"need 0 <= accepted <= drafted and drafted >= 1, got {accepted}, {drafted}")
        own = self._requests.setdefault(request_id, {}).setdefault((proposer, key), Counts())
        own.observe(drafted, accepted, HALF_LIFE_TOKENS)
        self._pools.setdefault((proposer, key), Counts()).observe(drafted, accepted, POOL_HALF_LIFE_TOKENS)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def snapshot(self) -> dict:
        return {f"{p}/{k}": round(c.alpha(COLD_ALPHA, PRIOR_WEIGHT), 4) for (p, k), c in self._pools.items()}
