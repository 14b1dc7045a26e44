"""The scheduler, KV pool, prefix cache and provisional tier, driven through the real engine.

Property: whatever the interleaving (arrivals at random steps, shared prefixes, chunked
prefill, speculation with random acceptance, preemption in a tiny pool, cancellations),
after every step the KV pool and radix tree are consistent, and every request that was not
cancelled produces exactly the greedy output it produces when run alone without any cache
(float32). Broken variants (committing drafts before verification, freeing blocks the pool
has already handed out) are shown to be caught by the same property.
"""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bugs import keep_stale_draft_kv
from tiny import run_all, tiny_engine, tiny_pair
from verispec.cache.manager import KVCacheManager
from verispec.engine.engine import LLMEngine
from verispec.engine.scheduler import Scheduler
from verispec.request import Request
from verispec.sampling import SamplingParams

VOCAB = 48
PAIR = tiny_pair(vocab=VOCAB, noise=0.1, seed=3)
PREFIXES = [[5, 9, 2, 7, 5, 9, 2, 7], [1, 1, 4, 4, 1, 1, 4], [30, 31, 32, 33, 30, 31]]


@functools.lru_cache(maxsize=None)
def alone(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy output of one request run alone: plain decoding, no prefix cache, big pool."""
    engine = tiny_engine(PAIR[0], method="none", prefix_cache=False)
    return run_all(engine, [list(prompt)], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


request_st = st.fixed_dictionaries({
    "prefix": st.sampled_from(range(len(PREFIXES))),
    "suffix": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    "max_tokens": st.integers(1, 14),
    "arrival": st.integers(0, 6),
    "cancel_at": st.one_of(st.none(), st.none(), st.none(), st.integers(0, 12)),
})
scenario_st = st.fixed_dictionaries({
    "requests": st.lists(request_st, min_size=1, max_size=7),
    "method": st.sampled_from(["none", "ngram", "draft"]),
    "k": st.integers(1, 6),
    "kv_blocks": st.integers(12, 40),       # 12 blocks of 4 fit any single request
    "prefix_cache": st.booleans(),
    "max_num_seqs": st.integers(1, 6),
    "max_batched_tokens": st.integers(8, 48),
})


def run_scenario(sc: dict) -> tuple[dict, dict, LLMEngine]:
    """Drive the engine step by step; returns final outputs, the requests, and the engine."""
    target, draft = PAIR
    engine = tiny_engine(target, draft if sc["method"] == "draft" else None, method=sc["method"], k=sc["k"],
                         num_kv_tokens=4 * sc["kv_blocks"], block_size=4, prefix_cache=sc["prefix_cache"],
                         max_num_seqs=sc["max_num_seqs"], max_batched_tokens=sc["max_batched_tokens"])
    reqs = {f"q{i}": r for i, r in enumerate(sc["requests"])}
    final, step = {}, 0
    while len(final) < len(reqs):
        for rid, r in reqs.items():
            if r["arrival"] == step:
                prompt = PREFIXES[r["prefix"]] + r["suffix"]
                engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                               ignore_eos=True))
            if r["cancel_at"] == step and rid not in final and r["arrival"] <= step:
                engine.abort_request(rid)
                final[rid] = None
        for out in engine.step():
            if out.finished and rid_not_cancelled(final, out.request_id):
                final[out.request_id] = out
        engine.check_integrity()
        step += 1
        assert step < 400, "a request starved"
    return final, reqs, engine


def rid_not_cancelled(final: dict, rid: str) -> bool:
    return not (rid in final and final[rid] is None)


def check_scenario(sc: dict) -> None:
    final, reqs, engine = run_scenario(sc)
    for rid, r in reqs.items():
        out = final[rid]
        if out is None:
            continue
        assert out.error is None, out.error
        want = alone(tuple(PREFIXES[r["prefix"]] + r["suffix"]), r["max_tokens"])
        assert out.token_ids == want, f"{rid} diverged from its run-alone output"
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert engine.kv.num_free_blocks + engine.kv.num_cached_blocks == engine.kv.num_total_blocks, "leaked blocks"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(scenario_st)
def test_any_interleaving_keeps_integrity_and_run_alone_outputs(sc):
    check_scenario(sc)


def test_a_tiny_pool_preempts_mid_speculation_and_stays_correct():
    sc = {"requests": [{"prefix": i % 3, "suffix": [i + 1, i + 2, i + 3], "max_tokens": 14, "arrival": 0,
                        "cancel_at": None} for i in range(6)],
          "method": "draft", "k": 5, "kv_blocks": 12, "prefix_cache": True, "max_num_seqs": 6,
          "max_batched_tokens": 48}
    final, _, engine = run_scenario(sc)
    assert sum(o.spec.num_drafts for o in final.values()) > 0
    assert engine.num_preemptions > 0, "the pool was meant to force preemption"
    check_scenario(sc)


def _free_without_truncating(self, seq_id):
    """Broken: release rejected blocks to the pool but keep them in the block table."""
    state = self._state(seq_id)
    if state.provisional is None:
        return 0
    keep = -(-state.num_committed // self.block_size)
    state.provisional = None
    for block in state.block_table[keep:]:
        self.pool.decref(block)
    return 0


BROKEN = {
    "commit_before_verification": lambda mp: mp.setattr(LLMEngine, "_rollback", keep_stale_draft_kv),
    "free_a_reused_block": lambda mp: mp.setattr(KVCacheManager, "evict_provisional", _free_without_truncating),
    "all_ids_not_kept_up": lambda mp: mp.setattr(Request, "append_output", lambda self, t: self.output_ids.append(t)),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_the_property_catches_broken_variants(monkeypatch, variant):
    BROKEN[variant](monkeypatch)
    failures = 0
    for seed in range(6):
        sc = {"requests": [{"prefix": (i + seed) % 3, "suffix": [i + seed + 1, 7, i], "max_tokens": 12,
                            "arrival": i % 3, "cancel_at": None} for i in range(5)],
              "method": "draft", "k": 4, "kv_blocks": 14 + seed, "prefix_cache": True, "max_num_seqs": 5,
              "max_batched_tokens": 32}
        try:
            check_scenario(sc)
        except (AssertionError, ValueError, RuntimeError):
            failures += 1
    assert failures > 0, f"{variant} went unnoticed"


def _prefill_chunks(method: str, k: int, choose=None) -> tuple[list[int], list[int]]:
    """Three rows decoding, then a 60-token prompt arrives under a 24-token step budget: the
    prompt's chunk per step, and the tokens the decode rows verified in that step (1 + k each).
    `choose(ks)` may rewrite the engine's chosen ks before they are used."""
    engine = tiny_engine(PAIR[0], method=method, k=k, max_batched_tokens=24, prefix_cache=False)
    real_plan = engine.policy.plan
    verified = []

    def recording_plan(rows):
        ks = real_plan(rows)
        ks = choose(ks) if choose else ks
        verified.append(len(rows) + sum(ks))
        return ks

    engine.policy.plan = recording_plan
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"d{i}", [3, 4, 5, 3, 4, 5, 3, i], params)
    while any(r.is_prefilling for r in engine.requests.values()):
        engine.step()
    engine.add_request("long", [7, 8, 9, 10] * 15, params)
    long, chunks, seen = engine.requests["long"], [], 0
    verified.clear()
    while long.is_prefilling:
        engine.step()
        chunks.append(long.num_computed - seen)
        seen = long.num_computed
    return chunks, verified[: len(chunks)]


def test_prefill_gets_the_step_budget_less_the_drafts_chosen_not_k_max():
    plain, plain_verified = _prefill_chunks("none", 1)
    assert plain_verified == [3] * len(plain) and plain[0] == 24 - 3
    # a speculative engine that chose k = 0 for every row schedules prefill as a plain one
    assert _prefill_chunks("ngram", 6, choose=lambda ks: [0] * len(ks))[0] == plain
    # and one that drafts gives prefill what its drafts leave, step by step
    chunks, verified = _prefill_chunks("ngram", 6)
    assert any(v > 3 for v in verified), "the decode rows were meant to draft"
    assert chunks[:-1] == [24 - v for v in verified[:-1]]


def test_the_prefill_budget_test_catches_charging_k_max(monkeypatch):
    real = Scheduler.schedule_prefill
    monkeypatch.setattr(Scheduler, "schedule_prefill", lambda self, batch, verify_tokens: real(
        self, batch, sum(1 + self.spec_budget(r) for r in batch.decode)))
    with pytest.raises(AssertionError):
        test_prefill_gets_the_step_budget_less_the_drafts_chosen_not_k_max()
