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

from verispec.structured.spec import StructuredOutput, StructuredOutputsParams

if TYPE_CHECKING:
    import torch


# Temperatures below this sample greedily (the T -> 0 limit). logits / T overflows float32
# once T is below about 1e-37, which made every probability NaN and the answer empty; at
# 1e-5 a logit gap of 1e-3 already leaves the runner-up e^-100 of the mass. vLLM draws
# the same line.
MIN_TEMPERATURE = 1e-5
# The most alternatives a request may ask for per token (OpenAI's and vLLM's bound).
MAX_LOGPROBS = 20


class _FrozenBias(dict):
    """`logit_bias` as a read-only, hashable dict {token id: bias} (SamplingParams is hashable)."""

    def __hash__(self):  # type: ignore[override]
        return hash(frozenset(self.items()))

    def _read_only(self, *args, **kwargs):
        raise TypeError("SamplingParams.logit_bias is read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; validated on construction (ValueError naming the field).

    Logits processors, applied in this order to the logits of every position before
    temperature and the filters (vLLM's semantics and ranges):

    - logit_bias {token id: bias in [-100, 100]}: added to that token's logit (OpenAI).
    - repetition_penalty > 0 (1 = off): a token seen in the prompt or the output has its
      logit divided by it when positive, multiplied by it otherwise.
    - frequency_penalty, presence_penalty in [-2, 2] (0 = off): logit[t] -= frequency *
      count(t) + presence * (count(t) > 0), count over OUTPUT tokens only.
    - min_tokens >= 0: while fewer output tokens than this exist, EOS (unless ignore_eos)
      and stop_token_ids get probability 0.
    - structured (a StructuredOutput): tokens the constraint does not admit after the
      output so far get probability 0 (`verispec.structured`). Where min_tokens would ban
      every token the constraint admits, the constraint wins.

    stop_token_ids end the request like EOS (the id is kept in the output, finish_reason
    "stop"). top_k = -1 means disabled, like 0 (stored as 0).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Log-probabilities to return: None = none (the fast path, nothing computed); N in
    # [0, MAX_LOGPROBS] = each emitted token's logprob and the N most likely alternatives
    # (`token_logprobs` states the convention).
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    # Completions per prompt (the LLM API's, vLLM's `n`; the server's `n` field is the same
    # rule): choice j of a seeded request is seeded seed + j (`request.choice_params`).
    # best_of is vLLM's; verispec ranks no extra candidates, so it must be None or n.
    n: int = 1
    best_of: int | None = None
    # vLLM's spellings of `structured` (a StructuredOutputsParams); turned into `structured`
    # on construction and then None, so only `structured` travels to the engine.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        elif self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        if self.top_k == -1 and not isinstance(self.top_k, bool):  # vLLM's and llama.cpp's "disabled"
            object.__setattr__(self, "top_k", 0)
        self._check_processors()
        self._adopt_vllm_constraint()
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0,
               f"top_k must be an integer >= 1, or 0 or -1 to disable it, got {self.top_k!r}")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0,
               f"max_tokens must be an integer > 0, got {self.max_tokens!r}")
        _check(self.seed is None or isinstance(self.seed, int),
               f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.best_of is None or self.best_of == self.n,
               f"best_of must equal n ({self.n}) or be None (verispec does not rank extra candidates), "
               f"got {self.best_of!r}")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput),
               f"structured must be a StructuredOutput, got {self.structured!r}")

        if 0 < self.temperature < MIN_TEMPERATURE:  # the limit, without float32 overflow
            object.__setattr__(self, "temperature", 0.0)

    def _adopt_vllm_constraint(self) -> None:
        given = [n for n in ("structured_outputs", "guided_decoding") if getattr(self, n) is not None]
        if not given:
            return
        _check(len(given) == 1 and self.structured is None,
               "give one of structured, structured_outputs and guided_decoding")
        value = getattr(self, given[0])
        _check(isinstance(value, StructuredOutputsParams),
               f"{given[0]} must be a StructuredOutputsParams, got {type(value).__name__}")
        object.__setattr__(self, "structured", value.to_structured())
        object.__setattr__(self, given[0], None)

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_number(v) and -2 <= v <= 2, f"{name} must be a number in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        _check(_is_number(v) and v > 0 and v != float("inf"),
               f"repetition_penalty must be a number > 0 (1 disables it), got {v!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.min_tokens <= self.max_tokens if _is_int(self.max_tokens) else True,
               f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        bias = self.logit_bias
        if bias is not None:
            _check(isinstance(bias, dict) and all(_is_int(t) and t >= 0 for t in bias),
                   f"logit_bias must map token ids (integers >= 0) to biases, got {bias!r}")
            _check(all(_is_number(b) and -100 <= b <= 100 for b in bias.values()),
                   f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
            object.__setattr__(self, "logit_bias", _FrozenBias({t: float(b) for t, b in bias.items()}) or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor is on (rows without one skip that stage entirely)."""
        return self.has_token_processors or self.structured is not None

    @property
    def has_token_processors(self) -> bool:
        """Whether a processor that touches single tokens is on (all but `structured`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _device_tensor(values, dtype, device):
    """`values` as a tensor on `device`; the copy from the host does not wait for the
    device (a GPU stream orders it before the kernels that read it: no sync)."""
    import torch

    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN


# --------------------------------------------------------------------------------------
# Per-step tensors and logits -> probabilities
#
# `import verispec` re-exports SamplingParams and must stay cheap (no torch) for the CLI,
# so the tensor code below imports torch inside each function (a dict lookup once loaded).
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _History:
    """What a logits processor reads for one scored position (host side).

    `prompt` and `output` are the request's committed ids, `drafted` the tokens treated as
    generated before this position (a verify row's d_1..d_{i-1}, a draft model's own
    drafts): penalties and min_tokens see output + drafted, exactly as plain decoding would.
    `grammar` is the request's structured-output state (`RequestGrammar`), None without one.
    """

    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]
    stop_ids: frozenset  # what min_tokens bans: EOS (unless ignore_eos) and stop_token_ids
    drafted: tuple[int, ...] = ()
    grammar: object = None


@dataclass(frozen=True)
class SamplingTensors:
    """The sampling settings of one step's rows as device tensors, built once per step.

    The flags are decided on the host from the SamplingParams, so choosing the fast path
    in `logits_to_probs` never reads a device tensor back (no sync). `history` is None
    when no row has a logits processor (the fast path: nothing is built or applied); else
    one `_History` (or None) per row, turned into sparse tensors by `process`.
    """

    temperature: torch.Tensor  # (N,) float32, 0 = greedy
    top_k: torch.Tensor        # (N,) int64, 0 = disabled
    top_p: torch.Tensor        # (N,) float32, 1 = disabled
    min_p: torch.Tensor        # (N,) float32, 0 = disabled
    use_sort: bool             # some row needs top-k or top-p (the sort)
    use_min_p: bool            # some row needs min-p
    history: tuple[_History | None, ...] | None = None

    @classmethod
    def from_params(cls, params_list: Sequence[SamplingParams], device,
                    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                    eos_ids: Sequence[int] = (), grammars: Sequence | None = None) -> "SamplingTensors":
        """One row per SamplingParams, in order. `histories[i]` = (prompt ids, output ids)
        of row i, required when a row has a logits processor; `eos_ids` are what min_tokens
        bans besides stop_token_ids; `grammars[i]` is row i's RequestGrammar, required when
        its params are structured. Output ids are read at `process` time: pass a copy if
        they may grow before."""
        import torch

        def tensor(values, dtype):
            return _device_tensor(values, dtype, device)

        history = None
        if any(p.has_processors for p in params_list):
            if histories is None or len(histories) != len(params_list):
                raise ValueError("logits processors need one (prompt, output) history per row")
            if any(p.structured is not None for p in params_list) and (
                    grammars is None or any(p.structured is not None and g is None
                                            for p, g in zip(params_list, grammars))):
                raise ValueError("a structured-output row needs its RequestGrammar")
            history = tuple(_History(p, h[0], h[1], _banned_by_min_tokens(p, eos_ids),
                                     grammar=grammars[i] if p.structured is not None else None)
                            if p.has_processors else None
                            for i, (p, h) in enumerate(zip(params_list, histories)))
        return cls(
            temperature=tensor([float(p.temperature) for p in params_list], torch.float32),
            top_k=tensor([p.top_k for p in params_list], torch.int64),
            top_p=tensor([float(p.top_p) for p in params_list], torch.float32),
            min_p=tensor([float(p.min_p) for p in params_list], torch.float32),
            use_sort=any(p.top_k > 0 or p.top_p < 1 for p in params_list),
            use_min_p=any(p.min_p > 0 for p in params_list),
            history=history,
        )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def expand(self, counts: int | Sequence[int] | torch.Tensor,
               drafts: Sequence[Sequence[int]] | None = None) -> "SamplingTensors":
        """Repeat row i counts[i] times (or `counts` times each): one row per scored position.

        Verify rows score k_i + 1 positions each: [pending, d_1..d_k] scores the output
        positions n, n + 1, ..., n + k. Position j of row i is processed as if drafts[i][:j]
        had been generated (drafts are needed when a row has a logits processor). An int or
        a host list costs no sync; a device tensor of counts is read back to size the output.
        """
        import torch

        if isinstance(counts, int):
            if counts < 0:
                raise ValueError(f"counts must be >= 0, got {counts}")
            repeats, total, host = counts, self.num_rows * counts, [counts] * self.num_rows
        else:
            host = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
            if len(host) != self.num_rows or any(c < 0 for c in host):
                raise ValueError(f"counts must be {self.num_rows} integers >= 0, got {host}")
            repeats = _device_tensor(host, torch.int64, self.temperature.device)
            total = sum(host)

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(repeats, dim=0, output_size=total)

        history = None
        if self.history is not None:
            history = tuple(_at_position(h, drafts[i] if drafts is not None else None, j)
                            for i, (h, c) in enumerate(zip(self.history, host)) for j in range(c))
        return SamplingTensors(rep(self.temperature), rep(self.top_k), rep(self.top_p),
                               rep(self.min_p), self.use_sort, self.use_min_p, history)

    def select(self, index: Sequence[int]) -> "SamplingTensors":
        """The rows `index`, in that order (host list: no sync)."""
        import torch

        idx = _device_tensor(list(index), torch.int64, self.temperature.device)
        history = None if self.history is None else tuple(self.history[i] for i in index)
        if history is not None and all(h is None for h in history):
            history = None
        return SamplingTensors(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                               self.use_sort, self.use_min_p, history)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after every row's processors, float32 (the input itself when none)."""
        if self.history is None:
            return logits
        return apply_processors(logits, self.history)

    def to_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits_to_probs` with these rows' settings, after their logits processors;
        logits (N, V) -> probs (N, V). Greedy rows are one-hot at the processed argmax."""
        return logits_to_probs(self.process(logits), self.temperature, self.top_k, self.top_p,
                               self.min_p, use_sort=self.use_sort, use_min_p=self.use_min_p)


def _banned_by_min_tokens(params: SamplingParams, eos_ids: Sequence[int]) -> frozenset:
    if not params.min_tokens:
        return frozenset()
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))


def _at_position(h: _History | None, drafts: Sequence[int] | None, j: int) -> _History | None:
    """Row history h at its j-th scored position: the first j drafts count as generated."""
    if h is None or j == 0:
        return h
    if drafts is None or len(drafts) < j:
        raise ValueError("a verify row with logits processors needs its draft tokens")
    return _History(h.params, h.prompt, h.output, h.stop_ids, h.drafted + tuple(drafts[:j]), h.grammar)


def _position_entries(h: _History) -> tuple[list[int], list[float], list[bool], list[float], list[bool]]:
    """The tokens a processor touches at one position, and per token: output count (with
    the drafts), seen in prompt or output (repetition penalty), bias, banned (min_tokens)."""
    from collections import Counter

    p = h.params
    counts = Counter(h.output)
    counts.update(h.drafted)
    seen = set()
    if p.repetition_penalty != 1:
        seen = set(h.prompt) | set(counts)
    bias = p.logit_bias or {}
    banned = h.stop_ids if len(h.output) + len(h.drafted) < p.min_tokens else frozenset()
    tokens = list(set(counts) | seen | set(bias) | banned)
    return (tokens, [float(counts.get(t, 0)) for t in tokens], [t in seen for t in tokens],
            [bias.get(t, 0.0) for t in tokens], [t in banned for t in tokens])


def apply_processors(logits: torch.Tensor, history: Sequence[_History | None]) -> torch.Tensor:
    """(N, V) logits -> float32 logits after each row's processors (`SamplingParams`).

    Sparse: only the tokens a row's history, bias or min_tokens touches are gathered,
    changed and scattered back; rows with history None are copied unchanged. Each row's
    token list is padded by repeating its first entry, so padded scatters write the same
    value twice. Structured rows are then masked to what their constraint admits.
    """
    logits = logits.float()
    rows = [i for i, h in enumerate(history) if h is not None]
    if not rows:
        return logits
    sparse = [i for i in rows if history[i].params.has_token_processors]
    processed = _apply_sparse(logits, history, sparse) if sparse else logits
    constrained = [i for i in rows if history[i].grammar is not None]
    return _apply_grammars(logits, processed, history, constrained) if constrained else processed


def _apply_grammars(raw: torch.Tensor, processed: torch.Tensor, history: Sequence[_History | None],
                    rows: list[int]) -> torch.Tensor:
    """`processed` with each structured row's disallowed tokens at -inf. A row whose every
    admitted token min_tokens banned gets its admitted tokens' unprocessed logits instead:
    the output must stay inside the constraint, and -inf everywhere has no distribution."""
    import torch

    from verispec.structured.grammar import allowed_tokens

    refused = ~allowed_tokens([(h.grammar, list(h.output[h.grammar.committed:]) + list(h.drafted))
                               for h in (history[i] for i in rows)], raw.shape[-1]).to(raw.device, non_blocking=True)
    whole = len(rows) == raw.shape[0]  # every row constrained (batch 1): no gather/scatter
    rows_t = None if whole else _device_tensor(rows, torch.int64, raw.device)
    masked = (processed if whole else processed.index_select(0, rows_t)).masked_fill(refused, float("-inf"))
    if any(history[i].params.min_tokens for i in rows):
        empty = torch.isneginf(masked).all(dim=-1, keepdim=True)                  # (R, 1)
        unbanned = (raw if whole else raw.index_select(0, rows_t)).float().masked_fill(refused, float("-inf"))
        masked = torch.where(empty, unbanned, masked)
    return masked if whole else processed.index_copy(0, rows_t, masked)


def _apply_sparse(logits: torch.Tensor, history: Sequence[_History | None], rows: list[int]) -> torch.Tensor:
    """Penalties, logit_bias and min_tokens on `rows` (see `apply_processors`)."""
    import torch

    entries = [_position_entries(history[i]) for i in rows]
    width = max(1, max(len(e[0]) for e in entries))

    def pad(values, fill):
        return values + [values[0] if values else fill] * (width - len(values))
    dev = logits.device
    idx = _device_tensor([pad(e[0], 0) for e in entries], torch.int64, dev)      # (R, U)
    count = _device_tensor([pad(e[1], 0.0) for e in entries], torch.float32, dev)
    seen = _device_tensor([pad(e[2], False) for e in entries], torch.bool, dev)
    bias = _device_tensor([pad(e[3], 0.0) for e in entries], torch.float32, dev)
    banned = _device_tensor([pad(e[4], False) for e in entries], torch.bool, dev)
    params = [history[i].params for i in rows]

    def column(name):
        return _device_tensor([float(getattr(p, name)) for p in params], torch.float32, dev)[:, None]  # (R, 1)
    rows_t = _device_tensor(rows, torch.int64, dev)
    sub = logits.index_select(0, rows_t)                                                     # (R, V)
    vals = sub.gather(1, idx) + bias
    rep = column("repetition_penalty")
    vals = torch.where(seen, torch.where(vals > 0, vals / rep, vals * rep), vals)
    vals = vals - column("frequency_penalty") * count - column("presence_penalty") * (count > 0)
    vals = vals.masked_fill(banned, float("-inf"))
    return logits.index_copy(0, rows_t, sub.scatter(1, idx, vals))  # out of place: input unchanged


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

    if use_sort is None:
        use_sort = bool(((top_k > 0) | (top_p < 1)).any())
    scaled, greedy = _scaled_and_cut(logits, temperature, top_k, top_p, use_sort)
    probs = scaled.softmax(dim=-1)                                            # (N, V)
    if use_min_p is None:
        use_min_p = bool((min_p > 0).any())
    if use_min_p:
        # p / p_max is unchanged by the earlier renormalisation, so this is min-p on the
        # top-k/top-p distribution, as specified.
        p_max = probs.amax(dim=-1, keepdim=True)                              # (N, 1)
        probs = probs * (probs >= min_p.float()[:, None] * p_max)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    # a greedy row's `scaled` is its logits (divided by 1, uncut): the argmax is theirs
    one_hot = torch.zeros_like(probs).scatter_(-1, scaled.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _scaled_and_cut(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, use_sort: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logits / T with the top-k / top-p removals at -inf, the greedy rows). Greedy
    rows are divided by 1 and not cut: `logits_to_probs` replaces them with a one-hot and
    `token_logprobs` reports them unfiltered; both share these stages exactly."""
    import torch

    greedy = temperature == 0                                                 # (N,)
    scaled = logits.float() / torch.where(greedy, 1.0, temperature.float())[:, None]  # (N, V)
    if use_sort:
        removed = _top_k_top_p_removed(scaled, top_k, top_p) & ~greedy[:, None]
        scaled = scaled.masked_fill(removed, float("-inf"))
    return scaled, greedy


def token_logprobs(st: SamplingTensors, logits: torch.Tensor, tokens: Sequence[int],
                   num_top: Sequence[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row: (log-probability of tokens[i], the num_top[i] most likely (token id, logprob)),
    under the distribution the row samples / verifies from.

    The convention (docs/serving.md, "logprobs and n"): a sampled row reports the log of
    its processed distribution: logits processors, temperature, top-k, top-p and min-p,
    renormalised (vLLM's "processed_logprobs"); a token those filters removed has -inf
    (the server writes -9999.0). A greedy row (temperature 0), whose distribution is
    one-hot, reports log_softmax of its logits after the processors (penalties, bias,
    min_tokens), at temperature 1 and unfiltered, so the values stay finite. The masks are
    the sampler's own (same stages, same inputs), so the support is exactly what it draws
    from. Alternatives are ordered by logprob, ties to the lower id. (N, V) logits -> N rows;
    one device->host copy.
    """
    import torch

    scaled, greedy = _scaled_and_cut(st.process(logits), st.temperature, st.top_k, st.top_p, st.use_sort)
    if st.use_min_p:
        probs = scaled.softmax(dim=-1)
        keep = probs >= st.min_p.float()[:, None] * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(~keep & ~greedy[:, None], float("-inf"))
    logp = scaled.log_softmax(dim=-1)                                         # (N, V)
    index = _device_tensor(list(tokens), torch.int64, logp.device)
    chosen = logp.gather(1, index[:, None]).squeeze(1).tolist()
    width = max(num_top, default=0)
    if width == 0:
        return [(lp, []) for lp in chosen]
    values, ids = logp.topk(min(width, logp.shape[-1]), dim=-1)  # not a V-wide sort
    out = []
    for lp, v, t, n in zip(chosen, values.tolist(), ids.tolist(), num_top):
        top = sorted(zip(t, v), key=lambda e: (-e[1], e[0]))  # ties: lower id first
        out.append((lp, top[:n]))
    return out


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
    return torch.stack(rows).to(device, non_blocking=True) if rows else torch.empty(0, width, device=device)


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
