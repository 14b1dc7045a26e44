"""Benchmark prompts: custom JSONL validation, built-in loaders (on fixtures), selection."""
import json
from pathlib import Path

import pytest

from verispec.bench import datasets as ds
from verispec.bench.datasets import DatasetError, load_jsonl_prompts, select_prompts

FIXTURES = Path(__file__).parent / "fixtures" / "bench" / "packages"
FAKE_FILES = {ds.MTBENCH_FILE: "question.jsonl", ds.HUMANEVAL_FILE: "HumanEval.jsonl",
              ds.COQA_FILE: "coqa.jsonl", ds.GSM8K_FILE: "gsm8k.jsonl", ds.MBPP_FILE: "mbpp.jsonl",
              ds.MATH500_FILE: "math500.jsonl", ds.ESSAYS_DIR: "essays"}


@pytest.fixture
def fake_packages(monkeypatch):
    """Point the package locator at small fixture files: the tests need no dataset package."""
    def locate(dist_name, relpath):
        return FIXTURES / FAKE_FILES[relpath], ds.DATASET_PACKAGES[dist_name]
    monkeypatch.setattr(ds, "locate_package_file", locate)


def write_lines(tmp_path, lines) -> Path:
    path = tmp_path / "custom.jsonl"
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return path


def test_custom_jsonl_accepts_prompt_and_messages_records(tmp_path):
    path = write_lines(tmp_path, [
        {"id": "a", "prompt": "Say hi."},
        {"id": 2, "messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Say bye."}], "task": "json"},
    ])
    prompts, source = load_jsonl_prompts(path)
    assert [p.prompt_id for p in prompts] == ["a", "2"]
    assert prompts[0].messages == ({"role": "user", "content": "Say hi."},)
    assert prompts[1].task == "json" and prompts[1].dataset == "custom"
    assert prompts[0].source_id == "custom:a" and len(source.sha256) == 64


@pytest.mark.parametrize("line,message", [
    ("{not json", r"custom.jsonl:2: not valid JSON"),
    ({"prompt": "x"}, r":2: field 'id'"),
    ({"id": "b"}, r":2: exactly one of fields 'prompt' and 'messages'"),
    ({"id": "b", "prompt": "x", "messages": []}, r":2: exactly one of"),
    ({"id": "b", "prompt": ""}, r":2: field 'prompt'"),
    ({"id": "b", "messages": [{"role": "bot", "content": "x"}]}, r":2: field 'messages\[0\].role'"),
    ({"id": "b", "messages": [{"role": "user"}]}, r":2: field 'messages\[0\]'"),
    ({"id": "b", "messages": [{"role": "assistant", "content": "x"}]}, r":2: .*end with a 'user'"),
    ({"id": "b", "prompt": "x", "category": "y"}, r":2: field 'category' is not allowed"),
    ({"id": "a", "prompt": "again"}, r":2: field 'id' 'a' is a duplicate"),
])
def test_bad_custom_record_names_its_line_and_field(tmp_path, line, message):
    path = write_lines(tmp_path, [{"id": "a", "prompt": "first"}, line])
    with pytest.raises(DatasetError, match=message):
        load_jsonl_prompts(path)


def test_builtin_loaders_keep_dataset_and_source_ids(fake_packages):
    by_name, sources = ds.load_datasets("spec-bench")
    assert set(by_name) == set(ds.BUILTIN_DATASETS)
    mt = by_name["mtbench"][0]
    assert mt.num_turns == 2 and mt.followups == ("Now rewrite it so that every line starts "
                                                  "with the letter A.",)
    assert mt.source_id == "mt_bench/question.jsonl:question_id=81"
    # CNN: only CoQA passages whose source is CNN, each story once (two turns share it)
    assert [p.prompt_id for p in by_name["cnn"]] == ["cnnstory1"]
    assert "river flood" in by_name["cnn"][0].messages[0]["content"]
    assert [p.prompt_id for p in by_name["json"]] == ["wikistory1"]
    assert by_name["json"][0].task == ds.TASK_JSON
    assert "return a + b" in by_name["rewrite-code"][0].messages[0]["content"]
    essay = by_name["rewrite-essay"]
    assert [p.prompt_id for p in essay] == ["test-p1", "test-p2"]
    assert "sentence.This" not in essay[0].messages[0]["content"]  # lost breaks re-split
    for name, prompts in by_name.items():
        assert all(p.dataset == name and p.source_id for p in prompts)
    assert all(s.package_version == s.pinned_version for s in sources)


def test_missing_package_error_says_how_to_install(monkeypatch):
    with pytest.raises(DatasetError, match="make bench-setup"):
        ds.locate_package_file("verispec-no-such-dataset-package", "x.jsonl")


def test_unknown_dataset_name_is_rejected():
    with pytest.raises(DatasetError, match="'nope'"):
        ds.resolve_dataset_names("gsm8k,nope")


def _prompts(n, dataset="d"):
    return [ds.BenchPrompt(dataset, f"p{i}", f"src{i}", ({"role": "user", "content": f"q{i}"},))
            for i in range(n)]


def test_selection_is_seeded_and_warmup_is_disjoint_from_measured():
    by_name = {"d": _prompts(10), "e": _prompts(6, "e")}
    a = select_prompts(by_name, 3, warmup=4, seed=1)
    b = select_prompts(by_name, 3, warmup=4, seed=1)
    c = select_prompts(by_name, 3, warmup=4, seed=2)
    assert a == b and a.measured != c.measured
    assert len(a.measured) == 6 and len(a.warmup) == 4
    assert not {p.key for p in a.measured} & {p.key for p in a.warmup}
    assert {p.dataset for p in a.warmup} == {"d", "e"}  # round-robin over datasets


def test_warmup_falls_back_to_synthetic_prompts_when_all_are_measured():
    sel = select_prompts({"d": _prompts(3)}, None, warmup=2, seed=0)
    assert len(sel.measured) == 3
    assert [p.dataset for p in sel.warmup] == ["warmup", "warmup"]


def test_num_prompts_beyond_dataset_size_is_an_error():
    with pytest.raises(DatasetError, match="--num-prompts 5 exceeds the 3 prompts"):
        select_prompts({"d": _prompts(3)}, 5, warmup=0, seed=0)


def test_warmup_with_same_text_as_a_measured_prompt_is_rejected():
    twins = _prompts(2) + [ds.BenchPrompt("d", "twin", "s", ({"role": "user", "content": "q0"},))]
    with pytest.raises(DatasetError, match="same text"):
        # seed chosen so that the twin lands among the leftovers
        for seed in range(20):
            select_prompts({"d": twins}, 2, warmup=1, seed=seed)
