"""logprobs: each emitted token's log-probability (and its top alternatives) under the
distribution the engine sampled / verified it from (`verispec.sampling.token_logprobs`).

Checks, by name:

- "tokens identical": speculative output equals plain decoding (seeded or greedy rows);
- "logprobs equal plain": each token's logprob and top alternatives equal plain decoding's
  (an accepted draft's logprob comes from the verify pass at its position). Not bit-exact:
  a verify row scores k + 1 positions in one pass, plain decoding one, and float32
  attention rounds differently (~1e-5 here), so within 1e-4;
- "equal the reference": they equal a float64 reference of the processed distribution
  (penalties, bias, temperature, top-k/top-p/min-p; greedy rows: log_softmax of the
  processed logits) at every emitted position, from a dense pass over prompt + output;
- bug twins: logprobs of accepted drafts taken from the draft model's q, or from the
  verify pass's next position, fail "logprobs equal plain" and "equal the reference" and
  nothing else.
"""
from __future__ import annotations

import math

import pytest
import torch

from test_penalties import reference_probs
from tiny import run_all, tiny_engine, tiny_pair
from verispec.engine.engine import LLMEngine
from verispec.engine.runner import ModelRunner, RowInput
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams, SamplingTensors, token_logprobs

VOCAB = 32
PAIR = tiny_pair(vocab=VOCAB, noise=0.1, seed=3)
PLAIN = SpecOverride(method="none")
TOL = 1e-4
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, frequency_penalty=-0.4,
                   logit_bias={2: 1.5}),
    SamplingParams(temperature=0.8, max_tokens=20, seed=11, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=1.2, max_tokens=20, seed=3, ignore_eos=True, logprobs=4, top_k=6,
                   top_p=0.9, min_p=0.02, presence_penalty=0.5, repetition_penalty=1.2),
]
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 9, 5, 9, 5, 9, 7]]


def sequence_logits(model, ids: list[int]) -> torch.Tensor:
    block = 16
    blocks = -(-len(ids) // block)
    return ModelRunner(model, blocks * block, block).forward([RowInput(list(ids), 0, list(range(blocks)), 0)])[0]


def reference_logprobs(logits: torch.Tensor, p: SamplingParams, prompt, output) -> torch.Tensor:
    """float64 log of the processed distribution; greedy rows: log_softmax of the logits
    after the processors, unfiltered (the documented convention)."""
    if p.greedy:
        unfiltered = SamplingParams(temperature=1.0, presence_penalty=p.presence_penalty,
                                    frequency_penalty=p.frequency_penalty,
                                    repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias)
        return reference_probs(logits, unfiltered, prompt, output).log()
    return reference_probs(logits, p, prompt, output).log()


def same_top(top: list, values: list[float], ids: list[int]) -> bool:
    """Alternatives equal within TOL; which filtered (-inf) tokens fill the tail is unspecified."""
    return len(top) == len(values) and all(
        (math.isinf(v) and math.isinf(w)) or (t == i and abs(v - w) <= TOL)
        for (t, v), w, i in zip(top, values, ids))


def close(a: list, b: list) -> bool:
    """Two logprob lists (logprob, [(id, lp)...]) per token, equal within TOL."""
    return len(a) == len(b) and all(abs(lp - lq) <= TOL and same_top(top, [v for _, v in toq], [t for t, _ in toq])
                                    for (lp, top), (lq, toq) in zip(a, b))


def equals_reference(out, params: SamplingParams) -> bool:
    ids = out.prompt_token_ids + out.token_ids
    logits = sequence_logits(PAIR[0], ids)
    n = len(out.prompt_token_ids)
    for j, (tok, (lp, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = reference_logprobs(logits[n - 1 + j], params, out.prompt_token_ids, out.token_ids[:j])
        values, order = ref.sort(descending=True, stable=True)
        if not math.isclose(lp, ref[tok].item(), abs_tol=TOL) or not same_top(
                top, values[: params.logprobs].tolist(), order[: params.logprobs].tolist()):
            return False
    return True


def checks(method: str, k: int) -> dict[str, bool]:
    draft = PAIR[1] if method == "draft" else None
    prompts = [p for p in PROMPTS for _ in PARAMS]
    params = PARAMS * len(PROMPTS)
    plain = [run_all(tiny_engine(PAIR[0]), [p], sp, spec=PLAIN)[0] for p, sp in zip(prompts, params)]
    outs = run_all(tiny_engine(PAIR[0], draft, method=method, k=k), prompts, params)
    return {"tokens identical": [o.token_ids for o in outs] == [o.token_ids for o in plain],
            "logprobs equal plain": all(close(o.logprobs, q.logprobs) for o, q in zip(outs, plain)),
            "equal the reference": all(equals_reference(o, sp) for o, sp in zip(outs, params)),
            "one per token": all(len(o.logprobs) == len(o.token_ids) for o in outs),
            "accepted drafts": sum(o.spec.num_accepted_tokens for o in outs) > 5}


@pytest.mark.parametrize("method,k", [("ngram", 2), ("ngram", 5), ("draft", 1), ("draft", 4)])
def test_speculative_logprobs_equal_plain_and_the_reference(method, k):
    got = checks(method, k)
    assert all(got.values()), got


def _draft_q_twin(monkeypatch):
    """Bug twin: an accepted draft's logprob read from the draft's q (log 1 = 0 for a
    probability-free proposer) instead of the verify pass."""
    compute = LLMEngine._compute

    def wrong(self, batch, ks, timer):
        v = compute(self, batch, ks, timer)
        for req, accepted in zip(batch.decode, v.accepted):
            tokens, q = v.drafts.get(req.request_id, ([], None))
            entries = v.logprobs.get(req.request_id)
            for j in range(min(accepted, len(entries or ()))):
                lp = 0.0 if q is None else math.log(max(q[j, tokens[j]].item(), 1e-30))
                entries[j] = (lp, entries[j][1])
        return v
    monkeypatch.setattr(LLMEngine, "_compute", wrong)


def _next_position_twin(monkeypatch):
    """Bug twin: position j of a verify row read from the pass's row j + 1."""
    real = LLMEngine._logprobs

    def wrong(self, reqs, logits, tokens):
        return real(self, reqs, [torch.cat([lg[1:], lg[-1:]]) if lg.shape[0] > 1 else lg for lg in logits],
                    tokens)
    monkeypatch.setattr(LLMEngine, "_logprobs", wrong)


@pytest.mark.parametrize("twin,method", [(_draft_q_twin, "draft"), (_draft_q_twin, "ngram"),
                                         (_next_position_twin, "ngram")])
def test_bug_twins_fail_exactly_the_logprob_checks(monkeypatch, twin, method):
    twin(monkeypatch)
    got = checks(method, 4)
    failed = {name for name, ok in got.items() if not ok}
    assert failed == {"logprobs equal plain", "equal the reference"}, got


def test_filtered_tokens_are_minus_inf_and_greedy_rows_finite():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    sampled = SamplingParams(temperature=0.7, top_k=2, logprobs=5)
    greedy = SamplingParams(temperature=0, top_k=2, logprobs=5)
    st = SamplingTensors.from_params([sampled, greedy], "cpu")
    (lp0, top0), (lp1, top1) = token_logprobs(st, logits, [int(logits[0].argmax()), int(logits[1].argmin())], [5, 5])
    assert [math.isinf(v) for _, v in top0] == [False, False, True, True, True]
    assert math.isclose(math.exp(top0[0][1]) + math.exp(top0[1][1]), 1.0, rel_tol=1e-5)
    assert all(math.isfinite(v) for _, v in top1) and math.isfinite(lp1)
    assert math.isclose(lp1, logits[1].log_softmax(-1).min().item(), abs_tol=1e-5)


def test_no_logprobs_unless_asked_and_bad_values_name_the_field():
    out = run_all(tiny_engine(PAIR[0]), [PROMPTS[0]], SamplingParams(max_tokens=4, seed=1))[0]
    assert out.logprobs is None and out.new_logprobs is None
    for bad in (21, -1, True, 2.0):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
