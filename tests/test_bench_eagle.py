"""bench/eagle.py: which contenders run which proposer, and what the weights load by."""
from __future__ import annotations

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
