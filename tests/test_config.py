"""One configuration object per run: YAML and flags resolve into one frozen EngineConfig."""
import argparse
import dataclasses

import pytest

from verispec.config import EngineConfig, add_engine_arguments, config_from_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_the_embedded_model_with_adaptive_ngram_in_bf16():
    cfg = config_from_args(parse([]))
    assert (cfg.model, cfg.dtype, cfg.spec.method, cfg.spec.adaptive) == \
        ("smollm2-135m-instruct", "bfloat16", "ngram", True)


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
    ("spec:\n  method: eagle\n", "spec method must be one of"),
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
