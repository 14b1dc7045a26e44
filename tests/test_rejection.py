"""The rejection sampler is lossless: an exact-distribution gate that can fail, and greedy identity.

The gate. Fix a target p_t and a draft q_t for every position t of a tiny vocabulary
(V = 6); p_t does not depend on earlier tokens, so plain decoding emits x_t ~ p_t,
independently. We run the engine's loop on B = 20,000 rows at once: draft from q at the
row's position, verify with `rejection_sample`, append its output, advance by num_output,
repeat until each row has 3 tokens. Exact law the output must follow:
  - x_0 ~ p_0;  (x_0, x_1) ~ p_0 x p_1;  (x_1, x_2) ~ p_1 x p_2;
  - num_output of the first call: with acceptance alpha_i = sum_x min(p_i, q_i)(x) (for
    one-hot q, drafts d ~ q accepted with p(d): alpha_i = sum_x q_i(x) p_i(x)), a row
    with n drafts has P(num_output = j + 1) = alpha_0 ... alpha_{j-1} (1 - alpha_j) for
    j < n, and alpha_0 ... alpha_{n-1} for j = n.
Each statistic passes if its total-variation distance to the exact law is below
4 * sqrt(C / (2 pi N)) (C = cells with positive probability) and scipy's chi-square
p-value is above 0.01.

Noise floor: with N samples a cell's empirical frequency has standard deviation
sqrt(p(1 - p) / N), and for the normal approximation E|p_hat - p| = sqrt(2 p (1 - p) / (pi N)).
So E[TV] = 1/2 sum_x E|p_hat(x) - p(x)| <= 1/2 sqrt(2 / (pi N)) sum_x sqrt(p(x))
<= sqrt(C / (2 pi N)) by Cauchy-Schwarz (sum sqrt(p) <= sqrt(C)). TV is a sum of C
weakly dependent terms, so its spread is well below its mean: 4x the bound on the mean
never trips by chance, while a real bias of that size is a loud failure. (The chi-square
test, at the 1% level, is the sharper of the two.)

The gate must be able to fail: five injected bugs, each of which it must flag.
"""
import math

import pytest
import torch
from scipy.stats import chisquare

import verispec.spec.rejection as rejection
from verispec.sampling import SamplingParams, SamplingTensors
from verispec.spec.rejection import RejectionResult, rejection_sample, seeded_verify

VOCAB = 6
NUM_ROWS = 20_000
NUM_TOKENS = 3  # tokens each stream row collects
SETTINGS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7_topk3": SamplingParams(temperature=0.7, top_k=3),
    "t1.3_topp0.7": SamplingParams(temperature=1.3, top_p=0.7),
    "t1.0_topk5_topp0.9_minp0.1": SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1),
}


def to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> probs (..., V) through the engine's one function."""
    flat = logits.reshape(-1, logits.shape[-1])
    row = SamplingTensors.from_params([params], "cpu")
    return row.expand(flat.shape[0]).to_probs(flat).reshape(logits.shape)


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of probs (..., V) by inverse CDF: independent of the code under test."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(probs.shape[:-1] + (1,), generator=gen) * cdf[..., -1:]
    return (cdf <= u).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


# ---------------------------------------------------------------------------------------
# The stream harness: the engine's propose -> verify -> append loop on fixed tables
# ---------------------------------------------------------------------------------------
def draft_counts(k: int) -> torch.Tensor:
    """Ragged (B,): half the rows draft k tokens, the rest cycle through 0..k."""
    rows = torch.arange(NUM_ROWS)
    return torch.where(rows % 2 == 0, k, (rows // 2) % (k + 1))


def run_stream(p_table, q_table, q_declared, k, counts, sampler, gen):
    """Tokens (B, NUM_TOKENS) and the first call's num_output (B,).

    p_table, q_table: (T, V) target / draft distribution per position; drafts are drawn
    from q_table. q_declared: (T, V) the q handed to the sampler (None: one-hot).
    """
    tokens = torch.full((NUM_ROWS, NUM_TOKENS + k + 2), -1, dtype=torch.int64)
    filled = torch.zeros(NUM_ROWS, dtype=torch.int64)
    first_num_output = None
    while (active := (filled < NUM_TOKENS).nonzero().squeeze(1)).numel():
        positions = filled[active, None] + torch.arange(k + 1)                # (A, k + 1)
        draft_pos = positions[:, :k]                                          # (A, k)
        drafts = draw(q_table[draft_pos], gen)                                # (A, k)
        draft_probs = None if q_declared is None else q_declared[draft_pos]   # (A, k, V)
        result = sampler(p_table[positions], drafts, draft_probs, counts[active],
                         shared_generator=gen)
        if first_num_output is None:
            first_num_output = result.num_output.clone()
        width = result.output_tokens.shape[1]
        slot = filled[active, None] + torch.arange(width)                     # (A, width)
        emitted = torch.arange(width)[None, :] < result.num_output[:, None]   # (A, width)
        rows = active[:, None].expand_as(slot)
        tokens[rows[emitted], slot[emitted]] = result.output_tokens[emitted]
        filled[active] += result.num_output
    return tokens[:, :NUM_TOKENS], first_num_output


def exact_num_output(alpha: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Law of num_output (index 0..k+2) over the rows' draft counts; alpha (k,) acceptance."""
    law = torch.zeros(k + 3, dtype=torch.float64)
    for n, rows in zip(*torch.unique(counts, return_counts=True)):
        survive = 1.0
        for j in range(int(n)):
            law[j + 1] += rows * survive * (1 - alpha[j])
            survive *= float(alpha[j])
        law[int(n) + 1] += rows * survive
    return law / law.sum()


def gate(observed: torch.Tensor, expected: torch.Tensor, name: str) -> dict:
    """TV and chi-square of integer samples against an exact law (flattened cells)."""
    n = observed.numel()
    counts = torch.bincount(observed, minlength=expected.numel()).double()
    expected = expected.double().flatten()
    possible = expected > 0
    tv = 0.5 * (counts / n - expected).abs().sum().item()
    threshold = 4 * math.sqrt(int(possible.sum()) / (2 * math.pi * n))
    if counts[~possible].sum() > 0:
        pvalue = 0.0  # a sample in an impossible cell
    else:
        # Pool cells expected below 5 counts so the chi-square approximation holds.
        exp_counts, obs = expected[possible] * n, counts[possible]
        small = exp_counts < 5
        exp_cells = torch.cat([exp_counts[~small], exp_counts[small].sum().reshape(1)])
        obs_cells = torch.cat([obs[~small], obs[small].sum().reshape(1)])
        keep = exp_cells > 0
        exp_cells = exp_cells[keep] * obs_cells.sum() / exp_cells[keep].sum()  # float32 p: renormalise
        pvalue = float(chisquare(obs_cells[keep].numpy(), exp_cells.numpy()).pvalue)
    return {"name": name, "tv": tv, "threshold": threshold, "pvalue": pvalue,
            "flagged": tv > threshold or pvalue < 0.01}


def run_gate(setting: str, k: int, q_mode: str, sampler=rejection_sample, seed: int = 0,
             mismatched_top_p: bool = False) -> list[dict]:
    """All four statistics of one configuration; q_mode is 'q' (probs given) or 'one_hot'."""
    gen = torch.Generator().manual_seed(seed)
    params = SETTINGS[setting]
    num_positions = NUM_TOKENS + k
    p_logits = torch.randn(num_positions, VOCAB, generator=gen) * 1.2
    q_logits = p_logits + torch.randn(num_positions, VOCAB, generator=gen) * 0.9
    p_table, q_table = to_probs(p_logits, params), to_probs(q_logits, params)
    q_declared = None
    if q_mode == "q":
        # The bug: drafts are drawn with top-p but the q handed to the verifier lacks it.
        no_top_p = SamplingParams(temperature=params.temperature, top_k=params.top_k, min_p=params.min_p)
        q_declared = to_probs(q_logits, no_top_p) if mismatched_top_p else q_table
    counts = draft_counts(k)
    tokens, num_output = run_stream(p_table, q_table, q_declared, k, counts, sampler, gen)

    if q_mode == "q":
        alpha = torch.minimum(p_table[:k], q_table[:k]).sum(-1)              # (k,)
    else:
        alpha = (q_table[:k] * p_table[:k]).sum(-1)                          # (k,)
    p0, p1, p2 = p_table[0], p_table[1], p_table[2]
    valid = (tokens >= 0).all(dim=1)
    safe = tokens.clamp(min=0)
    pair01 = torch.where(valid, safe[:, 0] * VOCAB + safe[:, 1], VOCAB * VOCAB)
    pair12 = torch.where(valid, safe[:, 1] * VOCAB + safe[:, 2], VOCAB * VOCAB)
    pad = torch.zeros(1)  # the extra cell: a -1 token (impossible under the exact law)
    return [
        gate(torch.where(valid, safe[:, 0], VOCAB), torch.cat([p0, pad]), "x0 ~ p0"),
        gate(pair01, torch.cat([torch.outer(p0, p1).flatten(), pad]), "(x0, x1) ~ p0 x p1"),
        gate(pair12, torch.cat([torch.outer(p1, p2).flatten(), pad]), "(x1, x2) ~ p1 x p2"),
        gate(num_output.clamp(max=k + 2), exact_num_output(alpha, counts, k), "num_output law"),
    ]


@pytest.mark.parametrize("q_mode", ["q", "one_hot"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_output_follows_the_exact_target_law(setting, k, q_mode):
    for stat in run_gate(setting, k, q_mode):
        assert not stat["flagged"], stat


# ---------------------------------------------------------------------------------------
# Injected bugs: the gate must flag every one
# ---------------------------------------------------------------------------------------
def _all_accepted(result, counts):
    """Rows that drafted >= 1 token and accepted them all (their last token is a bonus)."""
    counts = torch.as_tensor(counts)
    return (counts > 0) & (result.accepted_len == counts)


def drop_bonus(*args, **kwargs):
    """Bug: when every draft is accepted, no bonus token is emitted (consistently counted).

    The token stream stays exact (the next round samples that position from p anyway);
    what breaks is the sampler's contract and a free token per round, which the
    num_output law catches.
    """
    result = rejection_sample(*args, **kwargs)
    counts = torch.as_tensor(args[3])
    full = _all_accepted(result, counts)
    output = result.output_tokens.clone()
    output[full, counts[full]] = -1
    return RejectionResult(output, result.num_output - full.long(), result.accepted_len)


def double_bonus(*args, **kwargs):
    """Bug: the bonus token is emitted twice."""
    result = rejection_sample(*args, **kwargs)
    counts = torch.as_tensor(args[3])
    full = _all_accepted(result, counts)
    output = torch.nn.functional.pad(result.output_tokens, (0, 1), value=-1)
    output[full, counts[full] + 1] = output[full, counts[full]]
    return RejectionResult(output, result.num_output + full.long(), result.accepted_len)


def always_accept(monkeypatch):
    monkeypatch.setattr(rejection, "_accept_mask",
                        lambda target_probs, draft_tokens, draft_probs, uniform:
                        torch.ones_like(draft_tokens, dtype=torch.bool))


def resample_from_p(monkeypatch):
    monkeypatch.setattr(rejection, "_residual", lambda p, q: p)
    monkeypatch.setattr(rejection, "_residual_one_hot", lambda p, draft: p)


BUGS = {
    "skip_acceptance_test": dict(patch=always_accept),
    "resample_from_p_not_residual": dict(patch=resample_from_p),
    "top_p_on_p_but_not_q": dict(mismatched_top_p=True),
    "drop_bonus_token": dict(sampler=drop_bonus),
    "double_count_bonus": dict(sampler=double_bonus),
}


# A one-hot q (n-gram) has no top-p to forget, so that bug only has a "q" case.
BUG_CASES = [(bug, q_mode) for bug in BUGS for q_mode in ("q", "one_hot")
             if not (bug == "top_p_on_p_but_not_q" and q_mode == "one_hot")]


@pytest.mark.parametrize("bug,q_mode", BUG_CASES)
def test_gate_flags_injected_bug(bug, q_mode, monkeypatch):
    spec = BUGS[bug]
    if "patch" in spec:
        spec["patch"](monkeypatch)
    stats = run_gate("t1.3_topp0.7", 2, q_mode, sampler=spec.get("sampler", rejection_sample),
                     mismatched_top_p=spec.get("mismatched_top_p", False))
    assert any(s["flagged"] for s in stats), stats


# ---------------------------------------------------------------------------------------
# Greedy: temperature 0 through the same sampler is argmax decoding, token for token
# ---------------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0)


class ToyLM:
    """Next-token logits as a function of (previous token, position); deterministic."""

    def __init__(self, weights: torch.Tensor, position_bias: torch.Tensor):
        self.weights, self.position_bias = weights, position_bias  # (V, V), (T, V)

    def logits(self, prev: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.weights[prev] + self.position_bias[position]  # (..., V)


def greedy_decode(model: ToyLM, start: torch.Tensor, num_tokens: int) -> torch.Tensor:
    out, prev = [], start
    for t in range(num_tokens):
        prev = model.logits(prev, torch.full_like(prev, t)).argmax(dim=-1)
        out.append(prev)
    return torch.stack(out, dim=1)  # (B, num_tokens)


def speculative_decode(target, draft, start, num_tokens, k_max, draft_mode, gen):
    """The engine loop with a toy target and draft; returns tokens and acceptance rate."""
    batch = start.shape[0]
    tokens = torch.full((batch, num_tokens + k_max + 1), -1, dtype=torch.int64)
    filled = torch.zeros(batch, dtype=torch.int64)
    last = start.clone()
    drafted = accepted = 0
    while (active := (filled < num_tokens).nonzero().squeeze(1)).numel():
        counts = torch.randint(0, k_max + 1, (active.numel(),), generator=gen)
        counts[0] = k_max
        prev, drafts, qs = last[active], [], []
        for j in range(k_max):
            q = to_probs(draft.logits(prev, filled[active] + j),
                         SamplingParams(temperature=0.5) if draft_mode == "q_sampled" else GREEDY)
            prev = draw(q, gen)
            drafts.append(prev)
            qs.append(q)
        drafts = torch.stack(drafts, dim=1)                                    # (A, k)
        prefix = torch.cat([last[active, None], drafts], dim=1)                # (A, k + 1)
        positions = filled[active, None] + torch.arange(k_max + 1)
        p = to_probs(target.logits(prefix, positions), GREEDY)                 # (A, k + 1, V)
        q = None if draft_mode == "q_none" else torch.stack(qs, dim=1)         # (A, k, V)
        result = rejection_sample(p, drafts, q, counts, shared_generator=gen)
        slot = filled[active, None] + torch.arange(k_max + 1)
        emitted = torch.arange(k_max + 1)[None, :] < result.num_output[:, None]
        tokens[active[:, None].expand_as(slot)[emitted], slot[emitted]] = result.output_tokens[emitted]
        last[active] = result.output_tokens.gather(1, result.accepted_len[:, None]).squeeze(1)
        filled[active] += result.num_output
        drafted += int(counts.sum())
        accepted += int(result.accepted_len.sum())
    return tokens[:, :num_tokens], accepted / drafted


@pytest.mark.parametrize("draft_mode", ["q_one_hot", "q_none", "q_sampled"])
@pytest.mark.parametrize("k_max", range(1, 9))
def test_greedy_is_token_identical_to_argmax_decoding(k_max, draft_mode):
    gen = torch.Generator().manual_seed(k_max)
    vocab, num_tokens, batch = 32, 16, 32
    weights = torch.randn(vocab, vocab, generator=gen) * 2
    bias = torch.randn(num_tokens + k_max + 1, vocab, generator=gen)
    target = ToyLM(weights, bias)
    draft = ToyLM(weights + torch.randn(vocab, vocab, generator=gen) * 0.7, bias)
    start = torch.randint(vocab, (batch,), generator=gen)
    spec, acceptance = speculative_decode(target, draft, start, num_tokens, k_max, draft_mode, gen)
    assert torch.equal(spec, greedy_decode(target, start, num_tokens))
    assert 0.1 < acceptance < 0.95, f"acceptance {acceptance:.2f}: rejections not exercised"


def test_greedy_identity_check_catches_accepting_every_draft(monkeypatch):
    # Resampling from p instead of the residual max(0, p - q) is invisible here: with a
    # one-hot p both are the argmax. Accepting every draft (the acceptance test skipped) is
    # not: it must diverge from argmax decoding. (Every draft accepted also puts acceptance
    # at 1, outside the range that test asserts after the identity; the identity must be
    # what fails.)
    always_accept(monkeypatch)
    with pytest.raises(AssertionError) as failure:
        test_greedy_is_token_identical_to_argmax_decoding(4, "q_sampled")
    assert "rejections not exercised" not in str(failure.value), failure.value


# ---------------------------------------------------------------------------------------
# Unit properties
# ---------------------------------------------------------------------------------------
def test_one_hot_q_accepts_with_p_of_d_and_recovers_from_p_without_d():
    # q one-hot at d: accept probability min(1, p(d)/1) = p(d); residual max(0, p - onehot(d))
    # = p with p(d) zeroed, i.e. p conditioned on x != d.
    p = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])
    d = 1
    n = NUM_ROWS
    gen = torch.Generator().manual_seed(5)
    result = rejection_sample(torch.stack([p, p]).expand(n, 2, -1), torch.full((n, 1), d), None,
                              torch.ones(n, dtype=torch.int64), shared_generator=gen)
    rate = result.accepted_len.double().mean().item()
    assert abs(rate - p[d].item()) < 4 * math.sqrt(p[d] * (1 - p[d]) / n)
    recovered = result.output_tokens[result.accepted_len == 0, 0]
    conditioned = p.clone()
    conditioned[d] = 0
    assert not gate(recovered, conditioned / conditioned.sum(), "recovered")["flagged"]


def test_one_hot_q_none_equals_an_explicit_one_hot_q():
    gen = torch.Generator().manual_seed(6)
    batch, k = 500, 3
    p = torch.softmax(torch.randn(batch, k + 1, VOCAB, generator=gen) * 2, dim=-1)
    drafts = torch.randint(VOCAB, (batch, k), generator=gen)
    counts = torch.randint(0, k + 1, (batch,), generator=gen)
    one_hot = torch.nn.functional.one_hot(drafts, VOCAB).float()
    implicit = rejection_sample(p, drafts, None, counts, shared_generator=torch.Generator().manual_seed(7))
    explicit = rejection_sample(p, drafts, one_hot, counts, shared_generator=torch.Generator().manual_seed(7))
    for a, b in zip(implicit, explicit):
        assert torch.equal(a, b)


def _greedy_cases(seed: int, batch: int = 2000, k: int = 4):
    """Greedy verify inputs that exercise every branch: ties in the logits (integer-valued),
    drafts that match the argmax at random depths, ragged counts including 0, and a draft q."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (batch, k + 1, VOCAB), generator=gen).float()   # many ties
    argmax = logits.argmax(dim=-1)                                                # (B, K+1)
    wrong = (argmax[:, :k] + torch.randint(1, VOCAB, (batch, k), generator=gen)) % VOCAB
    depth = torch.randint(0, k + 1, (batch,), generator=gen)                      # matching prefix
    drafts = torch.where(torch.arange(k)[None, :] < depth[:, None], argmax[:, :k], wrong)
    counts = torch.randint(0, k + 1, (batch,), generator=gen)
    q = torch.softmax(torch.randn(batch, k, VOCAB, generator=gen), dim=-1)
    return logits, drafts, counts, q


def _sampler_result(logits, drafts, counts, q, seed):
    p = to_probs(logits, SamplingParams(temperature=0.0))                          # one-hot p
    return rejection_sample(p, drafts, q, counts, shared_generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_verify_equals_the_sampler_on_one_hot_distributions(with_q):
    """The engine's all-greedy path (argmaxes only) returns what the general sampler does."""
    logits, drafts, counts, q = _greedy_cases(11)
    fast = rejection.greedy_verify(logits.argmax(dim=-1), drafts, counts)
    for seed in (0, 1):  # the general path draws noise; greedy rows must ignore it
        slow = _sampler_result(logits, drafts, counts, q if with_q else None, seed)
        for a, b in zip(fast, slow):
            assert torch.equal(a, b)
    assert 0 < int((fast.accepted_len < counts).sum()) < len(counts)  # rejections and full accepts


def test_greedy_verify_check_catches_an_off_by_one():
    """Negative: a greedy path that also accepts the first mismatching draft is caught."""
    logits, drafts, counts, q = _greedy_cases(12)
    argmax = logits.argmax(dim=-1)
    fast = rejection.greedy_verify(argmax, drafts, counts)
    k = drafts.shape[1]
    broken_len = torch.minimum(fast.accepted_len + 1, counts)                      # accepts one too many
    broken = rejection._assemble(torch.where(torch.arange(k)[None, :] < counts[:, None], drafts, 0), broken_len,
                                 argmax.gather(1, broken_len[:, None])[:, 0])
    slow = _sampler_result(logits, drafts, counts, None, 0)
    assert not all(torch.equal(a, b) for a, b in zip(broken, slow))


def test_zero_drafts_is_plain_decoding_and_padding_is_ignored():
    gen = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(VOCAB, generator=gen), dim=-1)
    n = NUM_ROWS
    target = p.expand(n, 3, -1)
    garbage = torch.full((n, 2), -1)  # never looked at: num_draft_tokens = 0
    result = rejection_sample(target, garbage, None, torch.zeros(n, dtype=torch.int64), shared_generator=gen)
    assert (result.num_output == 1).all() and (result.output_tokens[:, 1:] == -1).all()
    assert not gate(result.output_tokens[:, 0], p, "plain decoding")["flagged"]
    empty_k = rejection_sample(target[:, :1], garbage[:, :0], None, [0] * n, shared_generator=gen)
    assert not gate(empty_k.output_tokens[:, 0], p, "K = 0")["flagged"]


def test_residual_of_p_equal_q_falls_back_to_p_without_nan(monkeypatch):
    # p == q: a rejection has probability 0; forced anyway, the residual is all zeros and
    # the sampler must fall back to p rather than return garbage or NaN.
    monkeypatch.setattr(rejection, "_accept_mask", lambda tp, dt, dp, u: torch.zeros_like(dt, dtype=torch.bool))
    p = torch.tensor([[[0.0, 0.7, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]]]).expand(4000, -1, -1)
    result = rejection_sample(p, torch.ones(4000, 1, dtype=torch.int64), p[:, :1], [1] * 4000)
    assert set(result.output_tokens[:, 0].tolist()) == {1, 2}
    final = rejection._final_distribution(p, torch.ones(4000, 1, dtype=torch.int64), p[:, :1],
                                          torch.zeros(4000, dtype=torch.int64), torch.ones(4000, dtype=torch.int64))
    assert torch.equal(final, p[:, 0])


def test_seeded_row_is_reproducible_regardless_of_batch_composition():
    """`seeded_verify`: a row's tokens depend on its p, drafts, count and key (seed, output
    position) only, never on the rows beside it or the padding width K."""
    gen = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(1, 5, 50, generator=gen), dim=-1)
    drafts = torch.multinomial(p[0, :4], 1, generator=gen).view(1, 4)

    def run(batch: int, row: int, k_max: int, count: int) -> list:
        target = torch.softmax(torch.randn(batch, k_max + 1, 50), dim=-1)
        draft_tokens = torch.randint(50, (batch, k_max))
        target[row, :count + 1], draft_tokens[row, :count] = p[0, :count + 1], drafts[0, :count]
        counts = torch.randint(0, k_max + 1, (batch,))
        counts[row] = count
        keys = [(int(s), 7) for s in torch.randint(1000, (batch,))]
        keys[row] = (42, 3)
        r = seeded_verify(target, draft_tokens, counts, keys)
        return r.output_tokens[row, :r.num_output[row]].tolist()

    reference = run(1, 0, 3, 3)
    assert run(6, 2, 3, 3) == reference and run(9, 8, 7, 3) == reference


def test_bad_inputs_are_rejected_with_the_field_named():
    p = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample(p, torch.zeros(2, 3, dtype=torch.int64), None, [0, 0])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, 5), [0, 0])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(p, torch.zeros(2, 2, dtype=torch.int64), None, [0, 3])
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p[0], torch.zeros(2, 2, dtype=torch.int64), None, [0, 0])
