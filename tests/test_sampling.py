"""logits_to_probs against a naive per-row reference; seeded, exact race sampling."""
import math

import pytest
import torch
from scipy.stats import chisquare

from verispec.sampling import (SamplingParams, SamplingTensors, draw_uniform, logits_to_probs,
                               noise_key, race, sample)

TEMPERATURES = [0.0, 0.5, 1.0, 1.7]
TOP_KS = [0, 1, 3, 10, 100]
TOP_PS = [1.0, 0.95, 0.6, 0.2, 0.01]
MIN_PS = [0.0, 0.05, 0.3]


def reference_probs(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> list[float]:
    """The spec, one row at a time in float64 Python, no vectorisation tricks."""
    x = [float(v) for v in logits_row]
    vocab = len(x)
    if temperature == 0:
        best = max(range(vocab), key=lambda j: (x[j], -j))  # lowest index among ties
        return [1.0 if j == best else 0.0 for j in range(vocab)]
    z = [v / temperature for v in x]
    order = sorted(range(vocab), key=lambda j: (-z[j], j))
    keep = order[:top_k] if top_k > 0 else order

    def normalise(kept):
        top = max(z[j] for j in kept)
        weights = {j: math.exp(z[j] - top) for j in kept}
        total = sum(weights.values())
        return {j: w / total for j, w in weights.items()}

    probs = normalise(keep)
    if top_p < 1:
        nucleus, mass = [], 0.0
        for j in keep:  # keep is in descending order
            if mass < top_p:
                nucleus.append(j)
                mass += probs[j]
        probs = normalise(nucleus)
    if min_p > 0:
        p_max = max(probs.values())
        probs = normalise([j for j, p in probs.items() if p >= min_p * p_max])
    return [probs.get(j, 0.0) for j in range(vocab)]


def random_params(n: int, gen: torch.Generator) -> list[SamplingParams]:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]
    return [SamplingParams(temperature=pick(TEMPERATURES), top_k=pick(TOP_KS), top_p=pick(TOP_PS),
                           min_p=pick(MIN_PS)) for _ in range(n)]


def test_logits_to_probs_matches_naive_reference_on_random_parameter_mixes():
    gen = torch.Generator().manual_seed(0)
    num_rows, vocab = 300, 40
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    logits[torch.rand(num_rows, vocab, generator=gen) < 0.1] = float("-inf")  # masked vocab
    params = random_params(num_rows, gen)
    tensors = SamplingTensors.from_params(params, "cpu")
    probs = tensors.to_probs(logits)
    expected = torch.tensor([reference_probs(logits[i], p.temperature, p.top_k, p.top_p, p.min_p)
                             for i, p in enumerate(params)], dtype=torch.float32)
    assert probs.dtype == torch.float32 and probs.shape == (num_rows, vocab)
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)
    # Deciding the fast paths from the tensors gives the same answer as the host flags.
    inferred = logits_to_probs(logits, tensors.temperature, tensors.top_k, tensors.top_p, tensors.min_p)
    torch.testing.assert_close(inferred, probs)


def test_fast_path_without_sort_equals_sorted_path():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 30, generator=gen)
    temperature = torch.rand(50, generator=gen) + 0.3
    temperature[::7] = 0
    top_k = torch.zeros(50, dtype=torch.int64)
    top_p = torch.ones(50)
    min_p = torch.full((50,), 0.1)
    fast = logits_to_probs(logits, temperature, top_k, top_p, min_p, use_sort=False)
    slow = logits_to_probs(logits, temperature, top_k, top_p, min_p, use_sort=True)
    torch.testing.assert_close(fast, slow)


def test_greedy_rows_are_one_hot_at_the_lowest_index_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, 0.5, 0.5]])
    tensors = SamplingTensors.from_params([SamplingParams(temperature=0.0, top_p=0.5, top_k=2)] * 3, "cpu")
    probs = tensors.to_probs(logits)
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]


def test_rows_are_independent_of_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(24, 50, generator=gen)
    params = random_params(24, gen)
    batched = SamplingTensors.from_params(params, "cpu").to_probs(logits)
    for i, p in enumerate(params):
        alone = SamplingTensors.from_params([p], "cpu").to_probs(logits[i:i + 1])
        torch.testing.assert_close(alone[0], batched[i])
    perm = torch.randperm(24, generator=gen)
    permuted = SamplingTensors.from_params([params[i] for i in perm], "cpu").to_probs(logits[perm])
    torch.testing.assert_close(permuted, batched[perm])


def test_top_p_always_keeps_the_top_token_and_top_k_ties_go_to_lower_ids():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 1.0, 1.0]])
    probs = logits_to_probs(logits, torch.ones(2), torch.tensor([0, 2]), torch.tensor([1e-6, 1.0]),
                            torch.zeros(2))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.5, 0.0]))


@pytest.mark.parametrize("fields", [{"top_p": 1e-46}, {"top_p": 1e-46, "top_k": 3},
                                    {"temperature": 1e-45}, {"temperature": 1e-45, "top_p": 0.5}])
def test_values_that_underflow_float32_sample_the_argmax_not_nan(fields):
    """top_p 1e-46 is 0 in float32 and temperature 1e-45 makes logits / T infinite: once an
    empty answer (every probability NaN); now the T -> 0 / top_p -> 0 limit, the argmax."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    probs = SamplingTensors.from_params([SamplingParams(**fields)], "cpu").to_probs(logits)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=1e-4).greedy


def test_expand_repeats_each_row_by_its_count():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(top_p=0.5)]
    tensors = SamplingTensors.from_params(params, "cpu")
    expanded = tensors.expand([2, 0, 3])
    assert expanded.top_k.tolist() == [0, 0, 0, 0, 0]
    assert expanded.temperature.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert expanded.top_p.tolist() == [1.0, 1.0, 0.5, 0.5, 0.5]
    assert (expanded.use_sort, expanded.use_min_p) == (True, False)
    assert tensors.expand(2).top_k.tolist() == [0, 0, 5, 5, 0, 0]
    assert tensors.expand(torch.tensor([1, 1, 1])).top_k.tolist() == [0, 5, 0]
    with pytest.raises(ValueError, match="counts"):
        tensors.expand([1, 2])


def _chi2_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert observed[~support].sum() == 0, "sampled a token of probability 0"
    expected = probs[support].double() * samples.numel()
    return chisquare(observed[support].numpy(), expected.numpy() * observed.sum().item()
                     / expected.sum().item()).pvalue


def test_race_samples_the_distribution_and_a_wrong_noise_transform_is_caught():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0, 0.0])
    n = 20000
    batch = probs.expand(n, -1).contiguous()
    gen = torch.Generator().manual_seed(3)
    assert _chi2_p(sample(batch, shared_generator=gen), probs) > 0.01
    # Injected bug: argmax(p / U) with U uniform (not exponential) is not the exact race.
    uniform = draw_uniform(n, 8, "cpu", shared_generator=gen)
    buggy = (batch / uniform.clamp_min(1e-30)).argmax(dim=-1)
    assert _chi2_p(buggy, probs) < 0.01


def test_race_is_never_nan_and_one_hot_rows_always_return_their_argmax():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])
    extreme = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0 - 2 ** -24, 0.0]])
    assert race(probs, extreme).tolist() == [1, 2, 1]
    one_hot = torch.zeros(5000, 7).scatter_(1, torch.randint(7, (5000, 1)), 1.0)
    assert torch.equal(sample(one_hot), one_hot.argmax(dim=-1))


def test_seeded_request_is_reproducible_regardless_of_batch_composition():
    """A keyed row draws race(p, u(seed, position)): neither its neighbours (seeded or not),
    nor the shared stream's state, nor the order of calls changes its token."""
    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(6, 100, generator=gen), dim=-1)

    def run(batch_size: int, row: int) -> list[int]:
        shared = torch.Generator().manual_seed(batch_size)
        out = []
        for step in range(6):
            keys = [None] * batch_size
            keys[row] = noise_key(SamplingParams(seed=1234), step)
            keys[(row + 1) % batch_size] = noise_key(SamplingParams(seed=99), step)  # a seeded neighbour
            batch = probs[torch.arange(batch_size) % 6]
            batch[row] = probs[step]
            out.append(int(sample(batch, keys, shared_generator=shared)[row]))
        return out

    reference = run(3, 0)
    assert run(7, 4) == reference and run(2, 1) == reference
    assert noise_key(SamplingParams(), 3) is None and noise_key(SamplingParams(temperature=0, seed=1), 3) is None
    other_seed = [int(sample(probs[s: s + 1], [(4321, s)])) for s in range(6)]
    assert other_seed != reference  # the seed matters


def test_reference_comparison_catches_top_p_applied_before_top_k(monkeypatch):
    import verispec.sampling as sampling

    def top_p_on_unfiltered(scaled, top_k, top_p):
        # Injected bug: nucleus mass measured before top-k renormalises the distribution.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(scaled.shape[-1])
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        removed = ((top_k[:, None] > 0) & (rank >= top_k[:, None])) | (
            (top_p[:, None] < 1) & (mass_before >= top_p[:, None]))
        return torch.empty_like(removed).scatter_(-1, order, removed)

    monkeypatch.setattr(sampling, "_top_k_top_p_removed", top_p_on_unfiltered)
    with pytest.raises(AssertionError):
        test_logits_to_probs_matches_naive_reference_on_random_parameter_mixes()
