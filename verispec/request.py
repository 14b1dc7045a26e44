"""Request state: token ids, how much KV is computed, status, per-request speculation stats.

Pure Python. Positions [0, num_computed) of `all_ids` hold the target's verified KV; the
last token of a decoding request is *pending*: known, but its KV is computed by the next
verify pass (it is that pass's first query).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from verispec.outputs import SpecStats
from verispec.sampling import SamplingParams


@dataclass(frozen=True)
class SpecOverride:
    """Per-request speculation control (the server's `speculative` field); None: the engine's."""

    method: str | None = None        # "ngram" | "draft" | "none"
    num_tokens: int | None = None    # k (k_max when adaptive)
    adaptive: bool | None = None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index` of a request for n choices (the server's `n`, the LLM
    API's SamplingParams.n): with a seed s it is seeded s + index, so that choice equals an
    independent request seeded s + index; unseeded choices sample independently."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


class Status(enum.Enum):
    WAITING = "waiting"      # not yet admitted, or preempted and waiting to recompute
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: a request is one live object
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec_method: str                 # "none", "auto" or a proposer's name
    num_spec_tokens: int             # k_max for this request
    adaptive: bool
    arrival: int                     # FCFS order
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0            # target KV positions holding verified tokens
    draft_computed: int = 0          # draft-model KV positions holding verified tokens
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at first admission
    scheduled_at: float | None = None      # time.monotonic() of the first admission (first chunk scheduled)
    stats: SpecStats = field(default_factory=SpecStats)
    drafter: str | None = None       # the proposer offering this round (AUTO's pick, or spec_method)
    # Text emitted so far (stop strings applied) and the engine's per-request detokenizer
    # live here so preemption and recompute keep them.
    text: str = ""
    held_text: str = ""              # decoded but not yet emitted: may start a stop string
    detokenizer: object = None
    # (logprob, [(token id, logprob), ...]) per output token, when params.logprobs is set
    logprobs: list | None = None
    # The structured-output state (verispec.structured.grammar.RequestGrammar) when
    # params.structured is set: it has consumed exactly the output tokens.
    grammar: object = None

    def __post_init__(self) -> None:
        self._all_ids = self.prompt_ids + self.output_ids

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output: one list kept up to date by `append_output` (read for every
        row of every step; building it per read cost ~5 us a row at 800 tokens). Read-only."""
        return self._all_ids

    def append_output(self, token: int) -> None:
        """The one way output grows (`all_ids` follows)."""
        self.output_ids.append(token)
        self._all_ids.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """KV positions to compute before decoding: all tokens, or all but the pending one."""
        return self.num_tokens - 1 if self.output_ids else self.num_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
