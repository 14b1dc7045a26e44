"""The proposer interface the engine drives, and the registry of proposers by method name.

A round of speculation, as the engine runs it for every proposer alike:

    offer(rows)          -> one Offer per row: drafts available now (<= the row's budget),
                            tokens a catch-up would first compute, and an acceptance key
    policy.plan(...)     -> k per row (0: the row decodes plainly this round)
    prepare(rows)        -> tokens computed by one-off catch-ups of the drafting rows
    draft(rows, ks)      -> (tokens, q or None) per row, len(tokens) <= k
    ... target verify, rejection sampling, commit ...
    rollback(req)        after every verified row, whatever it drafted
    forget(request_id)   when a request finishes or is aborted

Contracts a proposer keeps, on which losslessness rests:
* `draft` returns, per row, q (k_i, V) passed through the target's own logits-to-probs
  transform, or None: the tokens are then a deterministic function of the row's history
  (one-hot q), which is exact for the rejection sampler.
* It never changes a request's committed tokens; whatever state it keeps per request is
  its own and survives a rejected draft only through `rollback`.

`timed` says whether drafting costs time comparable to a target step (a draft model): the
engine then times the proposer's passes and the policy prices them. Untimed proposers
(lookups) are treated as free.

A proposer may also have `stats() -> {name: number}`: its state for `/metrics` (a name
ending in "_total" is a counter since start, any other a gauge).

A proposer that reads the target's hidden states (an EAGLE-style head) sets
`wants_hidden = True` and has `observe(reqs, starts, hidden)`: right after every target
forward, for every row in that pass (prefill chunks and verify rows alike, whatever their
method: one request's prefix may be cached for another), hidden[i] (n_i, H) float32 is the
target's final-normed hidden state at positions starts[i].. starts[i] + n_i - 1 of reqs[i].
Positions past the verified length (rejected drafts) are among them: what they wrote
must not be read as verified. The engine feeds such a proposer from the first request that
uses it on (from the start when it is the engine's method); until then, and without one,
the target computes no hidden states.

Adding a proposer is one module that implements `Proposer` and one `register_proposer`
line (see `tests/fake_proposer.py`).

The method AUTO is not a proposer: a request under it is offered, every round, by each of
`SpecConfig.auto_candidates` this engine has, and the policy keeps per row the offer whose
drafts that row accepts more often by its estimates (`SpeculationPolicy.better`). The
choice is made from the committed history and the policy's state before anything is
drafted, so whichever proposer drafts, its q (or its deterministic drafts) is what the
verifier is handed: the output distribution cannot change. Every candidate keeps its
per-request state through the rounds it does not draft (`rollback` after each verified
round), and a head that fell behind catches up as it does when a request is new to it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:  # the registry stays importable by pure-Python modules (config)
    import torch

    from verispec.request import Request


AUTO = "auto"   # the method that picks a proposer per row and round (see above)
# Proposers AUTO may not pick: a draft model's passes cost a third of a target step and
# its KV must follow every committed token, so it is chosen by name.
NOT_AUTO_CANDIDATES = ("draft",)


class Offer(NamedTuple):
    """What a proposer can do for one row this round, before k is chosen."""

    available: int      # most tokens it can draft now (<= the row's budget); 0: nothing to offer
    catch_up: int = 0   # tokens a first pass must compute before drafting (a one-off cost)
    key: int = 0        # acceptance class of this offer (n-gram: the matched suffix length)


class Proposer(Protocol):
    name: str
    timed: bool          # drafting costs target-relative time: the engine times it
    has_probs: bool      # draft() may return q distributions (else always None)

    def offer(self, rows: list["Request"], budgets: list[int]) -> list[Offer]:
        """One Offer per row, `available` at most that row's budget."""
        ...

    def prepare(self, rows: list["Request"]) -> int:
        """One-off work before the drafting rows can draft (timed apart); tokens computed."""
        ...

    def draft(self, rows: list["Request"], ks: list[int]) -> list[tuple[list[int], "torch.Tensor | None"]]:
        """Up to ks[i] tokens for rows[i] (every k >= 1), with q (len, V) or None."""
        ...

    def rollback(self, req: "Request") -> None:
        """After verification: keep only state consistent with req.num_computed."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop the request's state; unknown ids are ignored."""
        ...


@dataclass(frozen=True)
class ProposerContext:
    """What a factory may use to build its proposer (one per engine)."""

    config: Any                      # the EngineConfig as run
    draft_runner: Any = None         # a ModelRunner over the draft model, if one was loaded
    block_table: Callable | None = None
    shared_generator: Any = None     # the engine's generator for unseeded requests
    target: Any = None               # the target's ModelRunner (slots, device, hidden states)


class ProposerUnavailable(Exception):
    """Raised by a factory that cannot build its proposer here; the text says what is needed."""


# A method's k_max (its k when not adaptive) where the run sets none: the k_max the adaptive
# grid validates (docs/benchmarks.md). A proposer registers another where its drafts run longer.
DEFAULT_SPEC_TOKENS = 8

_FACTORIES: dict[str, Callable[[ProposerContext], Proposer]] = {}
_SPEC_TOKENS: dict[str, int] = {}


def register_proposer(name: str, factory: Callable[[ProposerContext], Proposer],
                      spec_tokens: int = DEFAULT_SPEC_TOKENS) -> None:
    """Make `name` a speculation method; `factory(context)` builds its proposer, and
    `spec_tokens` is its k_max where the run sets none."""
    if name in ("none", AUTO) or not name.isidentifier():
        raise ValueError(f"a proposer name must be an identifier other than 'none' and {AUTO!r}, got {name!r}")
    _FACTORIES[name] = factory
    _SPEC_TOKENS[name] = spec_tokens


def proposer_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def default_spec_tokens(method: str) -> int:
    """k_max for `method` where the run sets none ("auto" and "none": DEFAULT_SPEC_TOKENS)."""
    return _SPEC_TOKENS.get(method, DEFAULT_SPEC_TOKENS)


def build_proposers(context: ProposerContext) -> tuple[dict[str, Proposer], dict[str, str]]:
    """(proposers that could be built, {name: why not} for the others)."""
    built, missing = {}, {}
    for name, factory in _FACTORIES.items():
        try:
            built[name] = factory(context)
        except ProposerUnavailable as exc:
            missing[name] = str(exc)
    return built, missing


def _ngram(context: ProposerContext) -> Proposer:
    from verispec.spec.ngram import NgramProposer
    spec = context.config.spec
    return NgramProposer(max_n=spec.ngram_max, min_n=spec.ngram_min, native=_native(context))


def _draft_model(context: ProposerContext) -> Proposer:
    if context.draft_runner is None:
        raise ProposerUnavailable("speculative method 'draft' needs a draft model (--draft-model, "
                                  "or `make draft` for the default model's registered draft)")
    from verispec.spec.draft_model import DraftModelProposer
    return DraftModelProposer(context.draft_runner, context.block_table, context.shared_generator,
                              context.config.scheduler.max_num_batched_tokens)


def _native(context: ProposerContext) -> bool | None:
    """A lookup proposer's C++ index follows the engine's kernels setting: "auto" if it
    builds (None), "on" required (True), "off" never (False)."""
    return {"auto": None, "on": True, "off": False}[context.config.kernels]


def _suffix(context: ProposerContext) -> Proposer:
    from verispec.spec.suffix import SuffixProposer
    spec = context.config.spec
    return SuffixProposer(max_outputs=spec.suffix_max_cached_requests, native=_native(context),
                          min_path_prob=spec.suffix_min_token_prob, match_factor=spec.suffix_max_spec_factor)


def _eagle(context: ProposerContext) -> Proposer:
    from verispec.spec.eagle import build_eagle
    return build_eagle(context)


register_proposer("ngram", _ngram)
register_proposer("draft", _draft_model)
# Suffix matches in agent loops (an edit re-emitting the code before it) run on for dozens of
# tokens: a k_max of 16 measured 2.09x -> 2.30x plain on iterative edits (docs/benchmarks.md).
register_proposer("suffix", _suffix, spec_tokens=16)
register_proposer("eagle", _eagle)
