"""Sampling parameters and the one function that turns logits into a distribution.

`logits_to_probs` is applied identically to the target's and the draft's logits, so the
rejection sampler compares like with like. Temperature 0 yields a one-hot distribution
(argmax) that goes through the same rejection sampler; the engine computes the same result
from argmaxes alone when a whole batch is greedy (`spec.rejection.greedy_accept`; its tensor
form `greedy_verify` is what the tests hold against the sampler).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# Temperatures below this sample greedily (the T -> 0 limit). logits / T overflows float32
# once T is below about 1e-37, which made every probability NaN and the answer empty; at
# 1e-5 a logit gap of 1e-3 already leaves the runner-up e^-100 of the mass. vLLM draws
# the same line.
MIN_TEMPERATURE = 1e-5


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

        if 0 < self.temperature < MIN_TEMPERATURE:  # the limit, without float32 overflow
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# --------------------------------------------------------------------------------------
# Per-step tensors and logits -> probabilities
#
# `import verispec` re-exports SamplingParams and must stay cheap (no torch) for the CLI,
# so the tensor code below imports torch inside each function (a dict lookup once loaded).
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingTensors:
    """The sampling settings of one step's rows as device tensors, built once per step.

    The two flags are decided on the host from the SamplingParams, so choosing the fast
    path in `logits_to_probs` never reads a device tensor back (no sync).
    """

    temperature: torch.Tensor  # (N,) float32, 0 = greedy
    top_k: torch.Tensor        # (N,) int64, 0 = disabled
    top_p: torch.Tensor        # (N,) float32, 1 = disabled
    min_p: torch.Tensor        # (N,) float32, 0 = disabled
    use_sort: bool             # some row needs top-k or top-p (the sort)
    use_min_p: bool            # some row needs min-p

    @classmethod
    def from_params(cls, params_list: Sequence[SamplingParams], device) -> "SamplingTensors":
        """One row per SamplingParams, in order."""
        import torch

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=tensor([float(p.temperature) for p in params_list], torch.float32),
            top_k=tensor([p.top_k for p in params_list], torch.int64),
            top_p=tensor([float(p.top_p) for p in params_list], torch.float32),
            min_p=tensor([float(p.min_p) for p in params_list], torch.float32),
            use_sort=any(p.top_k > 0 or p.top_p < 1 for p in params_list),
            use_min_p=any(p.min_p > 0 for p in params_list),
        )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def expand(self, counts: int | Sequence[int] | torch.Tensor) -> "SamplingTensors":
        """Repeat row i counts[i] times (or `counts` times each): one row per scored position.

        Verify rows score k_i + 1 positions each. An int or a host list costs no sync; a
        device tensor of counts is read back to the host (a sync) to size the output.
        """
        import torch

        if isinstance(counts, int):
            if counts < 0:
                raise ValueError(f"counts must be >= 0, got {counts}")
            repeats, total = counts, self.num_rows * counts
        else:
            host = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
            if len(host) != self.num_rows or any(c < 0 for c in host):
                raise ValueError(f"counts must be {self.num_rows} integers >= 0, got {host}")
            repeats = torch.tensor(host, dtype=torch.int64, device=self.temperature.device)
            total = sum(host)

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(repeats, dim=0, output_size=total)

        return SamplingTensors(rep(self.temperature), rep(self.top_k), rep(self.top_p),
                               rep(self.min_p), self.use_sort, self.use_min_p)

    def to_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits_to_probs` with these rows' settings; logits (N, V) -> probs (N, V)."""
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p,
                               use_sort=self.use_sort, use_min_p=self.use_min_p)


def logits_to_probs(
    logits: torch.Tensor,       # (N, V) any float dtype
    temperature: torch.Tensor,  # (N,) 0 = greedy
    top_k: torch.Tensor,        # (N,) int, 0 (or >= V) = disabled
    top_p: torch.Tensor,        # (N,) in (0, 1], 1 = disabled
    min_p: torch.Tensor,        # (N,) in [0, 1], 0 = disabled
    *,
    use_sort: bool | None = None,
    use_min_p: bool | None = None,
) -> torch.Tensor:              # (N, V) float32, rows sum to 1
    """Turn logits into the distribution a row samples from; the same for target and draft.

    Order: temperature, top-k, top-p (smallest set of mass >= top_p, top token always
    kept), min-p (keep p >= min_p * p_max), renormalise. Temperature-0 rows become one-hot
    at the argmax (ties -> lowest index). Ties at the top-k / top-p boundary are broken
    by lower token index. `use_sort` / `use_min_p` say whether any row needs that stage;
    None decides from the tensors (a device sync on GPU; `SamplingTensors` knows on the host).
    """
    import torch

    logits = logits.float()
    greedy = temperature == 0                                                 # (N,)
    scaled = logits / torch.where(greedy, 1.0, temperature.float())[:, None]  # (N, V)
    if use_sort is None:
        use_sort = bool(((top_k > 0) | (top_p < 1)).any())
    if use_sort:
        scaled = scaled.masked_fill(_top_k_top_p_removed(scaled, top_k, top_p), float("-inf"))
    probs = scaled.softmax(dim=-1)                                            # (N, V)
    if use_min_p is None:
        use_min_p = bool((min_p > 0).any())
    if use_min_p:
        # p / p_max is unchanged by the earlier renormalisation, so this is min-p on the
        # top-k/top-p distribution, as specified.
        p_max = probs.amax(dim=-1, keepdim=True)                              # (N, 1)
        probs = probs * (probs >= min_p.float()[:, None] * p_max)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _top_k_top_p_removed(scaled: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor) -> torch.Tensor:
    """Mask (N, V) of tokens that top-k then top-p remove, from one descending sort."""
    import torch

    vocab = scaled.shape[-1]
    # stable: equal logits keep index order, so boundary ties go to the lower token id.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # (N, V)
    rank = torch.arange(vocab, device=scaled.device)                         # (V,)
    removed = (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])       # (N, V) sorted
    sorted_probs = sorted_logits.masked_fill(removed, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs                 # (N, V)
    # Keep a token while the mass strictly before it is < top_p: the smallest prefix of
    # mass >= top_p, and rank 0 always (mass 0). top_p == 1 rows skip the test, so
    # rounding in the cumsum can never drop a tail token there.
    top_p = top_p.float()[:, None]
    removed |= (top_p < 1) & (mass_before >= top_p) & (rank[None, :] > 0)
    return torch.empty_like(removed).scatter_(-1, order, removed)            # (N, V) vocab order


# --------------------------------------------------------------------------------------
# Sampling noise: seeded rows by position, the rest from a shared stream; sync-free
# --------------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def noise_seed(seed: int, position: int) -> int:
    """The seed of the noise at output position `position` of a request seeded `seed`.

    torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so the 64-bit
    hash of (seed, position) is folded to 32 bits: two distinct keys share a noise vector
    with probability 2^-32.
    """
    z = _mix64(_mix64(seed) ^ _mix64(position + 0x9E3779B97F4A7C15))
    return (z ^ (z >> 32)) & 0xFFFFFFFF


def seeded_uniform(keys: Sequence[tuple[int, int]], width: int, device) -> torch.Tensor:
    """Uniforms u(seed, j, v) in [0, 1) for each key (seed, j): (len(keys), width) float32.

    A pure function of (seed, j, v): a generator seeded with `noise_seed(seed, j)` draws
    the row on the CPU (the first `width` values of one stream, so any width agrees on
    its common prefix), whatever else is in the batch, whatever drew before.
    """
    import torch

    generator = torch.Generator()
    rows = [torch.rand(width, generator=generator.manual_seed(noise_seed(s, j))) for s, j in keys]
    return torch.stack(rows).to(device) if rows else torch.empty(0, width, device=device)


def draw_uniform(
    num_rows: int,
    width: int,
    device,
    *,
    keys: Sequence[tuple[int, int] | None] | None = None,
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:  # (num_rows, width) float32 in [0, 1)
    """Uniform noise, one row per request: row i is `seeded_uniform(keys[i])` where keys[i]
    = (seed, output position) is given, else drawn from `shared_generator` (None = torch's
    default), all such rows in one call."""
    import torch

    if keys is None or all(k is None for k in keys):
        return torch.rand(num_rows, width, device=device, generator=shared_generator)
    if len(keys) != num_rows:
        raise ValueError(f"keys must have one entry per row ({num_rows}), got {len(keys)}")
    seeded = [i for i, k in enumerate(keys) if k is not None]
    shared = [i for i, k in enumerate(keys) if k is None]
    noise = torch.empty(num_rows, width, device=device)
    noise[seeded] = seeded_uniform([keys[i] for i in seeded], width, device)
    if shared:
        noise[shared] = torch.rand(len(shared), width, device=device, generator=shared_generator)
    return noise


def race(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax_x p(x) / E(x), E ~ Exp(1), picks x with probability p(x).

    probs (N, V) need not be normalised (the race is scale-invariant); uniform (N, V) in
    [0, 1). E = -log(u) with u floored at the smallest normal float, so E is finite and
    > 0: a token with p > 0 always beats every token with p = 0 (a one-hot row returns
    its argmax, always), and 0 / E never makes a NaN. It is the Gumbel-max rule
    argmax log p(x) + G(x), G = -log E. Returns (N,) int64, no host sync.
    """
    import torch

    exponential = -torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny))  # (N, V)
    return (probs / exponential).argmax(dim=-1)


def sample(
    probs: torch.Tensor,  # (N, V)
    keys: Sequence[tuple[int, int] | None] | None = None,  # per row (seed, position), None = shared
    *,
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:        # (N,) int64
    """Draw one token per row from probs by the race. A row keyed (seed, j) draws
    race(p, u(seed, j)): a pure function of its probabilities, seed and output position."""
    uniform = draw_uniform(probs.shape[0], probs.shape[1], probs.device, keys=keys,
                           shared_generator=shared_generator)
    return race(probs, uniform)


def noise_key(params: SamplingParams, position: int) -> tuple[int, int] | None:
    """The noise key of a row sampling output position `position`: (seed, position) for a
    seeded sampled row, None (the shared stream) for unseeded and greedy rows."""
    if params.seed is None or params.greedy:
        return None
    return (params.seed, position)
