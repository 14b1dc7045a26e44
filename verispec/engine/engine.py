"""LLMEngine.step(): schedule -> plan -> draft -> verify -> accept -> commit -> emit.

One step runs ONE target forward over every scheduled row: prefill chunks and
decode/verify rows ([pending token, d_1..d_k] per row, k chosen per row by the policy).
Every proposer is driven through the same `Proposer` calls (spec/proposer.py); a draft
model writes its KV at the same slots as the target. Draft tokens are provisional in the
KV manager until the rejection sampler has decided:

    allocate_slots -> insert_provisional -> draft + verify forward -> rejection sample
                   -> commit_provisional(accepted_len) -> evict_provisional

When every row of a step is greedy, acceptance is decided from the target's argmaxes
(`greedy_accept`) instead of V-wide distributions: the same verdicts the rejection
sampler gives one-hot distributions, without building them.

A step computes everything batch-wide first (offers, plan, drafts, the forward, first
tokens, verdicts on drafts) and only then commits row by row (KV, tokens, text, stops).
A row whose commit raises fails alone. If the batch-wide part raises, every scheduled row
is rolled back to the start of the step (provisional KV, num_computed, draft_computed,
proposers' state, RNG states) and the step is rerun on halves of its rows, recursively:
a subset that succeeds advances once, exactly as an undisturbed step would have advanced
it (greedy and seeded rows token-identical: a seeded row's noise is a function of its seed
and output positions only; unseeded rows remain exact samples, drawing other values from
the shared generator); a row
that still fails alone ends with finish_reason "abort", its KV freed, and an `error`
naming only the exception's type. Failures are counted in `step_errors`, the latest's
text kept in `last_step_error` (for the operator) and the traceback logged.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from typing import NamedTuple

import torch

from verispec.cache.manager import KVCacheManager, OutOfBlocks
from verispec.config import EngineConfig
from verispec.engine.messages import EngineStats
from verispec.engine.runner import ModelRunner, RowInput
from verispec.engine.scheduler import ScheduledBatch, Scheduler
from verispec.model import kernels
from verispec.model.device import resolve_device
from verispec.model.llama import LlamaModel
from verispec.model.loader import place_models
from verispec.model.tokenizer import IncrementalDetokenizer, Tokenizer
from verispec.outputs import RequestOutput
from verispec.request import Request, SpecOverride, Status  # noqa: F401 (SpecOverride: the engine's API)
from verispec.sampling import SamplingParams, SamplingTensors, noise_key, sample, token_logprobs
from verispec.spec.policy import MAX_SPEC_TOKENS, RoundReport, RoundTimer, RowOffer, RowResult, SpeculationPolicy
from verispec.spec.proposer import AUTO, ProposerContext, build_proposers
from verispec.spec.rejection import RejectionResult, greedy_accept, rejection_sample, seeded_verify
from verispec.structured.grammar import GrammarCompiler

log = logging.getLogger("verispec")


class _Mark:
    """The state a failed step attempt returns its rows to: each scheduled row's
    (num_computed, draft_computed), and the state of the shared RNG that unseeded sampled
    rows draw from (seeded rows' noise is a function of seed and position: no state).
    Taken at every attempt: ~1 us for no rows, ~1.6 us for 16."""

    __slots__ = ("rows", "lengths", "rngs")

    def __init__(self, shared: torch.Generator, rows: list[Request]):
        self.rows: list[Request] = []
        self.lengths: list[tuple[int, int]] = []
        self.rngs = [(shared, shared.get_state())]
        self.add(rows)

    def add(self, rows) -> None:
        for r in rows:
            self.rows.append(r)
            self.lengths.append((r.num_computed, r.draft_computed))


class _Fault(NamedTuple):
    """A step attempt that raised: the exception and the rows it had scheduled (rolled back)."""

    exc: Exception
    rows: list[Request]


class _Verdicts(NamedTuple):
    """What a step attempt computed batch-wide, before committing anything."""

    first: list[int | None]      # per prefill chunk: the first token of the prompt it completes
    counts: list[int]            # per decode row: 1 + the drafts it verified
    accepted: list[int]          # per decode row: drafts accepted
    emitted: list[list[int]]     # per decode row: tokens to append
    drafts: dict                 # request id -> (draft tokens, q or None)
    passes: dict                 # timed proposer -> (rows, depth, seconds)
    caught_up: int               # tokens computed by catch-ups
    logprobs: dict               # request id -> per new token (logprob, top alternatives), only
                                 # for rows that asked (SamplingParams.logprobs)


class LLMEngine:
    """Synchronous engine; drive it from one thread (the server wraps it in AsyncEngine)."""

    def __init__(self, config: EngineConfig, target: LlamaModel, tokenizer: Tokenizer,
                 draft: LlamaModel | None = None, vocab_limit: int | None = None, tensor_parallel=None):
        """`tensor_parallel`: verispec.distributed.runner.start's result, whose model is
        `target` (rank 0's slices); its runner then feeds the other ranks every forward."""
        ops, huge_pages = place_models([m for m in (target, draft) if m is not None],
                                       config.kernels, config.huge_pages)
        # The config as run: "auto" weight formats and kernels replaced by what resolved.
        self.config = config = replace(
            config, weight_format=target.weight_format, kernels="on" if ops is not None else "off",
            huge_pages=huge_pages, device=str(target.embed_tokens.weight.device),
            draft_weight_format=draft.weight_format if draft is not None else config.draft_weight_format)
        self.tokenizer = tokenizer
        self.model_name = config.model
        self.spec_method = config.spec.method
        mcfg = target.cfg
        self.max_model_len = min(config.scheduler.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings)
        cache = config.cache
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, prefix_cache=cache.prefix_cache)
        num_slots = cache.num_blocks * cache.block_size
        self.target = ModelRunner(target, num_slots, cache.block_size, vocab_limit) if tensor_parallel is None \
            else tensor_parallel.runner(num_slots, cache.block_size, vocab_limit)
        self.device = self.target.device
        self._shared_generator = torch.Generator(self.device).manual_seed(config.seed)
        self.draft_runner = ModelRunner(draft, num_slots, cache.block_size, vocab_limit) if draft else None
        self.proposers, self._unavailable = build_proposers(ProposerContext(
            config, self.draft_runner, self.kv.block_table, self._shared_generator, self.target))
        self._auto = [name for name in config.spec.auto_candidates if name in self.proposers]  # AUTO's picks
        self._watching: set[str] = set()  # hidden-state proposers fed since their first request
        self._watch(config.spec.method)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, OutOfBlocks)
        self.policy = SpeculationPolicy(MAX_SPEC_TOKENS)
        self.step_errors = 0  # requests failed alone by an exception in the engine
        self.last_step_error: str | None = None  # the latest one, with its text (for the operator)
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.eos_ids = set(tokenizer.eos_token_ids)
        self._grammars: GrammarCompiler | None = None  # built by the first structured request
        for proposer in self.proposers.values():  # the draft model's min_tokens bans EOS too
            if hasattr(proposer, "eos_ids"):
                proposer.eos_ids = tuple(self.eos_ids)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """The engine for `config`; threads None leaves torch's setting (the CLI, the server
        and LLM resolve it first: EngineConfig.resolved_for)."""
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if config.spec.method == "draft" and not config.draft_model:
            # The trained draft registered for this model (`make draft`); ModelNotFound says how
            # to make it. The engine's config names the directory it resolved to.
            from verispec.train.registry import registered_draft
            config = replace(config, draft_model=registered_draft(config.model))
        tensor_parallel = None
        if config.tensor_parallel_size > 1:  # rank 0 here, the others in processes of their own
            from verispec.distributed.runner import start
            tensor_parallel = start(config)
            target, tcfg, tokenizer = tensor_parallel.model, tensor_parallel.config, tensor_parallel.tokenizer
        else:
            target, tcfg, tokenizer = load_model(config.model, config)
        try:
            return cls._with_target(config, target, tcfg, tokenizer, tensor_parallel)
        except BaseException:
            if tensor_parallel is not None:
                tensor_parallel.group.close()
            raise

    @classmethod
    def _with_target(cls, config: EngineConfig, target, tcfg, tokenizer, tensor_parallel) -> "LLMEngine":
        """The rest of `from_config`: chat template, draft model, the engine around `target`."""
        if config.chat_template is not None:  # --chat-template / LLM(chat_template=...)
            tokenizer = Tokenizer(tokenizer.backend, replace(tokenizer.meta, chat_template=config.chat_template))
        draft, vocab_limit = None, None
        if config.draft_model:
            from verispec.spec.compat import check_pair
            draft, dcfg, dtok = load_model(config.draft_model, config, draft=True)
            verdict = check_pair(tokenizer, dtok, tcfg, dcfg)
            if not verdict.ok:
                raise ValueError(f"draft model {config.draft_model!r} cannot draft for "
                                 f"{config.model!r}: {verdict.reason}")
            vocab_limit = verdict.shared_vocab_size
        return cls(config, target, tokenizer, draft, vocab_limit, tensor_parallel)

    def shutdown(self) -> None:
        """Stop what the engine started beside its own process (tensor-parallel worker ranks)."""
        close = getattr(self.target, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    spec: SpecOverride | None = None) -> None:
        """Queue a request; raises ValueError naming the problem for bad input."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.target.vocab_limit or self.target.model.cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}), got {bad[:5]}")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens; the context is {self.max_model_len} "
                             "tokens and must leave room for at least one generated token")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the "
                             f"context of {self.max_model_len} tokens (at most {self.max_model_len - n})")
        method, k, adaptive = self._resolve_spec(spec)
        self._watch(method)
        need = -(-(n + params.max_tokens + k + 1) // self.kv.block_size)
        if need > self.kv.num_total_blocks:
            raise ValueError(f"request needs {need} KV blocks; the pool has {self.kv.num_total_blocks}")
        req = Request(request_id, list(prompt_token_ids), params, method, k, adaptive, self._arrivals)
        if params.structured is not None:  # GrammarError (a ValueError) names response_format
            req.grammar = self._grammar_compiler().matcher(params.structured)
        self._arrivals += 1
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _watch(self, method: str) -> None:
        """From now on hand `method`'s proposer every pass's hidden states, if it reads them.
        Until a request (or the engine's default) names it, passes compute none: a server
        that never drafts with a head pays nothing for having one. AUTO names its candidates."""
        for name in self._names(method):
            if getattr(self.proposers.get(name), "wants_hidden", False):
                self._watching.add(name)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            vocab = self.target.vocab_limit or self.target.model.cfg.vocab_size
            self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), vocab, sorted(self.eos_ids))
        return self._grammars

    def _resolve_spec(self, spec: SpecOverride | None) -> tuple[str, int, bool]:
        cfg = self.config.spec
        method = (spec.method if spec and spec.method else None) or cfg.method
        if method in self._unavailable:
            raise ValueError(f"speculative.method {method!r} is not available: {self._unavailable[method]}")
        if method == AUTO and not self._auto:
            raise ValueError(f"speculative.method 'auto' has no candidate here: none of "
                             f"{list(self.config.spec.auto_candidates)} is available")
        if method not in ("none", AUTO) and method not in self.proposers:
            allowed = ", ".join(repr(m) for m in ("none", AUTO, *self.proposers))
            raise ValueError(f"speculative.method must be one of {allowed}, got {method!r}")
        k = spec.num_tokens if spec and spec.num_tokens is not None else cfg.spec_tokens(method)
        if not isinstance(k, int) or not 0 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculative.num_tokens must be an integer in [0, {MAX_SPEC_TOKENS}], got {k!r}")
        if k == 0:
            method = "none"
        adaptive = spec.adaptive if spec and spec.adaptive is not None else cfg.adaptive
        return method, k, adaptive

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at once; no-op if unknown or finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self._finish(req, "abort", cache=False)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           self.kv.num_total_blocks - self.kv.num_free_blocks - self.kv.num_evictable_blocks,
                           self.kv.num_total_blocks, self.kv.hit_tokens, self.kv.query_tokens,
                           self.scheduler.num_preemptions,
                           {name: p.stats() for name, p in self.proposers.items() if hasattr(p, "stats")})

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for req in self.requests.values():
            if req.all_ids != req.prompt_ids + req.output_ids:
                raise AssertionError(f"request {req.request_id!r}: all_ids is not prompt + output")

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One step: the outputs of every row it advanced or ended.

        If the batch-wide part raises, the step is rolled back and its rows isolated
        (`_isolate`): only a row that fails on its own is failed; every other row advances
        exactly once, as an undisturbed step would have advanced it.
        """
        result = self._attempt(None)
        return self._isolate(result) if isinstance(result, _Fault) else result

    def _attempt(self, only: set[str] | None) -> list[RequestOutput] | _Fault:
        """Schedule, compute batch-wide (nothing committed), then commit row by row.

        `only`: schedule just these running requests and admit none (a rerun). If the
        batch-wide part raises, every scheduled row is back at its state at the start of
        the attempt (`_restore`) and the _Fault names them; the scheduler's allocations,
        preemptions and admissions stay (valid states).
        """
        timer = RoundTimer()
        batch = self.scheduler.schedule_decode(only)
        rows = batch.decode
        mark = _Mark(self._shared_generator, rows)
        try:
            offers = self._offers(rows)
            ks = self.policy.plan(offers) if rows else []
        except Exception as exc:
            return self._rolled_back(exc, mark)
        self._schedule_prefill(batch, len(rows) + sum(ks), only)
        if batch.empty:
            return []
        mark.add(c.request for c in batch.prefill)
        try:
            verdicts = self._compute(batch, ks, timer)
        except Exception as exc:
            return self._rolled_back(exc, mark)
        outputs = self._commit(batch, verdicts)
        if rows:
            self._learn(self._report(batch, offers, verdicts, timer))
        return outputs

    def _schedule_prefill(self, batch: ScheduledBatch, verify_tokens: int, only: set[str] | None) -> None:
        """Prefill gets the step's token budget less what the decode rows verify; a rerun
        (`only`) schedules just its requests' chunks and admits nobody."""
        if only is None:  # the plain step's call, the one the scheduling tests intercept
            self.scheduler.schedule_prefill(batch, verify_tokens)
        else:
            self.scheduler.schedule_prefill(batch, verify_tokens, only)

    def _rolled_back(self, exc: Exception, mark: "_Mark") -> "_Fault":
        self._restore(mark)
        return _Fault(exc, mark.rows)

    def _restore(self, mark: "_Mark") -> None:
        """Undo what a failed attempt's batch-wide part did to its rows: provisional draft
        KV evicted, num_computed / draft_computed back to the mark, each proposer's
        per-request state rolled back to them, RNG states back. KV written past those
        lengths is stale and never read (no mask admits it until it is overwritten).
        A proposer whose rollback raises here is beyond isolation (the core's last resort)."""
        for req, (computed, draft_computed) in zip(mark.rows, mark.lengths):
            if req.request_id in self.kv:
                self.kv.evict_provisional(req.request_id)
            req.num_computed, req.draft_computed = computed, draft_computed
            for proposer in self._proposers_of(req):
                proposer.rollback(req)
        for generator, state in mark.rngs:
            generator.set_state(state)

    def _isolate(self, fault: "_Fault") -> list[RequestOutput]:
        """Find the rows that make a step raise by rerunning it on halves, recursively.

        A subset that succeeds advances its rows once; a row that still fails alone is
        failed alone (`_fail_row`). Subsets are disjoint and every rerun schedules a strict
        subset of its failed parent's rows, so each row succeeds at most once and the loop
        ends: at most 2n - 1 attempts, O(log n) reruns per faulty row. A fault that names
        no row cannot be isolated and is raised (the core's last resort).
        """
        log.warning("engine step raised; isolating the faulty row(s) among its %d", len(fault.rows),
                    exc_info=fault.exc)
        outputs: list[RequestOutput] = []
        todo: list[_Fault | list[Request]] = [fault]
        while todo:
            item = todo.pop()
            if isinstance(item, list):  # a subset to rerun
                result = self._attempt({r.request_id for r in item})
                if isinstance(result, _Fault):
                    todo.append(result)
                else:
                    outputs.extend(result)
            elif not item.rows:
                raise item.exc
            elif len(item.rows) == 1:  # popped right after its attempt: still running
                outputs.append(self._fail_row(item.rows[0], item.exc))
            else:
                half = len(item.rows) // 2
                todo += [item.rows[half:], item.rows[:half]]
        return outputs

    def _fail_row(self, req: Request, exc: Exception) -> RequestOutput:
        """Fail one request alone: finish "abort", KV freed at once, counted in step_errors.

        Its `error` names the exception's type only: the text may hold data and goes to
        the log with the traceback, and to `last_step_error` (for the operator).
        """
        log.error("request %s failed in the engine; aborting it alone", req.request_id, exc_info=exc)
        self.step_errors += 1
        self.last_step_error = f"request {req.request_id}: {type(exc).__name__}: {exc}"
        req.error = f"internal error while generating this request ({type(exc).__name__}); see the server log"
        return self._finish(req, "abort", cache=False)

    def _learn(self, report: RoundReport) -> None:
        """policy.observe; a failure there costs the policy one round, never a request."""
        try:
            self.policy.observe(report)
        except Exception:
            log.exception("policy.observe failed; this round is not learned from")

    def _offers(self, rows: list[Request]) -> list[RowOffer]:
        """What each row's proposer offers now, up to the row's budget (max_tokens, context);
        a row under AUTO keeps the best of its candidates' offers (`policy.better`). Sets
        each row's `drafter`."""
        offers: list[RowOffer | None] = [None] * len(rows)
        by_method: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            for name in self._names(r.spec_method):
                by_method.setdefault(name, []).append(i)
        for name, members in by_method.items():
            proposer = self.proposers.get(name)
            if proposer is None:  # "none", or a method this engine does not run
                for i in members:
                    offers[i] = RowOffer(rows[i].request_id, None, 0, 0)
                continue
            reqs = [rows[i] for i in members]
            found = proposer.offer(reqs, [self.scheduler.spec_budget(r) for r in reqs])
            for i, r, o in zip(members, reqs, found):
                offer = RowOffer(r.request_id, name, o.available, r.num_spec_tokens, r.adaptive,
                                 o.catch_up, o.key, r.remaining_tokens, proposer.timed)
                offers[i] = offer if offers[i] is None else self.policy.better(offers[i], offer)
        for r, o in zip(rows, offers):
            r.drafter = o.proposer
        return offers

    def _names(self, method: str) -> list[str]:
        """The proposers a method drafts with: its own, or AUTO's candidates."""
        return self._auto if method == AUTO else [method]

    def _proposers_of(self, req: Request) -> list:
        """The proposers that may hold state for `req`."""
        return [self.proposers[n] for n in self._names(req.spec_method) if n in self.proposers]

    def _compute(self, batch: ScheduledBatch, ks: list[int], timer: RoundTimer) -> "_Verdicts":
        """The batch-wide part: drafts, the target forward, first tokens, verdicts on drafts.

        Commits nothing; changes only what `_restore` undoes (provisional KV, proposers'
        per-request state, draft_computed, RNG states) and KV past the rows' lengths.
        """
        rows = batch.decode
        drafts, passes, caught_up = self._draft(rows, ks, timer)
        logits = self._target_forward(batch, self._inputs(batch, drafts))
        n = len(batch.prefill)
        readback = Readback()
        first = self._sample_first(batch.prefill, logits[:n], readback)
        verdicts = self._verify(rows, logits[n:], drafts, readback)
        readback.fetch()  # the step's one device-to-host copy (a sync on a GPU)
        first, (counts, accepted, emitted) = first(), verdicts()
        logprobs = {}
        if any(r.params.logprobs is not None for r in rows) or any(
                c.request.params.logprobs is not None for c in batch.prefill):  # else: nothing
            logprobs = self._logprobs([c.request for c in batch.prefill] + rows,
                                      [lg[-1:] for lg in logits[:n]] + logits[n:],
                                      [[t] if t is not None else [] for t in first] + emitted)
        return _Verdicts(first, counts, accepted, emitted, drafts, passes, caught_up, logprobs)

    def _target_forward(self, batch: ScheduledBatch, inputs: list[RowInput]) -> list[torch.Tensor]:
        """The target's pass (per-row logits). Proposers that read its hidden states and
        are watched (`_watch`) are handed every row's (`observe`), whatever its method: a
        prefix one request computes may be another's cached prefix. Without such a
        proposer the target computes none."""
        watchers = [self.proposers[name] for name in self._watching]
        if not watchers:
            return self.target.forward(inputs)
        logits, hidden = self.target.forward(inputs, hidden=True)
        reqs = [c.request for c in batch.prefill] + batch.decode  # the order of `inputs`
        for proposer in watchers:
            proposer.observe(reqs, [r.start for r in inputs], hidden)
        return logits

    def _logprobs(self, reqs: list[Request], logits: list[torch.Tensor], tokens: list[list[int]]) -> dict:
        """Request id -> (logprob, top alternatives) of each of tokens[i], for the rows that
        asked. Row j of logits[i] scored tokens[i][j] (a verify row's position j, processed
        as if tokens[i][:j] had been generated: those are the accepted drafts, so it is the
        distribution plain decoding would have had there); a prefill's logits are its last
        row (`logits[i]` is then that one row). `token_logprobs` states the convention."""
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None and tokens[i]]
        if not want:
            return {}
        sel = [reqs[i] for i in want]
        counts = [len(tokens[i]) for i in want]
        flat = torch.cat([logits[i][:c] for i, c in zip(want, counts)])
        st = self._tensors(sel, flat.device).expand(counts, [tokens[i] for i in want])
        values = token_logprobs(st, flat, [t for i in want for t in tokens[i]],
                                [r.params.logprobs for r, c in zip(sel, counts) for _ in range(c)])
        out, pos = {}, 0
        for r, c in zip(sel, counts):
            out[r.request_id], pos = values[pos: pos + c], pos + c
        return out

    def _draft(self, rows: list[Request], ks: list[int], timer: RoundTimer) -> tuple[dict, dict, int]:
        """(draft tokens and q or None by request id, each timed proposer's pass as (rows,
        depth, seconds), catch-up tokens). A timed proposer's catch-up and drafting are
        timed apart (laps "catch_up" and "draft")."""
        drafts: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        passes: dict[str, tuple[int, int, float]] = {}
        caught_up = 0
        for name, proposer in self.proposers.items():
            members = [(r, k) for r, k in zip(rows, ks) if k and r.drafter == name]
            if not members:
                continue
            reqs, row_ks = [r for r, _ in members], [k for _, k in members]
            timer.lap("round")
            caught_up += proposer.prepare(reqs)
            timer.lap("catch_up" if proposer.timed else "round")
            proposed = [_inside_grammar(r, d) for r, d in zip(reqs, proposer.draft(reqs, row_ks))]
            seconds = timer.lap("draft" if proposer.timed else "round")
            if proposer.timed:
                passes[name] = (len(reqs), max(row_ks), seconds)
            drafts.update({r.request_id: d for r, d in zip(reqs, proposed) if d[0]})
        return drafts, passes, caught_up

    def _report(self, batch: ScheduledBatch, offers: list[RowOffer], v: "_Verdicts",
                timer: RoundTimer) -> RoundReport:
        """The round for the policy; its verify time is the step's less the timed passes."""
        drafted = {rid: len(tokens) for rid, (tokens, _) in v.drafts.items()}
        results = [RowResult(r.request_id, o.proposer, o.key, drafted.get(r.request_id, 0), a, r.finished)
                   for r, o, a in zip(batch.decode, offers, v.accepted) if o.proposer]
        catch_up_s = timer.phases.get("catch_up", 0.0)
        verify_s = None if batch.prefill else timer.total() - timer.phases.get("draft", 0.0) - catch_up_s
        return RoundReport(len(batch.decode), results, verify_s, sum(drafted.values()), v.passes,
                           (v.caught_up, catch_up_s))

    def _inputs(self, batch: ScheduledBatch, drafts) -> list[RowInput]:
        """The forward's rows (prefill chunks, then [pending, drafts] per decode row); the
        drafts are recorded as provisional KV first."""
        inputs = []
        for chunk in batch.prefill:
            req = chunk.request
            ids = req.all_ids[chunk.start: chunk.end]
            emits = chunk.end == req.num_tokens  # a fresh prompt's last chunk samples token 1
            inputs.append(RowInput(ids, chunk.start, self.kv.block_table(req.request_id),
                                   len(ids) - 1 if emits else len(ids)))
        for req in batch.decode:
            d_tokens = drafts.get(req.request_id, ([], None))[0]
            base = req.num_computed  # position of the pending token
            slots = self.target.slots(self.kv.block_table(req.request_id), base + 1, base + 1 + len(d_tokens))
            if d_tokens:
                self.kv.insert_provisional(req.request_id, d_tokens, slots, base + 1)
            inputs.append(RowInput([req.all_ids[-1]] + d_tokens, base, self.kv.block_table(req.request_id), 0))
        return inputs

    def _sample_first(self, chunks, logits: list[torch.Tensor], readback: "Readback"):
        """Per chunk, the first token of the prompt it completes (None: it completes none),
        as a function to call after `readback.fetch()`. Samples only; the chunks are
        committed by `_commit_prefill`."""
        done = [i for i, lg in enumerate(logits) if lg.shape[0]]  # only completing chunks have logits
        handle = None
        if done:
            reqs = [chunks[i].request for i in done]
            last = torch.cat([logits[i][-1:] for i in done])
            probs = self._tensors(reqs, last.device).to_probs(last)
            keys = [noise_key(r.params, output_position(r)) for r in reqs]
            handle = readback.add(sample(probs, keys, shared_generator=self._shared_generator))

        def first() -> list[int | None]:
            tokens: list[int | None] = [None] * len(chunks)
            for i, t in zip(done, readback[handle] if done else ()):
                tokens[i] = t
            return tokens
        return first

    def _verify(self, rows: list[Request], logits: list[torch.Tensor], drafts, readback: "Readback"):
        """Verdicts on every row's drafts, as a function to call after `readback.fetch()`:
        (1 + drafts verified, drafts accepted, tokens to append) per row. Commits nothing."""
        if not rows:
            return lambda: ([], [], [])
        counts = [lg.shape[0] for lg in logits]  # k_i + 1 per row
        proposed = [drafts.get(r.request_id, ([], None))[0] for r in rows]
        flat = logits[0] if len(logits) == 1 else torch.cat(logits)  # (sum(k_i + 1), V)
        # position j of a row is processed as if its drafts d_1..d_j had been generated
        if all(r.params.greedy for r in rows):  # the same result from argmaxes, no V-wide work
            if any(r.params.has_processors for r in rows):  # the argmax of the processed logits
                flat = self._tensors(rows, flat.device).expand(counts, proposed).process(flat)
            handle = readback.add(kernels.greedy_argmax(flat, self.target.model.kernels))

            def greedy():
                argmax, starts = readback[handle], itertools.accumulate([0] + counts)
                accepted, emitted = greedy_accept([argmax[s: s + c] for s, c in zip(starts, counts)], proposed)
                return counts, accepted, emitted
            return greedy
        parts = [(index, [readback.add(t) for t in (result.output_tokens, result.accepted_len, result.num_output)],
                  result.output_tokens.shape[1]) for index, result in self._rejection_parts(rows, counts, flat,
                                                                                            proposed, drafts)]

        def sampled():
            accepted, emitted = [0] * len(rows), [[] for _ in rows]
            for index, (tokens, lengths, num), width in parts:
                tokens, lengths, num = readback[tokens], readback[lengths], readback[num]
                for j, i in enumerate(index):
                    accepted[i], emitted[i] = lengths[j], tokens[j * width: j * width + num[j]]
            return counts, accepted, emitted
        return sampled

    def _rejection_parts(self, rows, counts, flat, proposed, drafts) -> list[tuple[list[int], RejectionResult]]:
        """(row indices, their RejectionResult) for the seeded rows (coupled verification)
        and the others (rejection sampling); seeded and unseeded rows may share a batch."""
        st = self._tensors(rows, flat.device).expand(counts, proposed)
        target_probs = _pad_rows(st.to_probs(flat), counts)  # (B, K+1, V)
        keys = [noise_key(r.params, output_position(r)) for r in rows]
        seeded = [i for i, key in enumerate(keys) if key is not None]
        other = [i for i, key in enumerate(keys) if key is None]
        parts = []

        def probs_of(index):
            return target_probs if len(index) == len(rows) else target_probs[index]
        if seeded:
            parts.append((seeded, seeded_verify(probs_of(seeded), [proposed[i] for i in seeded],
                                                [counts[i] - 1 for i in seeded], [keys[i] for i in seeded])))
        if other:
            parts.append((other, self._rejection_sample([rows[i] for i in other], probs_of(other),
                                                        [proposed[i] for i in other], drafts)))
        return parts

    def _tensors(self, rows: list[Request], device) -> SamplingTensors:
        """The rows' SamplingTensors at their next output position (histories: prompt and
        output so far, read only when a row has a logits processor)."""
        return SamplingTensors.from_params([r.params for r in rows], device,
                                           [(r.prompt_ids, r.output_ids) for r in rows], self.eos_ids,
                                           [r.grammar for r in rows])

    def _rejection_sample(self, rows: list[Request], target_probs: torch.Tensor,
                          proposed: list[list[int]], drafts) -> RejectionResult:
        """Unseeded sampled (and greedy) rows: exact rejection sampling against each row's q
        (one-hot at the draft for probability-free proposers)."""
        k_max, vocab = target_probs.shape[1] - 1, target_probs.shape[2]
        device = target_probs.device
        draft_tokens = torch.tensor([t + [0] * (k_max - len(t)) for t in proposed],
                                    dtype=torch.long).view(len(rows), k_max).to(device, non_blocking=True)  # (B, K)
        has_q = any(drafts.get(r.request_id, (None, None))[1] is not None for r in rows)
        draft_probs = torch.zeros(len(rows), k_max, vocab, device=device) if has_q else None  # (B, K, V)
        if has_q:
            for i, r in enumerate(rows):
                toks, q = drafts.get(r.request_id, ([], None))
                if q is not None:
                    draft_probs[i, : len(toks)] = q
                elif toks:  # mixed batch: one-hot q for probability-free rows
                    draft_probs[i, torch.arange(len(toks), device=device),
                                torch.tensor(toks).to(device, non_blocking=True)] = 1.0
        return rejection_sample(target_probs, draft_tokens, draft_probs, [len(t) for t in proposed],
                                shared_generator=self._shared_generator)

    # ------------------------------------------------------------------ commit, row by row
    def _commit(self, batch: ScheduledBatch, v: "_Verdicts") -> list[RequestOutput]:
        """Commit every row's verdict; a row whose commit raises (KV bookkeeping, its
        proposer, its detokenizer, stop strings) fails alone and the others go on."""
        outputs: list[RequestOutput] = []
        for chunk, token in zip(batch.prefill, v.first):
            try:
                outputs.extend(self._commit_prefill(chunk, token, v.logprobs.get(chunk.request.request_id)))
            except Exception as exc:
                outputs.append(self._fail_row(chunk.request, exc))
        for req, count, accepted, new in zip(batch.decode, v.counts, v.accepted, v.emitted):
            try:
                outputs.extend(self._commit_decode(req, count - 1, accepted, new,
                                                   v.logprobs.get(req.request_id)))
            except Exception as exc:
                outputs.append(self._fail_row(req, exc))
        return outputs

    def _commit_prefill(self, chunk, token: int | None, logprobs=None) -> list[RequestOutput]:
        """The chunk's KV is verified; a completed fresh prompt is published in the prefix
        tree and gets its first token."""
        req = chunk.request
        req.num_computed = chunk.end
        req.stats.target_forwards += 1
        self.kv.commit(req.request_id, chunk.end)
        if token is None:
            return []
        if self.config.cache.prefix_cache:
            req.draft_computed = self.kv.cache_sequence(req.request_id, req.all_ids[: req.num_computed],
                                                        req.draft_computed)
        return self._append_tokens(req, [token], logprobs)

    def _commit_decode(self, req: Request, k: int, accepted: int, new: list[int],
                       logprobs=None) -> list[RequestOutput]:
        """Commit the pending token and the accepted drafts, end the round, emit."""
        base = req.num_computed
        if k:  # commits the pending token (its KV was just written) and the accepted drafts
            self.kv.commit_provisional(req.request_id, accepted)
            self.kv.evict_provisional(req.request_id)
        else:
            self.kv.commit(req.request_id, base + 1)
        self._rollback(req, base, accepted, k)
        req.stats.record_round(k, accepted, req.drafter)
        req.stats.target_forwards += 1
        return self._append_tokens(req, new, logprobs)

    def _rollback(self, req: Request, base: int, accepted: int, k: int) -> None:
        """O(1) per row: only the pending token and the accepted drafts stay as context.

        The KV written for rejected drafts (target and draft model) stays in its slots but
        is past the row's length, so no mask admits it until a later pass overwrites it.
        """
        req.num_computed = base + 1 + accepted
        for proposer in self._proposers_of(req):
            proposer.rollback(req)

    # ------------------------------------------------------------------ tokens, stops, finish
    def _append_tokens(self, req: Request, tokens: list[int], logprobs=None) -> list[RequestOutput]:
        """Append accepted tokens one by one, stopping at EOS, a stop token id, max_tokens or
        a stop string. Before min_tokens output tokens only max_tokens stops (as vLLM; the
        sampler already gives EOS and stop token ids probability 0 there).

        Text that could still turn out to be the start of a stop string is held back
        (req.held_text) rather than emitted: streamed text cannot be taken back.
        """
        stops = req.params.stop
        full = req.text + req.held_text  # all text decoded so far, emitted or held
        new_ids, reason, stop_hit = [], None, False
        for t in tokens:
            req.append_output(t)
            new_ids.append(t)
            may_stop = len(req.output_ids) > req.params.min_tokens  # the token at index >= min_tokens
            if may_stop and ((t in self.eos_ids and not req.params.ignore_eos) or t in req.params.stop_token_ids):
                reason = "stop"
                break
            searched = len(full)
            full += req.detokenizer.push([t])
            hit = _find_stop(full, stops, searched) if stops and may_stop else None
            if hit is not None:  # the stop string and anything after it are not returned
                full, reason, stop_hit = full[:hit], "stop", True
                break
            if len(req.output_ids) >= req.params.max_tokens:
                reason = "length"
                break
        if req.grammar is not None:
            req.grammar.commit(new_ids)
        if reason and not stop_hit:
            full += req.detokenizer.flush()  # text held back for an unfinished character
        hold = 0 if reason else max((len(s) for s in stops), default=1) - 1
        emit_upto = max(len(req.text), len(full) - hold)
        new_text = full[len(req.text): emit_upto]
        req.text, req.held_text = full[:emit_upto], full[emit_upto:]
        new_logprobs = None
        if logprobs is not None:  # one per appended token (those after a stop are dropped)
            new_logprobs = list(logprobs[: len(new_ids)])
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.extend(new_logprobs)
        if reason:
            return [self._finish(req, reason, cache=True, new_ids=new_ids, new_text=new_text,
                                 new_logprobs=new_logprobs)]
        return [self._output(req, new_ids, new_text, new_logprobs)]

    def _finish(self, req: Request, reason: str, cache: bool, new_ids=(), new_text="",
                new_logprobs=None) -> RequestOutput:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.scheduler.remove(req)
        keep = req.all_ids[: req.num_computed] if cache and self.config.cache.prefix_cache else None
        if req.request_id in self.kv:  # a request still waiting holds no blocks
            self.kv.close_sequence(req.request_id, keep, req.draft_computed)
        for name, proposer in self.proposers.items():
            try:  # a plug-in's cleanup failing must not stop the request from ending
                proposer.forget(req.request_id)
            except Exception:
                log.exception("proposer %r failed to forget request %s", name, req.request_id)
        self.policy.forget(req.request_id)
        del self.requests[req.request_id]
        return self._output(req, list(new_ids), new_text, new_logprobs)

    def _output(self, req: Request, new_ids: list[int], new_text: str, new_logprobs=None) -> RequestOutput:
        if new_logprobs is None and req.params.logprobs is not None:
            new_logprobs = []
        return RequestOutput(req.request_id, req.prompt_ids, list(req.output_ids), new_ids, req.text,
                             new_text, req.finished, req.finish_reason, req.stats, req.error,
                             num_cached_tokens=req.num_cached_tokens or 0, scheduled_at=req.scheduled_at,
                             logprobs=None if req.params.logprobs is None else list(req.logprobs or ()),
                             new_logprobs=new_logprobs)


# The layout of saved runtime weights; bumped whenever a module's buffers change (v3: int4
# in verispec's kernel layout with fp16 scale and min; v5: dense bf16 linears packed too,
# and a bf16 target's head refined from a bf16 copy; v6: a Q8_0 head's blocks as one
# Q8Linear, float32 in and out, instead of two int4 parts; v7: int4 codes in the lane
# layout for both activation grids).
_RUNTIME_LAYOUT = "v7"


def load_model(spec: str, config: EngineConfig, draft: bool = False):
    """(model, ModelConfig, Tokenizer) for a model spec, in the config's dtype and format
    (`draft_weight_format` for a draft model).

    Warm starts of a GGUF model in bf16 skip reading the float32 conversion, fusing and
    quantizing it: the runtime weights (fused, converted, packed for the weight format)
    are saved once next to the converted GGUF (`runtime/bfloat16-<format>-v5.safetensors`,
    with what the state dict does not hold in its metadata) and loaded directly afterwards.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from verispec.model.loader import cache_dir_for, load_config_and_tokenizer, load_model_files, resolve_model
    source = resolve_model(spec)
    gguf_path = source.path if source.kind == "gguf" else None
    runtime = None
    device = resolve_device(config.device)
    # Drafts have no cache (ApproxHead); other devices build their dense weights directly.
    if gguf_path is not None and config.dtype == "bfloat16" and not draft and device.type == "cpu":
        # A subfolder: the loader reads every *.safetensors beside model.safetensors.
        runtime = cache_dir_for(gguf_path) / "runtime" / f"{config.dtype}-{config.weight_format}-{_RUNTIME_LAYOUT}.safetensors"
    if runtime is not None and runtime.exists():
        mcfg, tokenizer = load_config_and_tokenizer(source)
        with safe_open(str(runtime), framework="pt") as f:
            meta, state = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        return LlamaModel.from_runtime_state(mcfg, state, meta), mcfg, tokenizer
    mcfg, state, tokenizer = load_model_files(source)
    model = LlamaModel.from_state_dict(mcfg, state, dtype=getattr(torch, config.dtype), device=device,
                                       weight_format=config.draft_weight_format if draft else config.weight_format,
                                       gguf_path=gguf_path, draft=draft)
    if runtime is not None:
        runtime.parent.mkdir(exist_ok=True)
        tmp = runtime.with_suffix(".tmp")
        tensors, meta = model.runtime_state()
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(runtime)  # atomic: a crash never leaves a half-written cache
        for stale in runtime.parent.glob("*.safetensors"):  # earlier layouts' files
            if not stale.stem.endswith(f"-{_RUNTIME_LAYOUT}"):
                stale.unlink(missing_ok=True)
    return model, mcfg, tokenizer


def output_position(req: Request) -> int:
    """The output index of the token a row samples next (its first sampled token is 0);
    a verify row's position i is this + i. Unchanged by preemption and recompute."""
    return len(req.output_ids)


def _inside_grammar(req: Request, draft: tuple[list[int], torch.Tensor | None]):
    """The draft cut before its first token the request's constraint does not admit (the
    target would give it probability 0): nothing past it is verified."""
    tokens, q = draft
    if req.grammar is None or not tokens:
        return draft
    n = req.grammar.valid_prefix(req.output_ids, tokens)
    return (tokens, q) if n == len(tokens) else (tokens[:n], None if q is None else q[:n])


def _pad_rows(flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """(sum(counts), ...) -> (len(counts), max(counts), ...), rows zero-padded; a view when equal."""
    width = max(counts)
    if all(c == width for c in counts):  # e.g. batch 1, or every row at the same k
        return flat.view(len(counts), width, *flat.shape[1:])
    out = flat.new_zeros(len(counts), width, *flat.shape[1:])
    index = torch.tensor([i * width + j for i, c in enumerate(counts) for j in range(c)], dtype=torch.long)
    out.view(len(counts) * width, *flat.shape[1:])[index.to(flat.device, non_blocking=True)] = flat
    return out


class Readback:
    """Integer tensors a step needs on the host (sampled tokens, verdicts), copied in one
    transfer by `fetch`: on a GPU the step's one device-to-host sync; `readback[handle]`
    is then the tensor `add` returned `handle` for, flattened to a list of ints."""

    def __init__(self):
        self._tensors: list[torch.Tensor] = []
        self._host: list[list[int]] | None = None

    def add(self, tensor: torch.Tensor) -> int:
        if self._host is not None:
            raise RuntimeError("Readback.add after fetch: the step's tensors are already on the host")
        self._tensors.append(tensor)
        return len(self._tensors) - 1

    def fetch(self) -> None:
        sizes = [t.numel() for t in self._tensors]
        parts = [t.reshape(-1).long() for t in self._tensors]
        flat = parts[0].tolist() if len(parts) == 1 else torch.cat(parts).tolist() if parts else []
        self._host, start = [], 0
        for n in sizes:
            self._host.append(flat[start: start + n])
            start += n

    def __getitem__(self, handle: int) -> list[int]:
        if self._host is None:
            raise RuntimeError("Readback read before fetch")
        return self._host[handle]


def _find_stop(text: str, stops: tuple[str, ...], searched_upto: int) -> int | None:
    """Index where the earliest stop string starts, looking only where it could be new."""
    best = None
    for s in stops:
        i = text.find(s, max(0, searched_upto - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
