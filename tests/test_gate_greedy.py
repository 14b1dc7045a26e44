"""G2: at temperature 0, speculative output is token-identical to plain decoding.

Every proposer, every k in 1..8, batch sizes 1, 3 and 8 with mixed prompt lengths. The
draft is noisy enough that acceptance stays well below 1 (asserted), so the rejection path
is exercised, and injected bugs (the acceptance test skipped; rejected drafts' KV kept as
context) are shown to break the identity.
"""
import pytest
import torch

from bugs import inject
from eagle_heads import trained_head_dir
from tiny import run_all, tiny_engine, tiny_pair
from verispec.sampling import SamplingParams

VOCAB = 48
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=VOCAB, noise=0.1, seed=3)


def prompts_for(batch_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [2, 5, 9, 17, 3, 12, 7, 26][:batch_size]
    # Half of each prompt repeats itself so prompt lookup finds matches.
    out = []
    for n in lengths:
        head = torch.randint(0, VOCAB, (max(1, n // 2),), generator=g).tolist()
        out.append((head * 3)[:n])
    return out


@pytest.fixture(scope="module")
def plain_outputs(pair):
    target, _ = pair
    return {b: [o.token_ids for o in run_all(tiny_engine(target, method="none"), prompts_for(b, b), GREEDY)]
            for b in (1, 3, 8)}


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "draft", "suffix", "eagle", "auto"])
def test_greedy_speculative_output_equals_plain_for_every_k(pair, plain_outputs, method):
    target, draft = pair
    # the EAGLE-style head: distilled for a few seconds on 32 of the 48 tokens
    head = trained_head_dir(target, 32) if method in ("eagle", "auto") else None
    drafted = accepted = 0
    for k in (*range(1, 9), 16):   # 1-8, and suffix decoding's default k_max
        for batch_size in (1, 3, 8):
            engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=k, draft_head=head)
            outs = run_all(engine, prompts_for(batch_size, batch_size), GREEDY)
            for i, (out, want) in enumerate(zip(outs, plain_outputs[batch_size])):
                assert out.token_ids == want, f"{method} k={k} batch={batch_size} row {i} diverged"
                drafted += out.spec.num_draft_tokens
                accepted += out.spec.num_accepted_tokens
    rate = accepted / drafted
    assert drafted > 500 and 0.05 < rate < 0.99, f"acceptance {rate:.3f} over {drafted} drafts proves nothing"


# Each bug with a proposer where it is silent: the requests complete at full length, so it
# is the token comparison, not an error, that catches it (tests/bugs.py says why stale KV
# is injected with prompt lookup).
@pytest.mark.parametrize("bug,method", [("skip_acceptance_test", "draft"), ("stale_draft_kv", "ngram")])
def test_greedy_identity_catches_injected_bugs(pair, plain_outputs, monkeypatch, bug, method):
    inject(monkeypatch, bug)
    target, draft = pair
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=4)
    outs = run_all(engine, prompts_for(8, 8), GREEDY, check=False)
    assert [o.error for o in outs] == [None] * 8
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert any(o.token_ids != w for o, w in zip(outs, plain_outputs[8]))
