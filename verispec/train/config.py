"""Frozen configuration of each pipeline stage; `to_dict()` is stored next to each result.

The defaults are the settings of the registered SmolLM2-135M-Instruct draft, sized so that
`make draft` (traces + filter + training + export) fits in about an hour on two shared cores.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class TracesConfig:
    """Stage 1: which prompts the target answers, and how it samples."""

    target: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"
    num_prompts: int = 256           # training prompts taken from the source (before filtering);
                                     # may change between runs: shards are prefixes of one order
    max_prompt_tokens: int = 256     # longer prompts are skipped (chat template included)
    max_tokens: int = 128            # generated tokens per prompt
    temperature: float = 0.0         # the engine's default serving setting (greedy)
    top_k_logprobs: int = 8          # target log-probabilities kept per generated position
    shard_size: int = 32             # prompts per shard file (the unit of resumption)
    batch_size: int = 32             # requests in flight in the engine
    seed: int = 0                    # prompt order and sampling

    def __post_init__(self):
        _check(self.num_prompts >= 1, f"num_prompts must be >= 1, got {self.num_prompts}")
        _check(8 <= self.max_prompt_tokens <= 4096,
               f"max_prompt_tokens must be in [8, 4096], got {self.max_prompt_tokens}")
        _check(1 <= self.max_tokens <= 4096, f"max_tokens must be in [1, 4096], got {self.max_tokens}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(1 <= self.top_k_logprobs <= 64,
               f"top_k_logprobs must be in [1, 64], got {self.top_k_logprobs}")
        _check(self.shard_size >= 1, f"shard_size must be >= 1, got {self.shard_size}")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.num_prompts % self.shard_size == 0,
               f"num_prompts ({self.num_prompts}) must be a multiple of shard_size ({self.shard_size}), "
               "so that every shard always holds the same prompts")
        _check(self.dtype in ("bfloat16", "float32"),
               f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FilterConfig:
    """Stage 2: what counts as a duplicate, a degenerate output, a contaminated example."""

    ngram: int = 13                  # word n-grams shared with a benchmark prompt => contaminated
    min_output_tokens: int = 1       # fewer generated tokens (EOS excluded) => degenerate
    loop_min_tokens: int = 32        # outputs shorter than this are never called loops
    loop_distinct_ratio: float = 0.35  # distinct 4-grams / 4-grams below this => repetition loop
    heldout_fraction: float = 0.05   # share of kept examples set aside for validation

    def __post_init__(self):
        _check(4 <= self.ngram <= 64, f"ngram must be in [4, 64], got {self.ngram}")
        _check(self.min_output_tokens >= 1,
               f"min_output_tokens must be >= 1, got {self.min_output_tokens}")
        _check(self.loop_min_tokens >= 8, f"loop_min_tokens must be >= 8, got {self.loop_min_tokens}")
        _check(0 < self.loop_distinct_ratio < 1,
               f"loop_distinct_ratio must be in (0, 1), got {self.loop_distinct_ratio}")
        _check(0 <= self.heldout_fraction < 0.5,
               f"heldout_fraction must be in [0, 0.5), got {self.heldout_fraction}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TrainConfig:
    """Stage 3: the draft's shape (which target layers it starts from) and the optimisation."""

    layers: tuple[int, ...] = (0, 1, 29)  # target layers copied into the draft, in order
    train_embeddings: bool = False   # the tied embedding / LM head stays the target's
    steps: int = 70
    tokens_per_step: int = 1024      # supervised (generated) tokens per optimiser step, about
    max_seq_len: int = 384           # prompt + output tokens per example (longer: prompt cut)
    lr: float = 1e-3
    warmup_steps: int = 5
    weight_decay: float = 0.0
    ce_weight: float = 0.2           # weight of CE on the sampled token next to the top-k KL
    checkpoint_every: int = 10
    eval_every: int = 10
    seed: int = 0

    def __post_init__(self):
        _check(len(self.layers) >= 1 and all(x >= 0 for x in self.layers),
               f"layers must list at least one target layer index >= 0, got {self.layers}")
        _check(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _check(self.tokens_per_step >= 16, f"tokens_per_step must be >= 16, got {self.tokens_per_step}")
        _check(self.max_seq_len >= 16, f"max_seq_len must be >= 16, got {self.max_seq_len}")
        _check(0 < self.lr < 1, f"lr must be in (0, 1), got {self.lr}")
        _check(0 <= self.warmup_steps < self.steps or self.steps == 1,
               f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        _check(self.ce_weight >= 0, f"ce_weight must be >= 0, got {self.ce_weight}")
        _check(self.checkpoint_every >= 1, f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        _check(self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


@dataclass(frozen=True)
class PipelineConfig:
    """All stages together (`verispec train-draft all`)."""

    traces: TracesConfig = field(default_factory=TracesConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
