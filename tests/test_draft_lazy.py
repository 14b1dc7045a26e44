"""The draft model's KV is filled lazily, and the prefix cache knows which blocks hold it.

* a request that never drafts never runs the draft model; one that drafts catches up on
  exactly the tokens its draft KV lacks (the whole prompt on its first draft);
* after a prefix-cache hit on blocks that hold target KV only, the draft model recomputes
  them: its proposals equal those of a cold engine; blocks that do hold draft KV are reused;
* the draft cost the policy learns excludes catch-ups (one-off costs), and the policy is
  told what each row must catch up on before it drafts.
Each is shown to fail on an engine that breaks it.
"""
from __future__ import annotations

import time

import pytest

from tiny import run_all, tiny_engine, tiny_pair
from verispec.cache.manager import KVCacheManager
from verispec.cache.radix import RadixCache
from verispec.engine.engine import LLMEngine, SpecOverride
from verispec.sampling import SamplingParams
from verispec.spec.draft_model import DraftModelProposer

VOCAB = 48
PAIR = tiny_pair(vocab=VOCAB, noise=0.1, seed=3)
PROMPT = [(7 * i + 3) % VOCAB for i in range(22)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PLAIN, NGRAM, DRAFT = SpecOverride(method="none"), SpecOverride(method="ngram"), SpecOverride(method="draft")


def engine(**kw) -> LLMEngine:
    target, draft = PAIR
    return tiny_engine(target, draft, method="draft", k=3, **kw)


def draft_tokens_run(eng: LLMEngine) -> list[int]:
    """Wrap the draft model's runner: log the tokens of every forward it runs."""
    log = []
    forward = eng.proposers['draft'].runner.forward

    def logged(rows):
        log.append(sum(len(r.token_ids) for r in rows))
        return forward(rows)
    eng.proposers['draft'].runner.forward = logged
    return log


def proposals(eng: LLMEngine) -> list[list[int]]:
    """Wrap the proposer: log every drafted token list."""
    log = []
    propose = eng.proposers['draft'].draft

    def logged(reqs, ks):
        out = propose(reqs, ks)
        log.extend(tokens for tokens, _ in out)
        return out
    eng.proposers['draft'].draft = logged
    return log


def eager_prefill(monkeypatch):
    """Broken: the draft model prefills every prompt with the target (the old eager way)."""
    after = LLMEngine._sample_first

    def eager(self, chunks, logits, readback):
        self.proposers['draft'].catch_up([c.request for c in chunks])
        return after(self, chunks, logits, readback)
    monkeypatch.setattr(LLMEngine, "_sample_first", eager)


@pytest.mark.parametrize("broken", [False, True])
def test_only_drafting_requests_run_the_draft_model(monkeypatch, broken):
    if broken:
        eager_prefill(monkeypatch)
    eng = engine()
    run_all(eng, [PROMPT, PROMPT[:13]], GREEDY, spec=PLAIN)
    run_all(eng, [PROMPT[5:]], GREEDY, spec=NGRAM)
    run_all(eng, [PROMPT[3:]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), spec=DRAFT)
    fails = eng.proposers['draft'].catch_up_tokens != 0
    # A drafting request catches up on its whole prompt once (the first generated token is
    # pending), then every round feeds the one or two tokens the last round left unseen.
    eng2 = engine(prefix_cache=False)
    run_all(eng2, [PROMPT], GREEDY, spec=DRAFT)
    fails |= eng2.proposers['draft'].catch_up_tokens != len(PROMPT)
    assert fails == broken


@pytest.mark.parametrize("broken", [False, True])
def test_draft_proposals_after_a_hit_on_target_only_blocks_match_a_cold_engine(monkeypatch, broken):
    if broken:  # trusts every cached block to hold draft KV
        monkeypatch.setattr(KVCacheManager, "cached_draft_tokens", KVCacheManager.num_committed)
    cold = engine()
    cold_log = proposals(cold)
    run_all(cold, [PROMPT + [1]], GREEDY, spec=DRAFT)
    warm = engine()
    run_all(warm, [PROMPT + [2]], GREEDY, spec=PLAIN)  # caches the prompt's blocks, no draft KV
    warm_log = proposals(warm)
    run_all(warm, [PROMPT + [1]], GREEDY, spec=DRAFT)
    assert warm.kv.hit_tokens == 20  # the prompt's whole blocks came from the cache
    assert (warm_log != cold_log) == broken


@pytest.mark.parametrize("broken", [False, True])
def test_blocks_with_draft_kv_are_reused(monkeypatch, broken):
    if broken:  # a tree that never records draft KV
        insert = RadixCache.insert
        monkeypatch.setattr(RadixCache, "insert", lambda self, t, b, draft_tokens=0: insert(self, t, b))
    eng = engine()
    run_all(eng, [PROMPT + [2]], GREEDY, spec=DRAFT)
    before = eng.proposers['draft'].catch_up_tokens
    log = proposals(eng)
    run_all(eng, [PROMPT + [1]], GREEDY, spec=DRAFT)
    # 20 of the 23 prompt tokens hit the cache with their draft KV: 3 left to catch up.
    reused = eng.proposers['draft'].catch_up_tokens - before == 3
    cold = engine()
    cold_log = proposals(cold)
    run_all(cold, [PROMPT + [1]], GREEDY, spec=DRAFT)
    assert log == cold_log
    assert reused != broken


@pytest.mark.parametrize("broken", [False, True])
def test_draft_cost_excludes_catch_ups(monkeypatch, broken):
    slow = 0.2
    catch_up = DraftModelProposer.catch_up

    def slow_catch_up(self, reqs):
        if any(r.num_tokens - 1 - r.draft_computed > 1 for r in reqs):
            time.sleep(slow)
        return catch_up(self, reqs)
    monkeypatch.setattr(DraftModelProposer, "catch_up", slow_catch_up)
    if broken:  # catches up inside propose, so the draft pass is timed with it
        propose = DraftModelProposer.draft
        monkeypatch.setattr(DraftModelProposer, "catch_up", lambda self, reqs: 0)
        monkeypatch.setattr(DraftModelProposer, "draft",
                            lambda self, reqs, ks: (slow_catch_up(self, reqs), propose(self, reqs, ks))[1])
    eng = engine()
    draft = []
    observe = eng.policy.observe
    eng.policy.observe = lambda report: (draft.extend(s for _, _, s in report.draft_passes.values()),
                                         observe(report))
    run_all(eng, [PROMPT, PROMPT[4:]], GREEDY, spec=DRAFT)
    assert draft and (max(draft) >= slow) == broken


@pytest.mark.parametrize("broken", [False, True])
def test_the_policy_is_told_each_rows_catch_up_and_budget(monkeypatch, broken):
    if broken:  # tells the policy nothing about catch-ups
        monkeypatch.setattr(DraftModelProposer, "missing", staticmethod(lambda req: 0))
    eng = engine(adaptive=True)
    seen, wrong = [], []
    plan = eng.policy.plan

    def logged(rows):
        for row in rows:
            req = eng.requests[row.request_id]
            lacking = req.num_tokens - 1 - req.draft_computed
            seen.append(row.catch_up)
            wrong.append(row.catch_up != (lacking if lacking > 1 else 0)
                         or row.remaining != req.params.max_tokens - len(req.output_ids)
                         or row.available != eng.scheduler.spec_budget(req) or not row.timed)
        return plan(rows)
    eng.policy.plan = logged
    run_all(eng, [PROMPT, PROMPT[6:]], GREEDY, spec=DRAFT)
    # Every row's count was exact, and a prompt's catch-up was announced.
    assert (not any(wrong) and max(seen) >= len(PROMPT) - 6) != broken
