"""bench/eagle.py: which contenders run which proposer, and what the weights load by."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from bench_scripts import load

eagle = load("eagle", "eagle_bench")
QWEN = ["--model", "qwen2.5-coder-1.5b-instruct"]


def test_without_a_draft_model_no_contender_loads_or_runs_one():
    load_cfg, configs = eagle.engine_configs(eagle.parse_args(QWEN))
    assert list(configs) == ["plain", "ngram", "eagle", "eagle-k4", "auto"]
    assert load_cfg.draft_model is None and all(c.draft_model is None for c in configs.values())


@pytest.mark.parametrize("head", [None, "/heads/h"])
def test_a_draft_model_loads_with_the_target_and_only_its_contender_runs_it(head):
    argv = QWEN + ["--draft-model", "qwen2.5-coder-0.5b-instruct"] + (["--draft-head", head] if head else [])
    load_cfg, configs = eagle.engine_configs(eagle.parse_args(argv))
    assert (load_cfg.draft_model, load_cfg.spec.method) == ("qwen2.5-coder-0.5b-instruct", "draft")
    assert {n: (c.spec.method, c.draft_model) for n, c in configs.items()} == {
        "plain": ("none", None), "ngram": ("ngram", None), "eagle": ("eagle", None),
        "eagle-k4": ("eagle", None), "auto": ("auto", None), "draft": ("draft", "qwen2.5-coder-0.5b-instruct")}
    assert {c.draft_head for c in configs.values()} == {head}
    assert (configs["eagle-k4"].spec.num_spec_tokens, configs["eagle-k4"].spec.adaptive) == (4, False)


def test_contenders_pick_a_subset_with_the_ab_control():
    _, configs = eagle.engine_configs(eagle.parse_args(QWEN + ["--contenders", "ngram,ngram-aa,auto"]))
    assert {n: c.spec.method for n, c in configs.items()} == {
        "plain": "none", "ngram": "ngram", "ngram-aa": "ngram", "auto": "auto"}


@pytest.mark.parametrize("argv", [["--contenders", "ngram,nope"], ["--contenders", "draft"]])
def test_an_unknown_contender_or_a_draft_without_its_model_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        eagle.parse_args(QWEN + argv)
    assert "contender" in capsys.readouterr().err


def _run(seconds: dict[str, float], tokens: int = 100):
    requests = [SimpleNamespace(prompt_id=p, token_ids=[0] * tokens, latency_s=s) for p, s in seconds.items()]
    total = sum(seconds.values())
    return SimpleNamespace(concurrency=1, requests=requests, tokens_per_s=tokens * len(seconds) / total)


def test_the_interval_over_ngram_pairs_each_prompt_with_itself():
    """Prompts of very different lengths, every one 10% faster under auto: paired, the
    interval is exactly 1.1; resampled unpaired it would spread with the prompts' mix."""
    rng = random.Random(0)
    base = {f"p{i}": rng.uniform(1.0, 20.0) for i in range(12)}
    results = {"plain": _run(base), "ngram": _run(base), "auto": _run({p: s / 1.1 for p, s in base.items()})}
    got = eagle.vs_ngram(results)
    assert set(got) == {"auto"}
    assert got["auto"]["ratio"] == pytest.approx(1.1)
    assert got["auto"]["interval"] == pytest.approx([1.1, 1.1])
    shuffled = dict(zip(base, rng.sample(list(base.values()), len(base))))  # pairs broken
    results["auto"] = _run({p: s / 1.1 for p, s in shuffled.items()})
    lo, hi = eagle.vs_ngram(results)["auto"]["interval"]
    assert hi - lo > 0.1
