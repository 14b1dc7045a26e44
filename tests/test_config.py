"""One configuration object per run: YAML and flags resolve into one frozen EngineConfig."""
import argparse
import dataclasses

import pytest

from verispec.config import EngineConfig, add_engine_arguments, config_from_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_the_embedded_model_with_adaptive_auto_in_bf16():
    cfg = config_from_args(parse([]))
    assert (cfg.model, cfg.dtype, cfg.spec.method, cfg.spec.adaptive) == \
        ("smollm2-135m-instruct", "bfloat16", "auto", True)


def test_flags_override_the_yaml_file_and_the_result_round_trips(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("dtype: float32\nspec:\n  method: none\n  num_spec_tokens: 6\ncache:\n  block_size: 8\n")
    cfg = config_from_args(parse(["--config", str(path), "--spec", "ngram", "--no-spec-adaptive"]))
    assert (cfg.dtype, cfg.spec.method, cfg.spec.num_spec_tokens, cfg.spec.adaptive, cfg.cache.block_size) == \
        ("float32", "ngram", 6, False, 8)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().dtype = "float32"


@pytest.mark.parametrize("yaml_text,message", [
    ("dtipe: float32\n", "unknown config option"),
    ("spec:\n  methd: ngram\n", "unknown spec option"),
    ("dtype: float16\n", "dtype must be one of"),
    ("spec:\n  method: medusa\n", "spec method must be one of"),
    ("spec:\n  num_spec_tokens: 0\n", "num_spec_tokens must be in [1, 16]"),
    ("scheduler:\n  max_model_len: 0\n", "max_model_len must be >= 2"),
    ("threads: 0\n", "threads must be >= 1"),
    ("huge_pages: maybe\n", "huge_pages must be true or false"),
])
def test_bad_configuration_is_rejected_with_a_message_naming_it(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config_from_args(parse(["--config", str(path)]))


def test_naming_a_draft_model_selects_draft_speculation():
    cfg = config_from_args(parse(["--draft-model", "some-draft"]))
    assert cfg.spec.method == "draft" and cfg.draft_model == "some-draft"


def test_huge_pages_are_on_by_default_and_a_flag_turns_them_off_over_the_yaml(tmp_path):
    assert config_from_args(parse([])).huge_pages is True
    assert config_from_args(parse(["--no-huge-pages"])).huge_pages is False
    path = tmp_path / "run.yaml"
    path.write_text("huge_pages: false\n")
    assert config_from_args(parse(["--config", str(path)])).huge_pages is False
    assert config_from_args(parse(["--config", str(path), "--huge-pages"])).huge_pages is True


def test_auto_threads_uses_every_core_and_serve_spares_one_only_on_wide_machines(monkeypatch):
    from verispec import config as C
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, serve, generate in ((1, 1, 1), (2, 2, 2), (8, 8, 8), (9, 8, 9), (64, 63, 64)):
        monkeypatch.setattr(C, "physical_cores", lambda cores=cores: cores)
        assert (C.auto_threads("serve"), C.auto_threads("generate")) == (serve, generate)
    with pytest.raises(ValueError, match="mode must be"):
        C.auto_threads("train")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert (C.auto_threads("serve"), C.auto_threads("generate")) == (3, 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a positive integer, got 'two'"):
        C.auto_threads("serve")


def test_physical_cores_counts_usable_cores_once():
    import os

    from verispec.config import physical_cores
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_resolved_for_fills_threads_only_when_unset():
    from verispec.config import auto_threads
    assert EngineConfig().resolved_for("serve").threads == auto_threads("serve")
    assert EngineConfig(threads=3).resolved_for("serve").threads == 3


def test_tensor_parallel_ranks_share_this_machines_cores_not_the_whole_jobs(monkeypatch):
    """Ranks the engine starts share its cores; under torchrun only LOCAL_WORLD_SIZE ranks
    do (the others are on other machines); OMP_NUM_THREADS is already one process's."""
    from verispec import config as C
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(C, "physical_cores", lambda: 16)
    assert EngineConfig(tensor_parallel_size=4).resolved_for("generate").threads == 4
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")             # 4 ranks on 2 machines
    assert EngineConfig(tensor_parallel_size=4).resolved_for("generate").threads == 8
    assert EngineConfig().resolved_for("generate").threads == 16   # torchrun's -tp 1: independent engines
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineConfig(tensor_parallel_size=4).resolved_for("generate").threads == 3
