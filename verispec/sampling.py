"""Sampling parameters and the one function that turns logits into a distribution.

`logits_to_probs` is applied identically to the target's and the draft's logits, so the
rejection sampler compares like with like. Temperature 0 yields a one-hot distribution
(argmax) that goes through the same rejection sampler: there is no separate greedy path.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; validated on construction."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0,
               f"max_tokens must be an integer > 0, got {self.max_tokens!r}")
        _check(self.seed is None or isinstance(self.seed, int),
               f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
