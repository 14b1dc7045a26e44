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
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace

import torch

from verispec.cache.manager import KVCacheManager, OutOfBlocks
from verispec.config import EngineConfig
from verispec.engine.messages import EngineStats
from verispec.engine.runner import ModelRunner, RowInput
from verispec.engine.scheduler import ScheduledBatch, Scheduler
from verispec.model import kernels, memory
from verispec.model.llama import LlamaModel
from verispec.model.tokenizer import IncrementalDetokenizer, Tokenizer
from verispec.outputs import RequestOutput
from verispec.request import Request, SpecOverride, Status  # noqa: F401 (SpecOverride: the engine's API)
from verispec.sampling import SamplingParams, SamplingTensors, make_generator, sample
from verispec.spec.policy import RoundReport, RoundTimer, RowOffer, RowResult, SpeculationPolicy
from verispec.spec.proposer import ProposerContext, build_proposers
from verispec.spec.rejection import RejectionResult, greedy_accept, rejection_sample

log = logging.getLogger("verispec")


# The most draft tokens a request may ask for: a verify row is 1 + k tokens, and past 16
# the chance that every draft is accepted is too small to pay for the pass.
MAX_SPEC_TOKENS = 16


class LLMEngine:
    """Synchronous engine; drive it from one thread (the server wraps it in AsyncEngine)."""

    def __init__(self, config: EngineConfig, target: LlamaModel, tokenizer: Tokenizer,
                 draft: LlamaModel | None = None, vocab_limit: int | None = None):
        ops = None
        if config.kernels != "off" and target.embed_tokens.weight.device.type == "cpu":
            ops = kernels.load(required=config.kernels == "on")
        huge_pages = False
        if config.huge_pages and memory.huge_pages_available():
            for model in (target, draft):
                if model is not None:  # before the kernels: the decoder stack is built from these
                    huge_pages = memory.move_to_huge_pages(model) > 0 or huge_pages
        for model in (target, draft):
            if model is not None:
                if ops is None and model.weight_format == "int4a8":
                    raise ValueError("weight format 'int4a8' (int4 on the 8-bit activation grid) runs on "
                                     "verispec's kernels only; they are off (kernels: off, or a device "
                                     "other than the CPU) or could not be built")
                model.kernels = ops
        # The config as run: "auto" weight formats and kernels replaced by what resolved.
        self.config = config = replace(
            config, weight_format=target.weight_format, kernels="on" if ops is not None else "off",
            huge_pages=huge_pages,
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
        self.target = ModelRunner(target, num_slots, cache.block_size, vocab_limit)
        self._shared_generator = torch.Generator().manual_seed(config.seed)
        self.draft_runner = ModelRunner(draft, num_slots, cache.block_size, vocab_limit) if draft else None
        self.proposers, self._unavailable = build_proposers(ProposerContext(
            config, self.draft_runner, self.kv.block_table, self._shared_generator))
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, OutOfBlocks)
        self.policy = SpeculationPolicy(MAX_SPEC_TOKENS)
        self._accepted: dict[str, int] = {}  # this step's accepted drafts, by request
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.eos_ids = set(tokenizer.eos_token_ids)

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
        target, tcfg, tokenizer = load_model(config.model, config)
        draft, vocab_limit = None, None
        if config.draft_model:
            from verispec.spec.compat import check_pair
            draft, dcfg, dtok = load_model(config.draft_model, config, draft=True)
            verdict = check_pair(tokenizer, dtok, tcfg, dcfg)
            if not verdict.ok:
                raise ValueError(f"draft model {config.draft_model!r} cannot draft for "
                                 f"{config.model!r}: {verdict.reason}")
            vocab_limit = verdict.shared_vocab_size
        return cls(config, target, tokenizer, draft, vocab_limit)

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
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens; the context is {self.max_model_len} "
                             "tokens and must leave room for at least one generated token")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the "
                             f"context of {self.max_model_len} tokens (at most {self.max_model_len - n})")
        method, k, adaptive = self._resolve_spec(spec)
        need = -(-(n + params.max_tokens + k + 1) // self.kv.block_size)
        if need > self.kv.num_total_blocks:
            raise ValueError(f"request needs {need} KV blocks; the pool has {self.kv.num_total_blocks}")
        req = Request(request_id, list(prompt_token_ids), params, method, k, adaptive, self._arrivals)
        self._arrivals += 1
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)
        req.generator = make_generator(params, self.target.device)  # None: the shared stream
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _resolve_spec(self, spec: SpecOverride | None) -> tuple[str, int, bool]:
        cfg = self.config.spec
        method = (spec.method if spec and spec.method else None) or cfg.method
        if method in self._unavailable:
            raise ValueError(f"speculative.method {method!r} is not available: {self._unavailable[method]}")
        if method != "none" and method not in self.proposers:
            allowed = ", ".join(repr(m) for m in ("none", *self.proposers))
            raise ValueError(f"speculative.method must be one of {allowed}, got {method!r}")
        k = spec.num_tokens if spec and spec.num_tokens is not None else cfg.num_spec_tokens
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
                           self.kv.num_total_blocks, self.kv.hit_tokens, self.kv.query_tokens)

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
        timer = RoundTimer()
        batch = self.scheduler.schedule_decode()
        rows = batch.decode
        try:
            offers = self._offers(rows)
            ks = self.policy.plan(offers) if rows else []
        except Exception as exc:
            return self._fail(exc, batch)
        # prefill gets the step's token budget less what the decode rows verify (scheduler)
        self.scheduler.schedule_prefill(batch, len(rows) + sum(ks))
        if batch.empty:
            return []
        self._accepted.clear()
        try:
            drafts, passes, caught_up = self._draft(rows, ks, timer)
            outputs = self._verify_and_commit(batch, rows, drafts)
        except Exception as exc:
            return self._fail(exc, batch)
        if rows:
            self.policy.observe(self._report(batch, rows, offers, drafts, passes, caught_up, timer))
        return outputs

    def _fail(self, exc: Exception, batch: ScheduledBatch) -> list[RequestOutput]:
        """One failed step fails its own rows only (decode rows and prefill chunks), never
        the others'."""
        log.exception("engine step failed")
        outputs = []
        for req in {*batch.decode, *(c.request for c in batch.prefill)}:
            req.error = f"internal error: {type(exc).__name__}: {exc}"
            outputs.append(self._finish(req, "abort", cache=False))
        return outputs

    def _offers(self, rows: list[Request]) -> list[RowOffer]:
        """What each row's proposer offers now, up to the row's budget (max_tokens, context)."""
        offers = [RowOffer(r.request_id, None, 0, 0) for r in rows]
        for name, proposer in self.proposers.items():
            members = [i for i, r in enumerate(rows) if r.spec_method == name]
            if not members:
                continue
            reqs = [rows[i] for i in members]
            found = proposer.offer(reqs, [self.scheduler.spec_budget(r) for r in reqs])
            for i, r, o in zip(members, reqs, found):
                offers[i] = RowOffer(r.request_id, name, o.available, r.num_spec_tokens, r.adaptive,
                                     o.catch_up, o.key, r.remaining_tokens, proposer.timed)
        return offers

    def _draft(self, rows: list[Request], ks: list[int], timer: RoundTimer) -> tuple[dict, dict, int]:
        """(draft tokens and q or None by request id, each timed proposer's pass as (rows,
        depth, seconds), catch-up tokens). A timed proposer's catch-up and drafting are
        timed apart (laps "catch_up" and "draft")."""
        drafts: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        passes: dict[str, tuple[int, int, float]] = {}
        caught_up = 0
        for name, proposer in self.proposers.items():
            members = [(r, k) for r, k in zip(rows, ks) if k and r.spec_method == name]
            if not members:
                continue
            reqs, row_ks = [r for r, _ in members], [k for _, k in members]
            timer.lap("round")
            caught_up += proposer.prepare(reqs)
            timer.lap("catch_up" if proposer.timed else "round")
            proposed = proposer.draft(reqs, row_ks)
            seconds = timer.lap("draft" if proposer.timed else "round")
            if proposer.timed:
                passes[name] = (len(reqs), max(row_ks), seconds)
            drafts.update({r.request_id: d for r, d in zip(reqs, proposed) if d[0]})
        return drafts, passes, caught_up

    def _report(self, batch: ScheduledBatch, rows: list[Request], offers: list[RowOffer], drafts: dict,
                passes: dict, caught_up: int, timer: RoundTimer) -> RoundReport:
        """The round for the policy; its verify time is the step's less the timed passes."""
        drafted = {rid: len(tokens) for rid, (tokens, _) in drafts.items()}
        results = [RowResult(r.request_id, o.proposer, o.key, drafted.get(r.request_id, 0),
                             self._accepted.get(r.request_id, 0), r.finished)
                   for r, o in zip(rows, offers) if o.proposer]
        catch_up_s = timer.phases.get("catch_up", 0.0)
        verify_s = None if batch.prefill else timer.total() - timer.phases.get("draft", 0.0) - catch_up_s
        return RoundReport(len(rows), results, verify_s, sum(drafted.values()), passes, (caught_up, catch_up_s))

    def _verify_and_commit(self, batch: ScheduledBatch, rows: list[Request], drafts) -> list[RequestOutput]:
        inputs = []
        for chunk in batch.prefill:
            req = chunk.request
            ids = req.all_ids[chunk.start: chunk.end]
            emits = chunk.end == req.num_tokens  # a fresh prompt's last chunk samples token 1
            inputs.append(RowInput(ids, chunk.start, self.kv.block_table(req.request_id),
                                   len(ids) - 1 if emits else len(ids)))
        for req in rows:
            d_tokens = drafts.get(req.request_id, ([], None))[0]
            base = req.num_computed  # position of the pending token
            slots = self.target.slots(self.kv.block_table(req.request_id), base + 1, base + 1 + len(d_tokens))
            if d_tokens:
                self.kv.insert_provisional(req.request_id, d_tokens, slots, base + 1)
            inputs.append(RowInput([req.all_ids[-1]] + d_tokens, base, self.kv.block_table(req.request_id), 0))
        logits = self.target.forward(inputs)
        outputs = self._after_prefill(batch.prefill, logits[: len(batch.prefill)])
        outputs.extend(self._accept(rows, logits[len(batch.prefill):], drafts))
        return outputs

    def _after_prefill(self, chunks, logits: list[torch.Tensor]) -> list[RequestOutput]:
        """Commit prefill chunks; prompts that are now complete sample their first token."""
        done, last = [], []
        for chunk, lg in zip(chunks, logits):
            req = chunk.request
            req.num_computed = chunk.end
            req.stats.target_forwards += 1
            self.kv.commit(req.request_id, chunk.end)
            if req.is_prefilling or lg.shape[0] == 0:
                continue
            if self.config.cache.prefix_cache:
                req.draft_computed = self.kv.cache_sequence(req.request_id, req.all_ids[: req.num_computed],
                                                            req.draft_computed)
            done.append(req)
            last.append(lg[-1:])
        if not done:
            return []
        probs = SamplingTensors.from_params([r.params for r in done], last[0].device).to_probs(torch.cat(last))
        tokens = sample(probs, [r.generator for r in done], shared_generator=self._shared_generator).tolist()
        return [out for req, t in zip(done, tokens) for out in self._append_tokens(req, [t])]

    def _accept(self, rows: list[Request], logits: list[torch.Tensor], drafts) -> list[RequestOutput]:
        """Verify every row's drafts, commit, emit."""
        if not rows:
            return []
        counts = [lg.shape[0] for lg in logits]  # k_i + 1 per row
        proposed = [drafts.get(r.request_id, ([], None))[0] for r in rows]
        flat = logits[0] if len(logits) == 1 else torch.cat(logits)  # (sum(k_i + 1), V)
        if all(r.params.greedy for r in rows):  # the same result from argmaxes, no V-wide work
            argmax = kernels.greedy_tokens(flat, self.target.model.kernels)
            starts = itertools.accumulate([0] + counts)
            accepted_lens, emitted = greedy_accept([argmax[s: s + c] for s, c in zip(starts, counts)], proposed)
        else:
            k_max = max(counts) - 1
            draft_tokens = torch.tensor([t + [0] * (k_max - len(t)) for t in proposed],
                                        dtype=torch.long).view(len(rows), k_max)  # (B, K)
            result = self._rejection_sample(rows, flat, counts, draft_tokens, drafts)
            accepted_lens, num_output = result.accepted_len.tolist(), result.num_output.tolist()
            emitted = [e[:n] for e, n in zip(result.output_tokens.tolist(), num_output)]
        outputs = []
        for i, r in enumerate(rows):
            k = counts[i] - 1
            accepted = accepted_lens[i]
            new = emitted[i]
            base = r.num_computed
            if k:  # commits the pending token (its KV was just written) and the accepted drafts
                self.kv.commit_provisional(r.request_id, accepted)
                self.kv.evict_provisional(r.request_id)
            else:
                self.kv.commit(r.request_id, base + 1)
            self._accepted[r.request_id] = accepted
            self._rollback(r, base, accepted, k)
            r.stats.record_round(k, accepted)
            r.stats.target_forwards += 1
            outputs.extend(self._append_tokens(r, new))
        return outputs

    def _rejection_sample(self, rows: list[Request], flat_logits: torch.Tensor, counts: list[int],
                          draft_tokens: torch.Tensor, drafts) -> RejectionResult:
        """The general path: every row's distribution from its settings, then the sampler."""
        st = SamplingTensors.from_params([r.params for r in rows], flat_logits.device).expand(counts)
        target_probs = _pad_rows(st.to_probs(flat_logits), counts)  # (B, K+1, V)
        k_max, vocab = draft_tokens.shape[1], flat_logits.shape[-1]
        has_q = any(drafts.get(r.request_id, (None, None))[1] is not None for r in rows)
        draft_probs = torch.zeros(len(rows), k_max, vocab) if has_q else None  # (B, K, V)
        if has_q:
            for i, r in enumerate(rows):
                toks, q = drafts.get(r.request_id, ([], None))
                if q is not None:
                    draft_probs[i, : len(toks)] = q
                elif toks:  # mixed batch: one-hot q for probability-free rows
                    draft_probs[i, torch.arange(len(toks)), torch.tensor(toks)] = 1.0
        return rejection_sample(target_probs, draft_tokens, draft_probs, [c - 1 for c in counts],
                                [r.generator for r in rows], shared_generator=self._shared_generator)

    def _rollback(self, req: Request, base: int, accepted: int, k: int) -> None:
        """O(1) per row: only the pending token and the accepted drafts stay as context.

        The KV written for rejected drafts (target and draft model) stays in its slots but
        is past the row's length, so no mask admits it until a later pass overwrites it.
        """
        req.num_computed = base + 1 + accepted
        proposer = self.proposers.get(req.spec_method)
        if proposer is not None:
            proposer.rollback(req)

    # ------------------------------------------------------------------ tokens, stops, finish
    def _append_tokens(self, req: Request, tokens: list[int]) -> list[RequestOutput]:
        """Append accepted tokens one by one, stopping at EOS, max_tokens or a stop string.

        Text that could still turn out to be the start of a stop string is held back
        (req.held_text) rather than emitted: streamed text cannot be taken back.
        """
        stops = req.params.stop
        full = req.text + req.held_text  # all text decoded so far, emitted or held
        new_ids, reason, stop_hit = [], None, False
        for t in tokens:
            req.append_output(t)
            new_ids.append(t)
            if t in self.eos_ids and not req.params.ignore_eos:
                reason = "stop"
                break
            searched = len(full)
            full += req.detokenizer.push([t])
            hit = _find_stop(full, stops, searched) if stops else None
            if hit is not None:  # the stop string and anything after it are not returned
                full, reason, stop_hit = full[:hit], "stop", True
                break
            if len(req.output_ids) >= req.params.max_tokens:
                reason = "length"
                break
        if reason and not stop_hit:
            full += req.detokenizer.flush()  # text held back for an unfinished character
        hold = 0 if reason else max((len(s) for s in stops), default=1) - 1
        emit_upto = max(len(req.text), len(full) - hold)
        new_text = full[len(req.text): emit_upto]
        req.text, req.held_text = full[:emit_upto], full[emit_upto:]
        if reason:
            return [self._finish(req, reason, cache=True, new_ids=new_ids, new_text=new_text)]
        return [self._output(req, new_ids, new_text)]

    def _finish(self, req: Request, reason: str, cache: bool, new_ids=(), new_text="") -> RequestOutput:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.scheduler.remove(req)
        keep = req.all_ids[: req.num_computed] if cache and self.config.cache.prefix_cache else None
        if req.request_id in self.kv:  # a request still waiting holds no blocks
            self.kv.close_sequence(req.request_id, keep, req.draft_computed)
        for proposer in self.proposers.values():
            proposer.forget(req.request_id)
        self.policy.forget(req.request_id)
        del self.requests[req.request_id]
        return self._output(req, list(new_ids), new_text)

    def _output(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt_ids, list(req.output_ids), new_ids, req.text,
                             new_text, req.finished, req.finish_reason, req.stats, req.error)


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
    if gguf_path is not None and config.dtype == "bfloat16" and not draft:  # drafts: no cache (ApproxHead)
        # A subfolder: the loader reads every *.safetensors beside model.safetensors.
        runtime = cache_dir_for(gguf_path) / "runtime" / f"{config.dtype}-{config.weight_format}-{_RUNTIME_LAYOUT}.safetensors"
    if runtime is not None and runtime.exists():
        mcfg, tokenizer = load_config_and_tokenizer(source)
        with safe_open(str(runtime), framework="pt") as f:
            meta, state = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        return LlamaModel.from_runtime_state(mcfg, state, meta), mcfg, tokenizer
    mcfg, state, tokenizer = load_model_files(source)
    model = LlamaModel.from_state_dict(mcfg, state, dtype=getattr(torch, config.dtype),
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


def _pad_rows(flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """(sum(counts), ...) -> (len(counts), max(counts), ...), rows zero-padded; a view when equal."""
    width = max(counts)
    if all(c == width for c in counts):  # e.g. batch 1, or every row at the same k
        return flat.view(len(counts), width, *flat.shape[1:])
    out = flat.new_zeros(len(counts), width, *flat.shape[1:])
    out[torch.arange(width)[None, :] < torch.tensor(counts)[:, None]] = flat
    return out


def _find_stop(text: str, stops: tuple[str, ...], searched_upto: int) -> int | None:
    """Index where the earliest stop string starts, looking only where it could be new."""
    best = None
    for s in stops:
        i = text.find(s, max(0, searched_upto - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
