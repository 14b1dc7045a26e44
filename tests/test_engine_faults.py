"""One poisoned request never fails the batch around it.

Faults are injected from the tests only (the target forward, a proposer, a detokenizer,
each raising only while the marked request "bad" is in play). Every other request must end
with exactly the greedy tokens of an undisturbed run (same arrivals, no fault); "bad" ends
alone with finish_reason "abort", an error of its own that carries no exception text, and
its KV freed; the KV pool stays consistent after every step. Each property is shown to
fail on a "bug twin": the isolation or the rollback disabled.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

import verispec.spec.proposer as proposer_mod
from fake_proposer import CountingProposer
from tiny import tiny_engine, tiny_pair
from verispec.engine import messages as M
from verispec.engine.core import EngineCore
from verispec.engine.engine import LLMEngine
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams

VOCAB = 48
PAIR = tiny_pair(vocab=VOCAB, noise=0.1, seed=3)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SECRET = "the secret prompt of another user"
OWN_ERROR = "internal error while generating this request (RuntimeError); see the server log"
LAST_RESORT = "failed: the step raised out of the engine"


def _prompt(seed: int, n: int) -> list[int]:
    """A prompt that repeats itself, so prompt lookup has drafts to offer."""
    half = torch.randint(0, VOCAB, (n // 2 + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (half * 2)[:n]


# Decode rows from step 1 on; "bad" prefills at step 1; "long" prefills in chunks from step 4.
ARRIVALS = {0: [("r0", _prompt(1, 8)), ("r1", _prompt(2, 10)), ("r2", _prompt(3, 6))],
            1: [("bad", _prompt(4, 9))],
            4: [("long", _prompt(5, 40))]}
INNOCENT = ["r0", "r1", "r2", "long"]


def engine(method: str = "ngram") -> LLMEngine:
    target, draft = PAIR
    return tiny_engine(target, draft if method == "draft" else None, method=method, k=3, max_batched_tokens=24)


def drive(eng: LLMEngine, params=GREEDY, spec=None, arrivals=ARRIVALS) -> tuple[dict, list[str]]:
    """Step until done: ({request id: final output, or LAST_RESORT}, integrity failures).

    A step that raises out of the engine is handled as EngineCore.step does: every request
    in flight is aborted."""
    final, broken, step = {}, [], 0
    while step <= max(arrivals) or eng.has_unfinished_requests():
        for rid, prompt in arrivals.get(step, []):
            eng.add_request(rid, prompt, params, spec.get(rid) if spec else None)
        try:
            outputs = eng.step()
        except Exception:
            outputs = []
            for rid in list(eng.requests):
                eng.abort_request(rid)
                final[rid] = LAST_RESORT
        final.update({o.request_id: o for o in outputs if o.finished})
        try:
            eng.check_integrity()
        except AssertionError as exc:
            broken.append(str(exc))
        step += 1
        assert step < 200, "the engine hangs"
    return final, broken


@functools.lru_cache(maxsize=None)
def undisturbed(method: str) -> dict[str, list[int]]:
    final, broken = drive(engine(method))
    assert not broken and all(o.error is None for o in final.values())
    return {rid: o.token_ids for rid, o in final.items()}


def holds(eng: LLMEngine, rid: str, rows) -> bool:
    """Whether a forward's rows include request `rid`'s (its block table identifies it)."""
    return rid in eng.kv and any(r.block_table == eng.kv.block_table(rid) for r in rows)


def drafting(eng: LLMEngine) -> bool:
    """Whether the forward about to run verifies drafts (provisional KV to roll back)."""
    return any(eng.kv.provisional(rid) for rid in eng.requests if rid in eng.kv)


def poison_forward(monkeypatch, eng: LLMEngine, active=lambda eng: True) -> dict:
    """From the first forward that holds "bad"'s row while `active(eng)`, every forward that
    holds it raises. Returns {"calls": forwards run, "first": the first poisoned forward's
    (rows, whether a prefill chunk was among them, whether rows drafted)}."""
    real, seen = eng.target.forward, {"calls": 0}

    def forward(rows):
        seen["calls"] += 1
        if holds(eng, "bad", rows) and ("first" in seen or active(eng)):
            seen.setdefault("first", (len(rows), any(r.logits_from > 0 for r in rows), drafting(eng)))
            raise RuntimeError(f"poisoned row: {SECRET}")
        return real(rows)
    monkeypatch.setattr(eng.target, "forward", forward)
    return seen


def disable_isolation(monkeypatch) -> None:
    """Bug twin: a step that raises fails every row it scheduled (what the engine once did)."""
    monkeypatch.setattr(LLMEngine, "_isolate", lambda self, fault: [self._fail_row(r, fault.exc) for r in fault.rows])


def skip_rollback(monkeypatch) -> None:
    """Bug twin: a failed attempt's rows are rerun without being rolled back."""
    monkeypatch.setattr(LLMEngine, "_restore", lambda self, mark: None)


TWINS = {"none": lambda mp: None, "no_isolation": disable_isolation, "no_rollback": skip_rollback}


def verdict(eng: LLMEngine, final: dict, broken: list[str], method: str) -> dict[str, bool]:
    """Each check of the contract, by name: True where it holds."""
    want = undisturbed(method)
    bad = final.get("bad")
    return {
        "innocents_exact": all(getattr(final[r], "token_ids", None) == want[r] for r in INNOCENT)
        and all(final[r].error is None for r in INNOCENT),
        "bad_fails_alone": getattr(bad, "finish_reason", None) == "abort" and bad.error == OWN_ERROR,
        "no_leak": all(SECRET not in str(getattr(o, "error", "")) for o in final.values()),
        "kv_freed": "bad" not in eng.kv and eng.stats().kv_blocks_used == 0,
        "integrity": not broken,
        "counted": eng.step_errors == 1 and SECRET in (eng.last_step_error or ""),
    }


@pytest.mark.parametrize("where", ["prefill", "decode"])
@pytest.mark.parametrize("twin", ["none", "no_isolation", "no_rollback"])
def test_a_faulty_forward_row_fails_alone(monkeypatch, where, twin):
    TWINS[twin](monkeypatch)
    eng = engine()
    # "prefill": bad's prefill chunk poisons the forward (beside drafting decode rows);
    # "decode": bad's decode row, once "long" prefills beside it and rows draft.
    active = (lambda e: True) if where == "prefill" else (lambda e: "long" in e.kv and drafting(e))
    seen = poison_forward(monkeypatch, eng, active)
    checks = verdict(eng, *drive(eng), "ngram")
    failing = {name for name, ok in checks.items() if not ok}
    assert seen["first"] == (4 if where == "prefill" else 5, True, True)  # rows, a chunk, drafts
    if twin == "none":
        assert not failing
    elif twin == "no_isolation":
        assert failing == {"innocents_exact", "counted"}  # innocents aborted with bad
    else:  # provisional KV left in place: the rerun's scheduling raises out of the step,
        # and the last resort fails everyone
        assert failing == {"innocents_exact", "bad_fails_alone", "counted"}


def test_the_faulty_step_is_isolated_in_logarithmically_many_reruns(monkeypatch):
    rows = [(f"q{i}", _prompt(10 + i, 7)) for i in range(16)]
    eng = tiny_engine(PAIR[0], method="ngram", k=3)
    seen = poison_forward(monkeypatch, eng, lambda e: bool(e.requests["q0"].output_ids))
    eng.add_request("bad", _prompt(99, 7), GREEDY)
    for rid, prompt in rows:
        eng.add_request(rid, prompt, GREEDY)
    eng.step()  # every prompt prefilled
    before = seen["calls"]
    outputs = eng.step()
    assert [o.request_id for o in outputs if o.error] == ["bad"]
    assert sum(1 for o in outputs if o.new_token_ids) == 16  # every other row advanced once
    assert seen["calls"] - before <= 1 + 2 * math.ceil(math.log2(17))


class FaultyProposer(CountingProposer):
    """A proposer registered for the tests; it raises while drafting for "bad" once
    `armed()` (set by the test)."""

    name = "faulty"
    armed = staticmethod(lambda: True)

    def draft(self, rows, ks):
        if self.armed() and any(r.request_id == "bad" for r in rows):
            raise RuntimeError(f"proposer failed: {SECRET}")
        return super().draft(rows, ks)


def poison_draft_model(monkeypatch, eng: LLMEngine) -> None:
    """The draft model drafts for every row (draft_computed advances), then raises if "bad"
    was among them and "long" prefills in the same step."""
    proposer = eng.proposers["draft"]
    real = proposer.draft

    def draft(rows, ks):
        out = real(rows, ks)
        if "long" in eng.kv and any(r.request_id == "bad" for r in rows):
            raise RuntimeError(f"draft model failed: {SECRET}")
        return out
    monkeypatch.setattr(proposer, "draft", draft)


@pytest.mark.parametrize("proposer", ["draft", "registered"])
@pytest.mark.parametrize("twin", ["none", "no_isolation", "no_rollback"])
def test_a_faulty_proposer_row_fails_alone(monkeypatch, proposer, twin):
    TWINS[twin](monkeypatch)
    if proposer == "draft":
        eng, spec = engine("draft"), None
        poison_draft_model(monkeypatch, eng)
        method = "draft"
    else:  # "bad" alone drafts with a proposer of its own, which raises
        monkeypatch.setattr(proposer_mod, "_FACTORIES", dict(proposer_mod._FACTORIES))
        proposer_mod.register_proposer("faulty", FaultyProposer)
        eng, spec, method = engine(), {"bad": SpecOverride(method="faulty")}, "ngram"
        monkeypatch.setattr(FaultyProposer, "armed", staticmethod(lambda: "long" in eng.kv))
    checks = verdict(eng, *drive(eng, spec=spec), method)
    failing = {name for name, ok in checks.items() if not ok}
    if twin == "none":
        assert not failing
    elif twin == "no_isolation":
        assert failing == {"innocents_exact", "counted"}
    elif proposer == "draft":  # draft_computed left past the rows: every rerun fails (a
        # ValueError), so every row fails
        assert failing == {"innocents_exact", "bad_fails_alone", "counted"}
    else:  # nothing of the others' state changed before the fault: the twin passes
        assert not failing


class FaultyDetokenizer:
    """Wraps a request's detokenizer; raises from its third token on."""

    def __init__(self, inner):
        self.inner, self.pushed = inner, 0

    def push(self, ids):
        self.pushed += len(ids)
        if self.pushed >= 3:
            raise RuntimeError(f"detokenizer failed: {SECRET}")
        return self.inner.push(ids)

    def flush(self):
        return self.inner.flush()


@pytest.mark.parametrize("broken", [False, True])
def test_a_faulty_detokenizer_fails_its_row_alone_without_a_rerun(monkeypatch, broken):
    if broken:  # a commit that raises escapes the step: the last resort fails everyone
        def reraise(self, req, exc):
            raise exc
        monkeypatch.setattr(LLMEngine, "_fail_row", reraise)
    eng = engine()
    real_add = eng.add_request

    def add_request(rid, prompt, params, spec=None):
        real_add(rid, prompt, params, spec)
        if rid == "bad":
            eng.requests[rid].detokenizer = FaultyDetokenizer(eng.requests[rid].detokenizer)
    monkeypatch.setattr(eng, "add_request", add_request)
    attempts = []
    real_attempt = eng._attempt
    monkeypatch.setattr(eng, "_attempt", lambda only: attempts.append(only) or real_attempt(only))
    checks = verdict(eng, *drive(eng), "ngram")
    failing = {name for name, ok in checks.items() if not ok}
    if broken:
        assert "innocents_exact" in failing and "bad_fails_alone" in failing
    else:
        assert not failing
        assert all(only is None for only in attempts)  # no rerun: the batch-wide part succeeded


@pytest.mark.parametrize("twin", ["none", "no_rollback"])
def test_a_fault_on_every_row_fails_each_alone_and_the_engine_serves_on(monkeypatch, twin):
    TWINS[twin](monkeypatch)
    eng = engine()
    real, lost = eng.target.forward, []

    def forward(rows):  # from a step with drafts and a prefill chunk on, every forward raises
        if lost or ("long" in eng.kv and drafting(eng)):
            lost.append(len(rows))
            raise RuntimeError(f"device lost: {SECRET}")
        return real(rows)
    monkeypatch.setattr(eng.target, "forward", forward)
    final, broken = drive(eng)
    errors = {rid: getattr(o, "error", o) for rid, o in final.items()}
    if twin == "none":
        assert errors == {rid: OWN_ERROR for rid in ["bad", *INNOCENT]}
        assert eng.step_errors == 5 and not broken and eng.stats().kv_blocks_used == 0
        assert len(lost) == 2 * 5 - 1  # the bisection: one attempt per node of its tree
    else:
        assert errors != {rid: OWN_ERROR for rid in ["bad", *INNOCENT]}
    monkeypatch.setattr(eng.target, "forward", real)  # the device is back
    after = {0: [(f"{rid}-again", prompt) for rid, prompt in ARRIVALS[0]]}
    final, broken = drive(eng, arrivals=after)
    want, _ = drive(engine(), arrivals=after)
    assert {rid: o.token_ids for rid, o in final.items()} == {rid: o.token_ids for rid, o in want.items()}
    assert not broken


def test_seeded_sampled_rows_draw_the_same_tokens_after_a_recovered_fault(monkeypatch):
    """A seeded row's noise is a function of its seed and output position, so a recovered
    fault (the step rerun on fewer rows, the draft model sampling again) leaves its
    tokens unchanged."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    want, _ = drive(engine("draft"), params=params)
    eng = engine("draft")
    poison_forward(monkeypatch, eng, lambda e: "long" in e.kv)
    got, checks = drive(eng, params=params)
    assert not checks and got["bad"].error == OWN_ERROR
    assert {r: got[r].token_ids for r in INNOCENT} == {r: want[r].token_ids for r in INNOCENT}


@pytest.mark.parametrize("broken", [False, True])
def test_a_failed_attempt_rolls_the_shared_generator_back(monkeypatch, broken):
    """Unseeded sampled rows (and the draft model for them) draw from the shared generator;
    a failed attempt returns it to its state at the mark. The check fails when the
    rollback leaves the RNG out (`broken`)."""
    restore, restored = LLMEngine._restore, []

    def watched(self, mark):
        saved = mark.rngs[0][1]
        if broken:
            mark.rngs = []
        restore(self, mark)
        restored.append(torch.equal(self._shared_generator.get_state(), saved))
    monkeypatch.setattr(LLMEngine, "_restore", watched)
    eng = engine("draft")
    poison_forward(monkeypatch, eng, lambda e: "long" in e.kv)
    drive(eng, params=SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert restored and all(restored) != broken


def test_the_core_reports_each_failure_once_to_the_front_end(monkeypatch):
    eng = engine()
    poison_forward(monkeypatch, eng, lambda e: "long" in e.kv)
    core, reported, events = EngineCore(eng), [], {}
    step = 0
    while step <= max(ARRIVALS) or eng.has_unfinished_requests():
        out = M.CoreOutputs(events=[], calls=[])
        for rid, prompt in ARRIVALS.get(step, []):
            core.apply(M.Add(rid, prompt, GREEDY), out)
        core.step(out)
        reported.append((out.step_errors, out.step_error))
        for ev in M.outputs_decoder().decode(M.encoder().encode(out)).events:
            events.setdefault(ev.request_id, []).append(ev)
        step += 1
    failures = [(n, text) for n, text in reported if n]
    assert len(failures) == 1 and failures[0][0] == 1 and SECRET in failures[0][1]
    last = events["bad"][-1]
    assert (last.kind, last.finish_reason, last.error) == (M.OUTPUT, "abort", OWN_ERROR)
    assert all(e.error is None and e.kind in (M.ACCEPTED, M.OUTPUT) for r in INNOCENT for e in events[r])
    assert not core.live

    def raising():
        raise RuntimeError("broken beyond isolation")
    core.apply(M.Add("x", [1, 2, 3], GREEDY), M.CoreOutputs(events=[], calls=[]))
    monkeypatch.setattr(eng, "step", raising)
    out = M.CoreOutputs(events=[], calls=[])
    core.step(out)
    assert out.step_errors == 1 and "broken beyond isolation" in out.step_error
    assert [(e.request_id, e.kind) for e in out.events] == [("x", M.FAILED)]


def test_the_core_counts_every_request_failed_in_one_step(monkeypatch):
    eng = engine()
    core, out = EngineCore(eng), M.CoreOutputs(events=[], calls=[])
    for rid, prompt in ARRIVALS[0]:
        core.apply(M.Add(rid, prompt, GREEDY), out)

    def forward(rows):
        raise RuntimeError(f"device lost: {SECRET}")
    monkeypatch.setattr(eng.target, "forward", forward)
    core.step(out)
    assert out.step_errors == 3 and SECRET in out.step_error
    assert sorted(e.error for e in out.events if e.kind == M.OUTPUT) == [OWN_ERROR] * 3
    assert not core.live and not eng.has_unfinished_requests()
