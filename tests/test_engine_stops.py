"""Each row stops on its own: EOS, max_tokens and stop strings, also mid-way through a
speculative round whose accepted drafts run past the stop; no row comes back short
because another row finished."""
import pytest
import torch

from tiny import run_all, tiny_engine, tiny_pair
from verispec.sampling import SamplingParams

VOCAB = 24
PAIR = tiny_pair(vocab=VOCAB, noise=0.05, seed=5)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, VOCAB, (n,), generator=g).tolist() * 2)[: 2 * n] for n in (2, 5, 3, 7, 4, 6)]


def outputs(method: str, params: SamplingParams, eos: int | None = None, k: int = 6):
    target, draft = PAIR
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=k, eos=eos)
    return run_all(engine, prompts(), params)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_eos_inside_an_accepted_run_ends_that_row_exactly_like_plain_decoding(method):
    plain = outputs("none", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # As EOS, a token that plain decoding emits mid-sequence in some rows but not in all.
    rows_with = [sum(t in o.token_ids[3:] for o in plain) for t in range(VOCAB)]
    eos = max((n, t) for t, n in enumerate(rows_with) if 0 < n < len(plain))[1]
    want = outputs("none", SamplingParams(temperature=0, max_tokens=30), eos=eos)
    got = outputs(method, SamplingParams(temperature=0, max_tokens=30), eos=eos)
    assert any(o.finish_reason == "stop" for o in want) and any(o.finish_reason == "length" for o in want)
    for w, o in zip(want, got):
        assert (o.token_ids, o.finish_reason, o.text) == (w.token_ids, w.finish_reason, w.text)
        if o.finish_reason == "stop":
            assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
    assert sum(o.spec.num_accepted_tokens for o in got) > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stop_strings_cut_the_text_and_match_plain_decoding(method):
    plain = outputs("none", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop = plain[1].text[6:8]  # two letters that row 1 produces after a few tokens
    params = SamplingParams(temperature=0, max_tokens=30, stop=(stop,), ignore_eos=True)
    want = outputs("none", params)
    got = outputs(method, params)
    assert want[1].finish_reason == "stop" and stop not in want[1].text
    for w, o in zip(want, got):
        assert (o.token_ids, o.finish_reason, o.text) == (w.token_ids, w.finish_reason, w.text)
        decoded = "".join(chr(ord("a") + t) for t in o.token_ids)
        # Exactly the text before the stop string, even when it spans tokens that were
        # produced in different steps (the start of a stop string is held back, not streamed).
        assert o.text == (decoded[: decoded.index(stop)] if o.finish_reason == "stop" else decoded)


def test_max_tokens_is_exact_for_every_row_whatever_its_neighbours_do():
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 9, 17, 30)]
    target, draft = PAIR
    outs = run_all(tiny_engine(target, draft, method="draft", k=8), prompts(), params)
    assert [len(o.token_ids) for o in outs] == [1, 2, 5, 9, 17, 30]
    assert all(o.finish_reason == "length" for o in outs)
