"""bench/controller_ab.py: the baseline controller comes from git, whole and on its own."""
from __future__ import annotations

import pytest

from bench_scripts import load
from verispec.spec import controller

controller_ab = load("controller_ab", "controller_ab_bench")


def test_the_baseline_is_the_revisions_controller_in_a_module_of_its_own():
    module, commit = controller_ab.load_baseline("HEAD")
    assert len(commit) == 40 and module is not controller
    assert module.AdaptiveController is not controller.AdaptiveController
    ctl = module.AdaptiveController(module.ControllerConfig(**controller.ControllerConfig().to_dict()))
    ctl.start("r", "ngram")
    assert ctl.choose_k(["r"], 1, [4]) == {"r": 0}  # nothing measured yet: plain, as the engine expects


def test_a_bad_baseline_or_repeats_is_refused_by_name(capsys):
    with pytest.raises(SystemExit, match="--baseline 'no-such-rev'"):
        controller_ab.load_baseline("no-such-rev")
    with pytest.raises(SystemExit):
        controller_ab.parse_args(["--baseline", "HEAD", "--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err
