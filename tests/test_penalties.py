"""Logits processors: presence/frequency/repetition penalties, logit_bias, min_tokens,
stop_token_ids and top_k = -1 (vLLM's semantics; docs/serving.md, "Sampling parameters").

Checks, by name:

- the processed distribution equals a per-row float64 reference at every scored
  position, the drafts before a position counted as generated;
- "identical to plain": greedy speculative output (prompt lookup and a draft model, several
  k) equals plain decoding with the same penalties; a bug twin whose target counts only the
  committed output (not the drafts before a position) fails exactly this check;
- min_tokens, stop_token_ids and top_k = -1 behave as specified, under speculation too;
- the engine and the server refuse ids outside the vocabulary, naming the field.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

import verispec.sampling as sampling_mod
from tiny import run_all, tiny_engine, tiny_pair
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams, SamplingTensors
from verispec.server.protocol import engine_error_param

VOCAB = 32
PAIR = tiny_pair(vocab=VOCAB, noise=0.1, seed=3)
PLAIN = SpecOverride(method="none")
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.4,
                 logit_bias={3: 2.0, 5: -1.5})


# ---------------------------------------------------------------------------- the reference
def reference_probs(logits: torch.Tensor, p: SamplingParams, prompt, output, eos=()) -> torch.Tensor:
    """One row, float64, written out directly from the specification."""
    x = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts = Counter(output)
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = float("-inf")
    if p.temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    x = x / p.temperature
    order = sorted(range(x.numel()), key=lambda t: (-x[t].item(), t))
    keep = set(order[: p.top_k] if p.top_k else order)
    probs = torch.softmax(x, dim=-1)
    mass, kept = 0.0, set()
    for t in order:
        if t in keep and (p.top_p == 1 or mass < p.top_p):
            kept.add(t)
            mass += probs[t].item() / sum(probs[u].item() for u in keep)
    x = torch.where(torch.tensor([t in kept for t in range(x.numel())]), x, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    probs = probs * (probs >= p.min_p * probs.max())
    return probs / probs.sum()


CASES = [  # extra SamplingParams fields on top of temperature 0.8
    dict(presence_penalty=1.5),
    dict(frequency_penalty=-0.7),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, top_k=5),
    dict(logit_bias={0: 100, 7: -100, 9: 3.5}, top_p=0.8),
    dict(min_tokens=6, stop_token_ids=[4, 11], min_p=0.1),
    dict(**PENALTIES, top_k=8, top_p=0.9, min_p=0.05),
    dict(**PENALTIES, min_tokens=4, temperature=0.0),
    dict(**PENALTIES, top_k=-1, temperature=1.3),
]


@pytest.mark.parametrize("extra", CASES, ids=[",".join(c) for c in CASES])
def test_processed_probs_equal_the_reference_at_every_draft_position(extra):
    gen = torch.Generator().manual_seed(len(str(extra)))
    params = SamplingParams(**{"temperature": 0.8, "max_tokens": 50, **extra})
    plain = SamplingParams(temperature=0.5, top_k=3)  # a row without processors beside it
    prompt, output = [1, 4, 4, 9, 2], [3, 4, 7, 4]
    drafts = [[4, 0, 5, 4, 11], [2]]
    logits = torch.randn(8, VOCAB, generator=gen) * 3
    st = SamplingTensors.from_params([params, plain], "cpu", [(prompt, output), ([0], [1])], eos_ids=[0])
    got = st.expand([6, 2], drafts).to_probs(logits)
    for j in range(6):
        want = reference_probs(logits[j], params, prompt, output + drafts[0][:j], eos=[0])
        assert torch.allclose(got[j].double(), want, atol=1e-5), (j, got[j], want)
    for j in range(2):  # the plain row: exactly logits_to_probs, untouched
        assert torch.allclose(got[6 + j].double(), reference_probs(logits[6 + j], plain, [], []), atol=1e-5)


def test_rows_without_processors_take_the_fast_path():
    st = SamplingTensors.from_params([SamplingParams()] * 3, "cpu")
    assert st.history is None and st.expand([2, 1, 3]).history is None
    logits = torch.randn(3, VOCAB)
    assert st.process(logits) is logits


def test_bad_values_name_the_field_and_the_allowed_range():
    bad = [("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3, "[-2, 2]"),
           ("repetition_penalty", 0.0, "> 0"), ("logit_bias", {1: 101}, "[-100, 100]"),
           ("logit_bias", {-1: 1}, "integers >= 0"), ("min_tokens", -1, ">= 0"),
           ("min_tokens", 300, "<= max_tokens"), ("stop_token_ids", [1, -2], "integers >= 0"),
           ("top_k", -2, "-1 to disable")]
    for name, value, allowed in bad:
        with pytest.raises(ValueError) as err:
            SamplingParams(**{name: value})
        assert str(err.value).startswith(name) and allowed in str(err.value), (name, str(err.value))
        assert engine_error_param(str(err.value)) == name
    assert SamplingParams(top_k=-1).top_k == 0
    assert hash(SamplingParams(logit_bias={1: 2})) == hash(SamplingParams(logit_bias={1: 2.0}))


# ---------------------------------------------------------------------------- greedy identity
def _prompt(seed: int, n: int) -> list[int]:
    half = torch.randint(0, VOCAB, (n // 2 + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (half + half)[:n]


# Positive penalties push output away from repeats (prompt lookup then rarely hits);
# negative ones pull it into loops that prompt lookup drafts and the target accepts, where
# each accepted draft changes the counts of the positions after it.
GREEDY = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **extra) for extra in (
    PENALTIES, dict(frequency_penalty=-0.5), dict(presence_penalty=-1.0, repetition_penalty=0.8),
    dict(frequency_penalty=-0.3, logit_bias={1: 1.0}), dict(frequency_penalty=1.0), {},
    # biased loops that the penalties break after a count: drafts accepted near the break
    dict(logit_bias={1: 6.0, 2: 6.0}, frequency_penalty=1.0),
    dict(logit_bias={1: 4.0, 2: 4.0, 3: 4.0}, frequency_penalty=0.7, presence_penalty=0.5))]
PROMPTS = [_prompt(s, 10 + 3 * s) for s in range(4)]


_PLAIN: dict = {}


def _plain(prompt: list[int], params: SamplingParams) -> list[int]:
    """The request decoded alone without speculation (no drafts: no bug twin acts on it)."""
    key = (tuple(prompt), params)
    if key not in _PLAIN:
        _PLAIN[key] = run_all(tiny_engine(PAIR[0]), [prompt], params, spec=PLAIN)[0].token_ids
    return _PLAIN[key]


def greedy_checks(method: str, k: int) -> dict[str, bool]:
    draft = PAIR[1] if method == "draft" else None
    prompts = [p for p in PROMPTS for _ in GREEDY]
    params = GREEDY * len(PROMPTS)
    plain = [_plain(p, sp) for p, sp in zip(prompts, params)]
    outs = run_all(tiny_engine(PAIR[0], draft, method=method, k=k), prompts, params)
    assert all(o.error is None for o in outs)
    return {"identical to plain": [o.token_ids for o in outs] == plain,
            "penalties act": len({tuple(p) for p in plain}) > len(plain) // 2,
            "drafted": sum(o.spec.num_draft_tokens for o in outs) > 0}


@pytest.mark.parametrize("method,k", [("ngram", 1), ("ngram", 4), ("draft", 2), ("draft", 5)])
def test_greedy_speculative_output_with_penalties_is_plain_output(method, k):
    checks = greedy_checks(method, k)
    assert all(checks.values()), checks


def _stale_counts(h, drafts, j):
    """Bug twin: every position of a verify row sees only the committed output."""
    return h


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_penalties_that_forget_the_drafts_fail_the_identity_check(monkeypatch, method):
    monkeypatch.setattr(sampling_mod, "_at_position", _stale_counts)
    checks = greedy_checks(method, 4)
    assert [name for name, ok in checks.items() if not ok] == ["identical to plain"], checks


# ---------------------------------------------------------------------------- stops
def test_min_tokens_holds_back_eos_and_stop_token_ids_end_like_eos():
    eos, stop = 2, 9
    for method, k in (("none", 1), ("ngram", 4), ("draft", 3)):
        draft = PAIR[1] if method == "draft" else None
        engine = tiny_engine(PAIR[0], draft, method=method, k=k, eos=eos)
        forced_eos = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100}, min_tokens=5)
        forced_stop = SamplingParams(temperature=0.7, max_tokens=20, logit_bias={stop: 100}, min_tokens=3,
                                     stop_token_ids=[stop], seed=1)
        immediate = SamplingParams(temperature=0, max_tokens=20, logit_bias={stop: 100}, stop_token_ids=[stop])
        ignored = replace(forced_eos, ignore_eos=True, max_tokens=8)
        a, b, c, d = run_all(engine, [PROMPTS[0]] * 4, [forced_eos, forced_stop, immediate, ignored])
        assert len(a.token_ids) == 6 and a.token_ids[-1] == eos and eos not in a.token_ids[:-1], method
        assert a.finish_reason == "stop"
        assert len(b.token_ids) == 4 and b.token_ids[-1] == stop and b.finish_reason == "stop", method
        assert c.token_ids == [stop] and c.finish_reason == "stop", method
        # ignore_eos: min_tokens does not ban EOS (it is no stop), EOS does not end the request
        assert d.token_ids == [eos] * 8 and d.finish_reason == "length", method


def test_top_k_minus_one_is_top_k_zero():
    outs = [run_all(tiny_engine(PAIR[0]), [PROMPTS[1]], SamplingParams(temperature=1.0, top_k=k, seed=7,
                                                                        max_tokens=12, ignore_eos=True))[0]
            for k in (-1, 0)]
    assert outs[0].token_ids == outs[1].token_ids


def test_the_engine_refuses_ids_outside_the_vocabulary_naming_the_field():
    engine = tiny_engine(PAIR[0])
    for name, value in (("logit_bias", {VOCAB: 1.0}), ("stop_token_ids", [VOCAB + 3])):
        with pytest.raises(ValueError) as err:
            engine.add_request("r", [1, 2], SamplingParams(**{name: value}))
        assert engine_error_param(str(err.value)) == name and f"[0, {VOCAB})" in str(err.value)
