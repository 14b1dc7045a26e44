"""Continuous batching with admission by KV budget, chunked prefill and preemption.

Pure Python over `Request` objects and a KV manager (`cache.manager.KVCacheManager`); it
never touches tensors. Each step is scheduled in two phases, with the draft lengths chosen
between them:

1. `schedule_decode`: decode rows first (latency-critical). Every running request that has
   finished its prefill reserves KV slots for its pending token plus its k_max draft tokens
   (the k+1 speculative slots). If the pool is out of blocks, the most recently arrived
   running request is preempted (its provisional blocks evicted first, then everything
   freed; it recomputes later) until the reservation fits.
2. `schedule_prefill(batch, verify_tokens)`: prefill chunks with what is left of the step's
   token budget once the decode rows' verify tokens (one per row plus the drafts actually
   chosen) are counted: running requests still prefilling, then waiting requests in
   arrival order (FCFS). The head of the queue is never skipped, so no request starves: a
   request that cannot be admitted blocks later ones.

Both phases take `only`, a set of request ids: the engine's rerun of a failed step on a
subset of its rows schedules just those (and admits nobody).

The budget is charged the drafts the step will verify, not the k_max it reserved slots for:
charged at k_max, a speculative engine that chose k = 0 for most rows (as adaptive draft
length does where drafting does not pay) cut every prefill chunk short by k_max tokens a
row (128 of 512 at 16 rows and k_max = 8), and so scheduled prefill unlike a plain engine
doing the same work.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from verispec.config import SchedulerConfig
from verispec.request import Request, Status


@dataclass
class PrefillChunk:
    request: Request
    start: int
    end: int


@dataclass
class ScheduledBatch:
    decode: list[Request] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv, max_model_len: int, out_of_blocks: type[Exception]):
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len
        self._out_of_blocks = out_of_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def spec_budget(self, req: Request) -> int:
        """Most draft tokens this request may verify now (k_max clipped to what is left)."""
        if req.spec_method == "none":
            return 0
        room = min(req.remaining_tokens - 1, self.max_model_len - req.num_tokens)
        return max(0, min(req.num_spec_tokens, room))

    def schedule_decode(self, only: set[str] | None = None) -> ScheduledBatch:
        """Phase 1: the decode rows, each with KV slots reserved for 1 + its spec budget.

        `only` (a rerun of a failed step on a subset): just these running requests' rows;
        preemption may still pick any running request as its victim."""
        batch = ScheduledBatch()
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status is not Status.RUNNING or req.is_prefilling:
                continue
            if only is not None and req.request_id not in only:
                continue
            if self._reserve_decode(req, batch):
                batch.decode.append(req)
        return batch

    def schedule_prefill(self, batch: ScheduledBatch, verify_tokens: int, only: set[str] | None = None) -> None:
        """Phase 2: prefill chunks within the step's token budget less `verify_tokens`, the
        tokens the decode rows will verify (one each plus their chosen drafts).

        `only` (a rerun of a failed step on a subset): just these running requests'
        chunks, and no waiting request is admitted."""
        budget = self.cfg.max_num_batched_tokens - verify_tokens
        for req in sorted(self.running, key=lambda r: r.arrival):
            if budget <= 0:
                break
            if only is not None and req.request_id not in only:
                continue
            if req.status is Status.RUNNING and req.is_prefilling:
                budget -= self._schedule_prefill(req, budget, batch)
        if only is None:
            self._admit(batch, budget)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Waiting requests in arrival order (FCFS), each with a first prefill chunk."""
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            req.num_computed = self.kv.open_sequence(req.request_id, req.all_ids)
            req.draft_computed = self.kv.cached_draft_tokens(req.request_id)
            used = self._schedule_prefill(req, budget, batch)
            if used == 0:
                self.kv.close_sequence(req.request_id)
                req.num_computed = req.draft_computed = 0
                break
            self.waiting.popleft()
            if req.num_cached_tokens is None:  # the first admission (not a preempted recompute)
                req.num_cached_tokens = req.num_computed
                req.scheduled_at = time.monotonic()
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= used

    def _reserve_decode(self, req: Request, batch: ScheduledBatch) -> bool:
        """Reserve slots for [pending token, k_max drafts]; preempt newer requests if needed."""
        start = req.num_computed
        end = start + 1 + self.spec_budget(req)
        while True:
            try:
                self.kv.allocate_slots(req.request_id, start, end)
                return True
            except self._out_of_blocks:
                victim = max((r for r in self.running if r.status is Status.RUNNING),
                             key=lambda r: r.arrival)
                self.preempt(victim, batch)
                if victim is req:
                    return False

    def _schedule_prefill(self, req: Request, budget: int, batch: ScheduledBatch) -> int:
        end = min(req.prefill_target, req.num_computed + budget)
        if end <= req.num_computed:
            return 0
        try:
            self.kv.allocate_slots(req.request_id, req.num_computed, end)
        except self._out_of_blocks:
            return 0
        batch.prefill.append(PrefillChunk(req, req.num_computed, end))
        return end - req.num_computed

    def preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Free everything the request holds (provisional blocks first); it recomputes later."""
        self.kv.preempt(req.request_id)
        self.running.remove(req)
        if req in batch.decode:
            batch.decode.remove(req)
        batch.prefill = [c for c in batch.prefill if c.request is not req]
        req.status = Status.WAITING
        req.num_computed = req.draft_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(req)
        # Back to its FCFS place: the queue is kept in arrival order.
        self.waiting.append(req)
        self.waiting = deque(sorted(self.waiting, key=lambda r: r.arrival))
