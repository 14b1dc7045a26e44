"""G1: speculative sampling at T > 0 reproduces the target's exact distribution.

A tiny random target and a noisy copy as the draft share a 16-token vocabulary, so the
exact autoregressive distribution of the first generated tokens is enumerated with the
target itself (every prefix, one batched forward per depth). The engine then generates
20,000 samples per setting through the real scheduler, proposers and rejection sampler.

Statistics. With N samples over m cells of true probabilities p_i, each count deviates by
about sqrt(N p_i (1 - p_i)), so the expected total-variation distance of the empirical
distribution is E[TV] = sum_i sqrt(p_i (1 - p_i) / (2 pi N)) (the mean absolute deviation
of a normal is sigma * sqrt(2 / pi), halved for TV). That is the sampling-noise floor; the
TV check allows twice the floor, and the chi-square check (cells with expected count < 5
merged) must not reject at p = 0.01, Bonferroni-corrected over the cells of one setting.
The cells are the marginals of x2, x3, x4 and the joint of (x2, x3), each with both checks.

Decision rule: a check fails only if it also fails on an independent engine seed. A
correct sampler then fails a setting with probability <= 0.01^2, while the injected bugs
(p ~ 0) fail both runs; without replication, 8 settings x 4 cells at alpha = 0.01 would
raise a false alarm somewhere about a quarter of the time.

The gate returns a verdict naming every check. Besides the statistical ones, "acceptance"
requires each run to have drafted and to have accepted a share of its drafts in range, so
that the run exercises both the accept and the reject path. Each injected bug (tests/bugs.py)
must leave the run error-free, its integrity check and its acceptance check passing, and
fail the named statistical checks of the cells where the bug first acts: the statistics,
not a crash or the acceptance range, are what catch it.
"""
from dataclasses import dataclass, replace

import pytest
import torch
from scipy.stats import chisquare

from bugs import inject
from eagle_heads import random_head_dir
from tiny import run_all, tiny_engine, tiny_pair
from verispec.model.attention import AttentionMetadata
from verispec.sampling import SamplingParams, SamplingTensors
from verispec.structured.spec import StructuredOutput

VOCAB = 16
NUM_SAMPLES = 20_000
SEED_PROMPT = [3, 7, 1]
CHECKED = (1, 2, 3)                # generated positions whose distribution is checked (x2, x3, x4)


PAIR = tiny_pair(vocab=VOCAB, noise=0.08, seed=1, logit_scale=1.0)
# The EAGLE-style head's vocabulary: 10 of the 16 tokens, so q is 0 on the other 6 and the
# residual max(0, p - q) must produce them (random weights: acceptance by chance).
HEAD_VOCAB = [0, 1, 3, 4, 6, 7, 9, 10, 12, 15]


def _greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    out = list(prompt)
    for _ in range(n):
        out.append(int(last_logits(model, torch.tensor([out]))[0].argmax()))
    return out


@pytest.fixture(scope="module")
def pair():
    return PAIR


def last_logits(model, seqs: torch.Tensor) -> torch.Tensor:
    """Logits after each full sequence; seqs (N, L) laid out contiguously in a fresh KV store."""
    n, length = seqs.shape
    kv = model.new_kv_store(n * length)
    slots = [list(range(i * length, (i + 1) * length)) for i in range(n)]
    meta = AttentionMetadata.build([length] * n, [length] * n, [list(range(length))] * n, slots, slots)
    index = torch.arange(length - 1, n * length, length)
    return model(seqs.reshape(-1), meta, kv, index)  # (N, V)


# The prompt is the target's own greedy continuation of a seed: its recurring n-grams are
# ones the target finds likely, so prompt lookup proposes plausible tokens (acceptance
# well between 0 and 1) instead of tokens the target never samples.
PROMPT = _greedy_continuation(PAIR[0], SEED_PROMPT, 20)


def exact_joint(model, params: SamplingParams, depth: int, allowed=None) -> torch.Tensor:
    """P(x_1..x_depth) under the target with `params`: a tensor of shape (V,) * depth.
    `allowed(output so far) -> token ids` masks each position first (a reference for
    structured output written without the grammar engine)."""
    joint = torch.ones(())
    prefixes = torch.tensor([PROMPT])
    for _ in range(depth):  # histories: logits processors count each prefix's own tokens
        histories = [(PROMPT, row[len(PROMPT):]) for row in prefixes.tolist()]
        st = SamplingTensors.from_params([params] * prefixes.shape[0], "cpu", histories)
        logits = last_logits(model, prefixes)
        if allowed is not None:
            mask = torch.ones_like(logits, dtype=torch.bool)
            for row, (_, output) in enumerate(histories):
                mask[row, allowed(output)] = False
            logits = logits.masked_fill(mask, float("-inf"))
        probs = st.to_probs(logits)  # (V^j, V)
        joint = joint.unsqueeze(-1) * probs.reshape(*joint.shape, VOCAB)
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                              torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint


def sample_engine(pair, method: str, k: int, params: SamplingParams, max_tokens: int, seed: int,
                  num_samples: int = NUM_SAMPLES, eos: int | None = None) -> tuple[torch.Tensor, float]:
    """The first generated tokens of `num_samples` requests, and the run's acceptance rate.

    An engine error or a failed integrity check fails the test here: the gate's verdict is
    only about runs that completed."""
    target, draft = pair
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=k,
                         max_num_seqs=2048, max_batched_tokens=32768,
                         num_kv_tokens=(len(PROMPT) + 16) * 2048 * 2, block_size=4, seed=seed, eos=eos,
                         draft_head=random_head_dir(target, HEAD_VOCAB) if method in ("eagle", "auto") else None)
    sp = replace(params, max_tokens=max_tokens, ignore_eos=True)
    # One request first puts the prompt's KV in the prefix cache; every sample then
    # shares it (and the gate covers prefix-cache reuse too).
    outs = run_all(engine, [PROMPT], sp, check=False)
    outs += run_all(engine, [PROMPT] * (num_samples - 1), sp, check=False)
    engine.check_integrity()
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:1]
    tokens = torch.tensor([o.token_ids[:max(CHECKED) + 1] for o in outs])
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    return tokens, accepted / drafted if drafted else 0.0


CELLS = [f"x{pos + 1}" for pos in CHECKED] + ["x2,x3"]
STATISTICAL_CHECKS = [f"{cell} {test}" for cell in CELLS for test in ("TV", "chi2")]
ACCEPTANCE = (0.05, 0.98)        # acceptance rate a run must reach, bounds included
SEEDS = (1234, 4321)             # the first run, and the independent one that must replicate


def statistical_checks(samples: torch.Tensor, joint: torch.Tensor) -> tuple[dict[str, bool], list[str]]:
    """One run's TV and chi-square checks: {check name: passed}, and the measured values."""
    depth = joint.dim()
    cells = []
    for pos in CHECKED:
        exact = joint.sum(dim=[d for d in range(depth) if d != pos])
        cells.append((f"x{pos + 1}", exact, samples[:, pos]))
    exact_pair = joint.sum(dim=[d for d in range(depth) if d not in (1, 2)]).reshape(-1)
    cells.append(("x2,x3", exact_pair, samples[:, 1] * VOCAB + samples[:, 2]))
    assert [name for name, _, _ in cells] == CELLS
    passed, measured, alpha = {}, [], 0.01 / len(cells)
    for name, exact, observed in cells:
        counts = torch.bincount(observed, minlength=exact.numel()).double()
        empirical = counts / counts.sum()
        tv = 0.5 * (empirical - exact).abs().sum().item()
        floor = (exact * (1 - exact) / (2 * torch.pi * len(observed))).sqrt().sum().item()
        expected = exact.double() * len(observed)
        big = expected >= 5
        f_obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
        f_exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
        keep = f_exp > 0
        f_exp = f_exp[keep] * f_obs[keep].sum() / f_exp[keep].sum()
        p_value = chisquare(f_obs[keep].numpy(), f_exp.numpy()).pvalue
        passed[f"{name} TV"] = tv <= 2 * floor
        passed[f"{name} chi2"] = p_value >= alpha
        measured.append(f"{name}: TV {tv:.4f} (floor {floor:.4f}), chi2 p {p_value:.3g}")
    return passed, measured


@dataclass
class Verdict:
    """Every check of one setting by name (STATISTICAL_CHECKS and "acceptance"): passed or not."""

    passed: dict[str, bool]
    measured: list[str]          # each run's acceptance and per-cell values, for messages

    @property
    def failed(self) -> list[str]:
        return [name for name, ok in self.passed.items() if not ok]


def run_gate(pair, joint, method, k, params, num_samples: int = NUM_SAMPLES,
             acceptance: tuple[float, float] = ACCEPTANCE, eos: int | None = None) -> Verdict:
    """The gate on one setting. The second seed runs only when the first fails a
    statistical check; a statistical check fails only if it fails on both seeds."""
    max_tokens = max(k + 2, max(CHECKED) + 1)
    runs, measured = [], []
    for seed in SEEDS:
        samples, rate = sample_engine(pair, method, k, params, max_tokens, seed, num_samples, eos)
        passed, values = statistical_checks(samples, joint)
        runs.append((rate, passed))
        measured += [f"seed {seed}: acceptance {rate:.3f}"] + values
        if all(passed.values()):
            break
    lo, hi = acceptance
    verdict = {"acceptance": all(lo <= rate <= hi for rate, _ in runs)}
    verdict.update({name: any(ok[name] for _, ok in runs) for name in STATISTICAL_CHECKS})
    return Verdict(verdict, measured)


SETTINGS = [  # (method, k, temperature, top_k, top_p)
    ("draft", 1, 1.0, 0, 1.0),
    ("draft", 2, 0.7, 0, 1.0),
    ("draft", 4, 1.0, 5, 1.0),
    ("draft", 2, 1.3, 0, 0.8),
    ("draft", 4, 0.8, 4, 0.9),
    ("ngram", 1, 1.0, 0, 1.0),
    ("ngram", 2, 0.6, 0, 0.9),
    ("ngram", 4, 1.0, 6, 1.0),
    # suffix decoding: the 20,000 requests share one prompt, so most drafts come from the
    # global trie of earlier requests' outputs
    ("suffix", 3, 0.9, 5, 0.9),
    # the EAGLE-style head over a vocabulary subset (HEAD_VOCAB); at T = 1 without filters
    # in test_eagle.py (its bug run)
    ("eagle", 3, 0.8, 4, 0.9),
    # a proposer per row and round: n-gram lookup or the head, whichever that row accepts more
    ("auto", 3, 0.9, 0, 0.9),
]


@pytest.fixture(scope="module")
def exact(pair):
    cache = {}

    def get(temperature, top_k, top_p):
        key = (temperature, top_k, top_p)
        if key not in cache:
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            cache[key] = exact_joint(pair[0], params, max(CHECKED) + 1)
        return cache[key]
    return get


@pytest.mark.gpu
@pytest.mark.parametrize("method,k,temperature,top_k,top_p", SETTINGS,
                         ids=[f"{m}-k{k}-T{t}-topk{tk}-topp{tp}" for m, k, t, tk, tp in SETTINGS])
def test_speculative_samples_match_the_exact_target_distribution(pair, exact, method, k, temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    verdict = run_gate(pair, exact(temperature, top_k, top_p), method, k, params)
    assert verdict.failed == [], verdict.measured


# Logits processors: the penalties count the output so far, drafts before a position
# included, in the target's p and in the draft's q; logit_bias and repetition_penalty
# (which also counts the prompt) reshape every position.
PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.7, repetition_penalty=1.3,
                 logit_bias={2: 1.5, 9: -2.0})
PENALTY_SETTINGS = [("draft", 3, 1.0), ("ngram", 2, 0.9)]  # (method, k, temperature)


@pytest.fixture(scope="module")
def exact_penalised(pair):
    cache = {}

    def get(params):
        if params not in cache:
            cache[params] = exact_joint(pair[0], params, max(CHECKED) + 1)
        return cache[params]
    return get


@pytest.mark.parametrize("method,k,temperature", PENALTY_SETTINGS)
def test_speculative_samples_with_penalties_match_the_exact_target_distribution(
        pair, exact_penalised, method, k, temperature):
    params = SamplingParams(temperature=temperature, **PENALTIES)
    verdict = run_gate(pair, exact_penalised(params), method, k, params)
    assert verdict.failed == [], verdict.measured


def test_a_target_penalty_with_stale_counts_is_caught(pair, exact_penalised, monkeypatch):
    """Bug: each verify position counts only the committed output, not the drafts before
    it. x2 is the first draft's position (no draft before it: exact); x3 is not."""
    import verispec.sampling as sampling_mod
    monkeypatch.setattr(sampling_mod, "_at_position", lambda h, drafts, j: h)
    params = SamplingParams(temperature=1.0, **PENALTIES)
    verdict = run_gate(pair, exact_penalised(params), "draft", 3, params, num_samples=BUG_SAMPLES)
    assert verdict.passed["acceptance"], verdict.measured
    missed = [name for name in ("x3 TV", "x3 chi2") if verdict.passed[name]]
    assert not missed, ("stale penalty counts went unnoticed by", missed, verdict.measured)


# Structured output: the constraint masks p (and q) at every position after the output so
# far, drafts before a position included. The regex's next allowed set depends on the
# previous token, so a verify position that ignored the drafts before it would be masked
# wrongly. The reference masks with `allowed_by_regex`, written without the grammar engine.
REGEX = "([a-d][e-p]|[e-p][a-h])*"
STRUCTURED_EOS = VOCAB  # a special token past the models' vocabulary: the grammar's EOS


def allowed_by_regex(output: list[int]) -> list[int]:
    """Tokens REGEX admits after `output`: anything at a pair's start; after a-d (0-3) one
    of e-p (4-15); after e-p one of a-h (0-7)."""
    if len(output) % 2 == 0:
        return list(range(VOCAB))
    return list(range(4, VOCAB)) if output[-1] < 4 else list(range(8))


# (method, k, temperature): the draft model's q is masked too; prompt lookup's drafts are cut
# at the constraint before verification (tests/test_structured.py checks the cut itself)
STRUCTURED_SETTINGS = [("draft", 3, 1.0)]


@pytest.fixture(scope="module")
def exact_structured(pair):
    cache = {}

    def get(temperature):
        if temperature not in cache:
            cache[temperature] = exact_joint(pair[0], SamplingParams(temperature=temperature),
                                             max(CHECKED) + 1, allowed_by_regex)
        return cache[temperature]
    return get


@pytest.mark.parametrize("method,k,temperature", STRUCTURED_SETTINGS)
def test_speculative_samples_with_a_grammar_match_the_exact_masked_distribution(
        pair, exact_structured, method, k, temperature):
    params = SamplingParams(temperature=temperature, structured=StructuredOutput("regex", REGEX))
    verdict = run_gate(pair, exact_structured(temperature), method, k, params, eos=STRUCTURED_EOS)
    assert verdict.failed == [], verdict.measured


def test_a_grammar_mask_narrowed_to_the_committed_state_is_caught(pair, exact_structured, monkeypatch):
    """Bug: every verify position's mask is also limited to what the committed state admits
    (a stale cached mask). Tokens stay inside the constraint, so only the statistics can
    see it: x2 is the first draft's position (exact); x3 after an accepted x2 is narrowed."""
    import verispec.structured.grammar as grammar_mod
    right = grammar_mod.allowed_tokens

    def narrowed(positions, vocab):
        allowed = right(positions, vocab)
        for i in range(1, len(positions)):
            if positions[i][0] is positions[i - 1][0]:
                allowed[i] &= allowed[i - 1]
        return allowed
    monkeypatch.setattr(grammar_mod, "allowed_tokens", narrowed)
    params = SamplingParams(temperature=1.0, structured=StructuredOutput("regex", REGEX))
    verdict = run_gate(pair, exact_structured(1.0), "draft", 3, params, num_samples=BUG_SAMPLES // 2,
                       eos=STRUCTURED_EOS)  # a quarter of the gate's samples already catch it
    assert verdict.passed["acceptance"], verdict.measured
    missed = [name for name in ("x3 TV", "x3 chi2") if verdict.passed[name]]
    assert not missed, ("a narrowed grammar mask went unnoticed by", missed, verdict.measured)


def test_a_grammar_mask_that_ignores_the_drafts_fails_its_rows_at_commit(pair, monkeypatch):
    """Bug: each verify position is masked as if no draft preceded it, so tokens outside the
    constraint get drawn. The commit refuses them: the rows fail, naming the constraint,
    before any such token reaches a response (the statistics never see this bug)."""
    import verispec.sampling as sampling_mod
    monkeypatch.setattr(sampling_mod, "_at_position", lambda h, drafts, j: h)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True,
                            structured=StructuredOutput("regex", REGEX))
    engine = tiny_engine(*pair, method="draft", k=3, eos=STRUCTURED_EOS, seed=5)
    outs = run_all(engine, [PROMPT] * 64, params, check=False)
    failed = [o for o in outs if o.error is not None]
    assert failed, "tokens outside the constraint were committed"
    assert "structured-output constraint" in engine.last_step_error
    assert all(o.token_ids == [] or _inside_regex(o.token_ids) for o in outs if o.error is None)


def _inside_regex(tokens: list[int]) -> bool:
    return all(t in allowed_by_regex(tokens[:i]) for i, t in enumerate(tokens))


# Each bug runs where it can act, and names the cells where it must show first: the
# statistical checks (TV and chi-square) of those cells must fail. x1 is sampled at
# prefill, without speculation, so no bug reaches it.
BUGS = [  # (bug, method, k, temperature, top_k, top_p, cells that must fail)
    # every draft accepted: x2 (the first draft) follows q, not p
    ("skip_acceptance_test", "draft", 2, 1.0, 0, 1.0, ["x2"]),
    # x2 is, after a rejection of the first draft, drawn from p instead of the residual
    ("resample_from_p", "draft", 2, 1.0, 0, 1.0, ["x2"]),
    # the first draft (x2) is verified against a q it was not drawn from
    ("top_p_on_target_only", "draft", 2, 1.0, 0, 0.7, ["x2"]),
    # x2 is exact; after an accepted draft the bonus is lost, the next round's token is x3
    ("drop_bonus", "draft", 1, 1.0, 0, 1.0, ["x3"]),
    # x2, x3 are exact; after an accepted draft x4 repeats the bonus x3
    ("double_bonus", "draft", 1, 1.0, 0, 1.0, ["x4"]),
    # the first round's tokens are exact; after a rejection the next round (x3 at the
    # earliest) conditions on the rejected drafts' KV. Injected with prompt lookup: with a
    # draft model the draft's own position runs past its tokens and the request fails with
    # an error, which needs no statistics to notice.
    ("stale_draft_kv", "ngram", 2, 1.0, 0, 1.0, ["x3"]),
    ("resample_from_p", "ngram", 2, 1.0, 0, 1.0, ["x2"]),
    # the same on the "auto" path: rows draft with the lookup or the head, round by round
    ("resample_from_p", "auto", 2, 1.0, 0, 1.0, ["x2"]),
]
# Every draft is accepted when the acceptance test is skipped: its run's acceptance is 1.
BUG_ACCEPTANCE = {"skip_acceptance_test": (ACCEPTANCE[0], 1.0)}
# Both checks only gain power with more samples (the TV floor shrinks as 1/sqrt(N), the
# chi-square statistic of a fixed deviation grows as N), so a bug caught with half the
# samples is caught by the gate as it runs on the settings above.
BUG_SAMPLES = NUM_SAMPLES // 2


@pytest.mark.parametrize("bug,method,k,temperature,top_k,top_p,cells", BUGS,
                         ids=[f"{b[0]}-{b[1]}" for b in BUGS])
def test_the_statistical_checks_catch_each_injected_bug(pair, exact, monkeypatch, bug, method, k,
                                                        temperature, top_k, top_p, cells):
    inject(monkeypatch, bug, top_p=top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    verdict = run_gate(pair, exact(temperature, top_k, top_p), method, k, params, num_samples=BUG_SAMPLES,
                       acceptance=BUG_ACCEPTANCE.get(bug, ACCEPTANCE))
    assert verdict.passed["acceptance"], (f"{bug}: the run drafted too little to test the sampler",
                                          verdict.measured)
    must_fail = [f"{cell} {test}" for cell in cells for test in ("TV", "chi2")]
    missed = [name for name in must_fail if verdict.passed[name]]
    assert not missed, (f"{bug} went unnoticed by {missed}", verdict.measured)
