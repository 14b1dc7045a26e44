"""Seeded requests: output that speculation cannot change (docs/correctness.md, "Seeded requests").

A seeded row samples output position j as race(p_j, u(seed, j)): the Gumbel-max rule with
noise that is a pure function of (seed, j, token). Speculative verification takes the
target's own choice at each position and accepts a draft iff it equals it, so the output
is seeded plain decoding's, token for token. Checks, by name:

- "identical to plain": every seeded (and greedy) request's tokens under speculation equal
  the same request decoded alone without speculation;
- "seeds differ": requests that differ only in their seed do not all produce one output;
- G1 over seeds: the first tokens of many differently seeded requests follow the exact
  distribution (the statistical checks of tests/test_gate_lossless.py).

Each injected bug must fail the check named for it while the run completes without errors.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools

import httpx
import pytest
import torch

import verispec.engine.engine as engine_mod
import verispec.sampling as sampling_mod
import verispec.spec.rejection as rejection_mod
from test_gate_lossless import PAIR as GATE_PAIR
from test_gate_lossless import PROMPT as GATE_PROMPT
from test_gate_lossless import STATISTICAL_CHECKS, exact_joint, statistical_checks, CHECKED
from tiny import run_all, tiny_engine, tiny_pair
from verispec.engine.llm import LLM
from verispec.engine.runner import RowInput
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams, draw_uniform, sample, seeded_uniform
from verispec.spec.rejection import RejectionResult, seeded_verify

VOCAB = 32
PAIR = tiny_pair(vocab=VOCAB, noise=0.1, seed=3)
PLAIN = SpecOverride(method="none")


def _prompt(seed: int, n: int) -> list[int]:
    """A prompt that repeats itself, so prompt lookup finds n-grams to propose."""
    half = torch.randint(0, VOCAB, (n // 2 + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (half + half)[:n]


# ---------------------------------------------------------------------------- the noise
def test_noise_is_a_pure_function_of_seed_position_and_token():
    keys = [(7, 0), (7, 1), (8, 0), (-3, 10 ** 6)]
    rows = seeded_uniform(keys, 100, "cpu")
    assert torch.equal(seeded_uniform(keys[::-1], 100, "cpu"), rows.flip(0))        # no batch effect
    assert torch.equal(seeded_uniform(keys, 40, "cpu"), rows[:, :40])               # width: a prefix
    assert len({tuple(r.tolist()) for r in rows}) == len(keys)                      # keys differ
    torch.rand(5)                                                                   # global RNG state:
    mixed = draw_uniform(3, 100, "cpu", keys=[None, (8, 0), None])                 # irrelevant
    assert torch.equal(mixed[1], rows[2])
    probs = torch.softmax(torch.randn(4, 100), dim=-1)
    assert torch.equal(sample(probs, keys), sample(probs.flip(0), keys[::-1]).flip(0))


def test_the_forward_scores_a_token_independently_of_the_rows_beside_it():
    """float32 tiny model, default kernels: a verify row's logits do not depend on the rows
    beside it (bit for bit). They do depend, by float32 rounding, on the pass width: torch's
    float32 matmul rounds a one-token pass (gemv) differently from a wider one (gemm), so a
    race closer than ~1e-6 relative could resolve differently with and without speculation
    (docs/correctness.md, "Seeded requests"; the int4 and bf16 kernels are width-exact)."""
    engine = tiny_engine(PAIR[0], k=8)
    runner, table = engine.target, list(range(16))
    seq = _prompt(1, 30)
    runner.forward([RowInput(seq[:20], 0, table, 20)])
    verify = runner.forward([RowInput(seq[20:29], 20, table, 0)])[0]
    other = [RowInput(_prompt(2, 7), 0, list(range(16, 24)), 0)]
    beside = runner.forward(other + [RowInput(seq[20:29], 20, table, 0)])[1]
    alone = torch.cat([runner.forward([RowInput([seq[i]], i, table, 0)])[0] for i in range(20, 29)])
    assert torch.equal(beside, verify)
    assert torch.allclose(verify, alone, rtol=0, atol=1e-4 * alone.abs().max().item())


# ---------------------------------------------------------------------------- identity
_REFERENCE: dict = {}


def _plain_alone(method: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """The request decoded alone without speculation (cached: it is the reference)."""
    key = (tuple(prompt), params)
    if key not in _REFERENCE:
        engine = tiny_engine(*PAIR) if method == "draft" else tiny_engine(PAIR[0])
        _REFERENCE[key] = run_all(engine, [prompt], params, spec=PLAIN)[0].token_ids
    return _REFERENCE[key]


def _batch(size: int, temperature: float, salt: int,
           extra: dict | None = None) -> tuple[list[list[int]], list[SamplingParams]]:
    """`size` requests: seeded ones (filters cycling through top-k, top-p, min-p), and
    beside them, from the third on, an unseeded one and a greedy one."""
    filters = [{}, {"top_k": 6}, {"top_p": 0.8}, {"min_p": 0.1}, {"top_k": 10, "top_p": 0.9}]
    prompts, params = [], []
    for i in range(size):
        prompts.append(_prompt(salt * 100 + i, 9 + 5 * (i % 4)))
        seed = None if i % 3 == 2 else 1000 * salt + i
        t = 0.0 if i % 6 == 5 else temperature
        params.append(SamplingParams(temperature=t, max_tokens=18, ignore_eos=True, seed=seed,
                                     **filters[i % len(filters)], **(extra or {})))
    return prompts, params


def seeded_checks(method: str, k: int, size: int, temperature: float, salt: int = 0,
                  extra: dict | None = None, **engine_options) -> dict[str, bool]:
    """The named checks of one speculative run of a batch against the references; `extra`:
    SamplingParams fields every request adds (logits processors)."""
    prompts, params = _batch(size, temperature, salt, extra)
    draft = PAIR[1] if method == "draft" else None
    engine = tiny_engine(PAIR[0], draft, method=method, k=k, **engine_options)
    outs = run_all(engine, prompts, params)
    assert all(o.error is None for o in outs)
    decided = [i for i, p in enumerate(params) if p.seed is not None or p.greedy]
    identical = all(outs[i].token_ids == _plain_alone(method, prompts[i], params[i]) for i in decided)
    # the first request again under other seeds: the seed must matter
    others = [SamplingParams(**{**_fields(params[0]), "seed": s}) for s in (1, 2, 3)]
    reseeded = run_all(tiny_engine(PAIR[0], draft, method=method, k=k), [prompts[0]] * 3, others)
    distinct = len({tuple(o.token_ids) for o in reseeded} | {tuple(outs[0].token_ids)}) > 1
    return {"identical to plain": identical, "seeds differ": distinct,
            "drafted": sum(o.spec.num_draft_tokens for o in outs) > 0}


def _fields(p: SamplingParams) -> dict:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


SETTINGS = [  # (method, k, batch size, temperature, engine options)
    ("ngram", 1, 1, 0.8, {}),
    ("ngram", 3, 3, 0.3, {}),
    ("ngram", 8, 8, 1.2, {}),
    ("ngram", 5, 8, 0.8, {"adaptive": True}),
    ("ngram", 4, 8, 1.2, {"num_kv_tokens": 96, "block_size": 4}),   # preemption + recompute
    ("draft", 1, 3, 0.8, {}),
    ("draft", 2, 1, 1.2, {}),
    ("draft", 4, 8, 0.3, {}),
    ("draft", 6, 3, 0.8, {"adaptive": True}),
    ("draft", 7, 8, 1.2, {"num_kv_tokens": 96, "block_size": 4}),   # preemption + recompute
    ("draft", 8, 3, 1.2, {"max_batched_tokens": 16}),               # chunked prefill
]


@pytest.mark.gpu
@pytest.mark.parametrize("method,k,size,temperature,options", SETTINGS,
                         ids=[f"{m}-k{k}-b{b}-T{t}-{'-'.join(o) or 'plain'}" for m, k, b, t, o in SETTINGS])
def test_seeded_speculative_output_is_token_identical_to_seeded_plain(method, k, size, temperature, options):
    checks = seeded_checks(method, k, size, temperature, salt=k, **options)
    assert all(checks.values()), checks


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3, logit_bias={4: 2.0})


@pytest.mark.parametrize("method,k", [("ngram", 4), ("draft", 3)])
def test_seeded_speculative_output_with_penalties_is_seeded_plain(method, k):
    """Penalties count the drafts before each position, in the target's and the draft's q."""
    checks = seeded_checks(method, k, 6, 0.8, salt=11, extra=PENALTIES)
    assert all(checks.values()), checks


def test_preemption_happens_in_the_tiny_pool():
    prompts, params = _batch(8, 1.2, 4)
    engine = tiny_engine(PAIR[0], method="ngram", k=4, num_kv_tokens=96, block_size=4)
    run_all(engine, prompts, params)
    assert engine.num_preemptions > 0


def _round_keyed(req) -> int:
    """Bug: the noise keyed by the request's round (target passes so far), not its output
    position. Plain decoding cannot tell (one token a round), speculation can."""
    return req.stats.target_forwards


def _rejection_rule(target_probs, drafts, counts, keys):
    """Bug: seeded drafts accepted by the rejection-sampling rule u < p(d) (one-hot q), with
    the seeded noise as u; the target's choice is emitted at a rejection."""
    vocab, out_acc, out_emit = target_probs.shape[-1], [], []
    for b, (seed, start) in enumerate(keys):
        emitted = []
        for i, d in enumerate(list(drafts[b][: counts[b]]) + [None]):
            u = seeded_uniform([(seed, start + i)], vocab, "cpu")
            if d is not None and u[0, d] < target_probs[b, i, d]:
                emitted.append(d)
                continue
            emitted.append(int(sampling_mod.race(target_probs[b, i: i + 1], u)))
            break
        out_acc.append(len(emitted) - 1)
        out_emit.append(emitted)
    return rejection_mod._host_result(out_acc, out_emit, target_probs.shape[1] - 1, "cpu")


def _seed_ignored(monkeypatch):
    real = sampling_mod.noise_seed
    monkeypatch.setattr(sampling_mod, "noise_seed", lambda seed, position: real(0, position))


INJECTED = {
    "noise keyed by round": (lambda mp: mp.setattr(engine_mod, "output_position", _round_keyed)),
    "rejection rule on seeded rows": (lambda mp: mp.setattr(engine_mod, "seeded_verify", _rejection_rule)),
    "seed ignored": _seed_ignored,
}
CAUGHT_BY = {"noise keyed by round": "identical to plain", "rejection rule on seeded rows": "identical to plain",
             "seed ignored": "seeds differ"}


@pytest.mark.parametrize("bug", list(INJECTED))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_each_injected_bug_fails_its_named_check(monkeypatch, bug, method):
    _REFERENCE.clear()  # references are recomputed with the bug in place
    INJECTED[bug](monkeypatch)
    checks = seeded_checks(method, 4, 8, 1.0, salt=9)
    _REFERENCE.clear()
    failed = [name for name, ok in checks.items() if not ok]
    assert failed == [CAUGHT_BY[bug]], (bug, checks)


def test_seeded_verify_is_plain_decodings_choice_for_any_drafts():
    """Sampler level: whatever the drafts, each emitted token is race(p_i, u(seed, j + i))."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, 9, 50, generator=gen) * 2, dim=-1)
    keys = [(s, 3 * s) for s in range(6)]
    choice = [[int(sample(p[b, i: i + 1], [(s, j + i)])) for i in range(9)] for b, (s, j) in enumerate(keys)]
    for trial in range(20):
        counts = torch.randint(0, 9, (6,), generator=gen).tolist()
        drafts = [[c if torch.rand(1, generator=gen) < 0.7 else (c + 1) % 50 for c in row[:8]] for row in choice]
        result: RejectionResult = seeded_verify(p, drafts, counts, keys)
        for b in range(6):
            n = int(result.num_output[b])
            assert result.output_tokens[b, :n].tolist() == choice[b][:n]
            a = int(result.accepted_len[b])
            assert drafts[b][:a] == choice[b][:a] and (a == counts[b] or drafts[b][a] != choice[b][a])


# ---------------------------------------------------------------------------- over seeds: G1
G1_SAMPLES = 6000
G1_SETTINGS = [("draft", 3, 1.0, 6), ("ngram", 2, 0.8, 0)]  # (method, k, temperature, top_k)


def seeded_gate(method: str, k: int, params: SamplingParams, first_seed: int) -> tuple[dict, float]:
    """The gate's statistical checks on G1_SAMPLES requests seeded first_seed, first_seed + 1, ..."""
    target, draft = GATE_PAIR
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=k,
                         max_num_seqs=2048, max_batched_tokens=32768,
                         num_kv_tokens=(len(GATE_PROMPT) + 16) * 2048 * 2)
    fields = _fields(params)
    many = [SamplingParams(**{**fields, "seed": first_seed + i}) for i in range(G1_SAMPLES)]
    outs = run_all(engine, [GATE_PROMPT] * G1_SAMPLES, many, check=False)
    assert all(o.error is None for o in outs)
    samples = torch.tensor([o.token_ids[:max(CHECKED) + 1] for o in outs])
    joint = exact_joint(target, params, max(CHECKED) + 1)
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    return statistical_checks(samples, joint)[0], sum(o.spec.num_accepted_tokens for o in outs) / max(drafted, 1)


def _gate_verdict(method, k, temperature, top_k) -> dict[str, bool]:
    """A check fails only if it fails again on disjoint seeds (the gate's replication rule)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=max(k + 2, max(CHECKED) + 1),
                            ignore_eos=True)
    first, rate = seeded_gate(method, k, params, 10 ** 6)
    assert 0.05 <= rate <= 0.98, rate
    if all(first.values()):
        return first
    second, _ = seeded_gate(method, k, params, 2 * 10 ** 6)
    return {name: first[name] or second[name] for name in STATISTICAL_CHECKS}


@pytest.mark.parametrize("method,k,temperature,top_k", G1_SETTINGS)
def test_seeded_samples_over_seeds_follow_the_exact_distribution(method, k, temperature, top_k):
    verdict = _gate_verdict(method, k, temperature, top_k)
    assert [name for name, ok in verdict.items() if not ok] == []


def test_noise_without_the_log_is_caught_by_the_statistics(monkeypatch):
    """Bug: argmax p / u (u uniform) instead of p / (-log u): not the exact race."""
    def no_log(probs, uniform):
        return (probs / uniform.clamp_min(torch.finfo(uniform.dtype).tiny)).argmax(dim=-1)
    monkeypatch.setattr(sampling_mod, "race", no_log)
    monkeypatch.setattr(rejection_mod, "race", no_log)
    verdict = _gate_verdict("draft", 3, 1.0, 6)
    assert not verdict["x2 TV"] and not verdict["x2 chi2"], verdict


# ---------------------------------------------------------------------------- front ends
def test_the_llm_api_gives_the_same_seeded_output_with_and_without_speculation():
    llm = LLM.__new__(LLM)
    llm.engine = tiny_engine(*PAIR, method="draft", k=5, adaptive=True)
    llm.tokenizer, llm.config, llm._next_id = llm.engine.tokenizer, llm.engine.config, 0
    prompts, params = _batch(3, 0.8, 5)
    spec = llm.generate(prompts, params)
    plain = llm.generate(prompts, params, spec=PLAIN)
    assert all(a.token_ids == b.token_ids for a, b, p in zip(spec, plain, params) if p.seed is not None)


@contextlib.asynccontextmanager
async def _serving(engine):
    from verispec.server.app import ServerConfig, create_app
    app = create_app(engine, ServerConfig())
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            yield client


def test_the_server_returns_the_same_seeded_text_alone_in_a_crowd_and_without_speculation():
    body = {"prompt": "abcabcabdabcab", "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 77,
            "ignore_eos": True}
    crowd = [{"prompt": p, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True, **extra}
             for p, extra in itertools.product(["abab", "cdecdecd"], [{}, {"seed": 5}])]

    async def scenario():
        async with _serving(tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)) as client:
            alone = (await client.post("/v1/completions", json=body)).json()
            replies = await asyncio.gather(*[client.post("/v1/completions", json=b) for b in [*crowd, body]])
            plain = (await client.post("/v1/completions", json={**body, "speculative": {"method": "none"}})).json()
            return alone, replies[-1].json(), plain

    alone, crowded, plain = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    text = alone["choices"][0]["text"]
    assert len(text) == 24
    assert crowded["choices"][0]["text"] == text and plain["choices"][0]["text"] == text
