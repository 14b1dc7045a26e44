"""Results the engine hands back: per-request output and speculation statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Speculation counters for one request (all counts are tokens unless named)."""

    num_drafts: int = 0            # verify rounds that had k >= 1
    num_draft_tokens: int = 0      # sum of k over those rounds
    num_accepted_tokens: int = 0   # draft tokens the target accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = accepted at draft pos i
    drafted_per_position: list[int] = field(default_factory=list)   # [i] = drafted at draft pos i
    target_forwards: int = 0       # target passes (prefill chunks + decode/verify rounds)
    # proposer -> [draft tokens, accepted]: which proposer drafted (method "auto" has several)
    by_proposer: dict[str, list[int]] = field(default_factory=dict)

    def record_round(self, k: int, accepted_len: int, proposer: str | None = None) -> None:
        """Count one verify round that drafted k tokens (with `proposer`) and accepted the
        first accepted_len."""
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted_len
        if proposer is not None:
            counts = self.by_proposer.setdefault(proposer, [0, 0])
            counts[0] += k
            counts[1] += accepted_len
        for counts, n in ((self.drafted_per_position, k), (self.accepted_per_position, accepted_len)):
            if len(counts) < k:
                counts.extend([0] * (k - len(counts)))
            for i in range(n):
                counts[i] += 1

    @classmethod
    def summed(cls, stats: list["SpecStats"]) -> "SpecStats":
        """The counters of several requests added up (the n completions of one prompt)."""
        out = cls()
        for s in stats:
            out.num_drafts += s.num_drafts
            out.num_draft_tokens += s.num_draft_tokens
            out.num_accepted_tokens += s.num_accepted_tokens
            out.target_forwards += s.target_forwards
            for name, (drafted, accepted) in s.by_proposer.items():
                counts = out.by_proposer.setdefault(name, [0, 0])
                counts[0] += drafted
                counts[1] += accepted
            for mine, theirs in ((out.accepted_per_position, s.accepted_per_position),
                                 (out.drafted_per_position, s.drafted_per_position)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
        return out

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_accepted_len(self) -> float | None:
        """Mean draft tokens accepted per draft round (not counting the bonus/recovered token)."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "drafted": self.num_draft_tokens,
            "accepted": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "mean_accepted_len": self.mean_accepted_len,
            "target_forwards": self.target_forwards,
            "proposers": self.proposers_dict(),
        }

    def proposers_dict(self) -> dict:
        """{proposer: {"drafted", "accepted"}}, in the order they first drafted."""
        return {name: {"drafted": d, "accepted": a} for name, (d, a) in self.by_proposer.items()}


@dataclass
class RequestOutput:
    """What one engine step reports for one request (incremental and cumulative)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]           # all completion tokens so far
    new_token_ids: list[int]       # tokens committed in this step
    text: str                      # completion text so far (stop strings removed)
    new_text: str                  # text added in this step
    finished: bool
    finish_reason: str | None      # "stop" | "length" | "abort" | None while running
    spec: SpecStats
    error: str | None = None       # set when this request failed; other requests go on
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache when first scheduled
    scheduled_at: float | None = None  # time.monotonic() when first scheduled (Request.scheduled_at)
    # Only when the request asked (SamplingParams.logprobs), else None: per completion token
    # (its logprob, [(token id, logprob), ...] its top alternatives, most likely first);
    # `logprobs` covers token_ids, `new_logprobs` new_token_ids. Convention and -inf:
    # verispec.sampling.token_logprobs.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


# --- vLLM-shaped results of the offline API (LLM.generate / LLM.chat) -----------------------


@dataclass
class Logprob:
    """One token's log-probability, as vLLM's `vllm.sequence.Logprob` (rank: 1 = most likely;
    None for a sampled token outside the requested top N)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's `vllm.outputs.CompletionOutput`.

    With SamplingParams(logprobs=N): `logprobs` holds per token a dict {token id: Logprob}
    of the sampled token and the N most likely ones, `cumulative_logprob` their sum over the
    sampled tokens (convention: verispec.sampling.token_logprobs); else both None. `stop_reason` is the stop string or stop token id that ended the completion, None
    when it ended at EOS or max_tokens (vLLM's meaning).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None     # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class LLMRequestOutput:
    """The final result of one prompt, as vLLM's `vllm.outputs.RequestOutput`.

    `prompt` is the prompt text (None for a token-id prompt; the rendered conversation for
    `LLM.chat`); `outputs` holds SamplingParams.n CompletionOutputs (index 0..n-1). verispec
    adds `spec` (SpecStats: drafted / accepted tokens, per position; summed over the n
    completions) and `error` (set when this request failed alone). `text`, `token_ids` and
    `finish_reason` read `outputs[0]`, for code written against verispec's earlier results.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec: SpecStats
    metrics: None = None                 # vLLM's per-request metrics: not recorded (see `spec`)
    prompt_logprobs: None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    error: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.outputs[0].token_ids)
