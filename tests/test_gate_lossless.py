"""G1: speculative sampling at T > 0 reproduces the target's exact distribution.

A tiny random target and a noisy copy as the draft share a 16-token vocabulary, so the
exact autoregressive distribution of the first generated tokens is enumerated with the
target itself (every prefix, one batched forward per depth). The engine then generates
20,000 samples per setting through the real scheduler, proposers and rejection sampler.

Statistics. With N samples over m cells of true probabilities p_i, each count deviates by
about sqrt(N p_i (1 - p_i)), so the expected total-variation distance of the empirical
distribution is E[TV] = sum_i sqrt(p_i (1 - p_i) / (2 pi N)) (the mean absolute deviation
of a normal is sigma * sqrt(2 / pi), halved for TV). That is the sampling-noise floor; the
gate allows twice the floor, and a chi-square test (cells with expected count < 5 merged)
must not reject at p = 0.01, Bonferroni-corrected over the checks of one setting.

Decision rule: a setting fails only if its failure replicates on an independent engine
seed. A correct sampler then fails a setting with probability <= 0.01^2, while the
injected bugs (p ~ 0) fail both runs; without replication, 8 settings x 4 checks at
alpha = 0.01 would raise a false alarm somewhere about a quarter of the time. The same
gate, run with each injected bug, must fail.
"""
import itertools

import pytest
import torch
from scipy.stats import chisquare

from bugs import inject
from tiny import run_all, tiny_engine, tiny_pair
from verispec.model.attention import AttentionMetadata
from verispec.sampling import SamplingParams, SamplingTensors

VOCAB = 16
NUM_SAMPLES = 20_000
SEED_PROMPT = [3, 7, 1]
CHECKED = (1, 2, 3)                # generated positions whose distribution is checked (x2, x3, x4)


PAIR = tiny_pair(vocab=VOCAB, noise=0.08, seed=1, logit_scale=1.0)


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


def exact_joint(model, params: SamplingParams, depth: int) -> torch.Tensor:
    """P(x_1..x_depth) under the target with `params`: a tensor of shape (V,) * depth."""
    joint = torch.ones(())
    prefixes = torch.tensor([PROMPT])
    for _ in range(depth):
        st = SamplingTensors.from_params([params] * prefixes.shape[0], "cpu")
        probs = st.to_probs(last_logits(model, prefixes))  # (V^j, V)
        joint = joint.unsqueeze(-1) * probs.reshape(*joint.shape, VOCAB)
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                              torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint


def sample_engine(pair, method: str, k: int, params: SamplingParams, max_tokens: int, seed: int = 1234) -> torch.Tensor:
    target, draft = pair
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=k,
                         max_num_seqs=2048, max_batched_tokens=32768, num_kv_tokens=(len(PROMPT) + 16) * 2048 * 2,
                         block_size=4, seed=seed)
    sp = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                        max_tokens=max_tokens, ignore_eos=True)
    # One request first puts the prompt's KV in the prefix cache; every sample then
    # shares it (and the gate covers prefix-cache reuse too).
    outs = run_all(engine, [PROMPT], sp, check=False)
    outs += run_all(engine, [PROMPT] * (NUM_SAMPLES - 1), sp, check=False)
    engine.check_integrity()
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:1]
    tokens = torch.tensor([o.token_ids[:max(CHECKED) + 1] for o in outs])
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert drafted > 0 and 0.05 < accepted / drafted < 0.98, f"acceptance {accepted}/{drafted} tests nothing"
    return tokens


def gate(samples: torch.Tensor, joint: torch.Tensor) -> list[str]:
    """Failures of the TV and chi-square checks on each checked marginal and one pair."""
    depth = joint.dim()
    checks = []
    for pos in CHECKED:
        exact = joint.sum(dim=[d for d in range(depth) if d != pos])
        checks.append((f"x{pos + 1}", exact, samples[:, pos]))
    exact_pair = joint.sum(dim=[d for d in range(depth) if d not in (1, 2)]).reshape(-1)
    checks.append(("x2,x3", exact_pair, samples[:, 1] * VOCAB + samples[:, 2]))
    failures, alpha = [], 0.01 / len(checks)
    for name, exact, observed in checks:
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
        if tv > 2 * floor or p_value < alpha:
            failures.append(f"{name}: TV {tv:.4f} (floor {floor:.4f}), chi2 p {p_value:.3g}")
    return failures


def replicated_failures(pair, joint, method, k, params) -> list[str]:
    """The gate's failures, counted only if an independent engine seed fails too."""
    max_tokens = max(k + 2, max(CHECKED) + 1)
    first = gate(sample_engine(pair, method, k, params, max_tokens, seed=1234), joint)
    if not first:
        return []
    second = gate(sample_engine(pair, method, k, params, max_tokens, seed=4321), joint)
    return first + second if second else []


SETTINGS = [  # (method, k, temperature, top_k, top_p)
    ("draft", 1, 1.0, 0, 1.0),
    ("draft", 2, 0.7, 0, 1.0),
    ("draft", 4, 1.0, 5, 1.0),
    ("draft", 2, 1.3, 0, 0.8),
    ("draft", 4, 0.8, 4, 0.9),
    ("ngram", 1, 1.0, 0, 1.0),
    ("ngram", 2, 0.6, 0, 0.9),
    ("ngram", 4, 1.0, 6, 1.0),
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


@pytest.mark.parametrize("method,k,temperature,top_k,top_p", SETTINGS,
                         ids=[f"{m}-k{k}-T{t}-topk{tk}-topp{tp}" for m, k, t, tk, tp in SETTINGS])
def test_speculative_samples_match_the_exact_target_distribution(pair, exact, method, k, temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    assert replicated_failures(pair, exact(temperature, top_k, top_p), method, k, params) == []


BUGS = [  # each with a setting where the bug can act
    ("skip_acceptance_test", "draft", 2, 1.0, 0, 1.0),
    ("resample_from_p", "draft", 2, 1.0, 0, 1.0),
    ("top_p_on_target_only", "draft", 2, 1.0, 0, 0.7),
    ("drop_bonus", "draft", 1, 1.0, 0, 1.0),
    ("double_bonus", "draft", 1, 1.0, 0, 1.0),
    ("stale_draft_kv", "draft", 2, 1.0, 0, 1.0),
    ("resample_from_p", "ngram", 2, 1.0, 0, 1.0),
]


@pytest.mark.parametrize("bug,method,k,temperature,top_k,top_p", BUGS, ids=[f"{b[0]}-{b[1]}" for b in BUGS])
def test_the_gate_flags_each_injected_bug(pair, exact, monkeypatch, bug, method, k, temperature, top_k, top_p):
    inject(monkeypatch, bug, top_p=top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    try:
        failures = replicated_failures(pair, exact(temperature, top_k, top_p), method, k, params)
    except AssertionError:
        return  # the run itself was flagged (errors, or acceptance out of range)
    assert failures, f"{bug} went unnoticed"
