"""The `verispec` command line, run as a subprocess on the default model.

`generate --json` reports text, token ids, timings and consistent speculation counters;
streaming writes the same text; bad input ends with ONE line on stderr that names the problem
and a non-zero exit, never a traceback; `check-pair` and `models list` work.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_files import write_header_only_gguf


MODEL = "smollm2-135m-instruct"
REWRITE = ("Rewrite the following paragraph, replacing every 'cat' with 'dog':\n\nThe cat sat on "
           "the mat by the window. Every morning the cat watched the birds in the garden.")
# float32 and a fixed k: greedy output is then reproducible and identical with and without
# speculation; a small KV pool keeps each process light.
MAX_TOKENS = 16  # the answer is longer, so every run ends by length
GENERATE = ["generate", "--prompt", REWRITE, "--chat", "--max-tokens", str(MAX_TOKENS), "--dtype", "float32",
            "--num-spec-tokens", "4", "--no-spec-adaptive", "--kv-tokens", "2048"]


def verispec(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `python -m verispec.cli ARGS` with one torch thread (the machine is shared)."""
    full_env = {k: v for k, v in os.environ.items() if k != "VERISPEC_DEBUG"}
    full_env.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "verispec.cli", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


@pytest.fixture(scope="module")
def json_runs():
    """`generate --json` with n-gram speculation and without: {method: parsed output}."""
    runs = {}
    for method in ("ngram", "none"):
        res = verispec(*GENERATE, "--spec", method, "--json")
        assert res.returncode == 0, res.stderr
        lines = res.stdout.strip().splitlines()
        assert len(lines) == 1, f"--json must print exactly one line, got {res.stdout!r}"
        runs[method] = json.loads(lines[0])
    return runs


# --- generate ----------------------------------------------------------------------------------

def test_json_output_has_every_field_with_consistent_counts(json_runs):
    out = json_runs["ngram"]
    for key in ("text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason", "ttft_s",
                "decode_tokens_per_s", "spec"):
        assert key in out, key
    assert out["completion_tokens"] == len(out["token_ids"]) == MAX_TOKENS and out["finish_reason"] == "length"
    assert out["prompt_tokens"] > 20 and out["text"].strip()
    assert out["ttft_s"] > 0 and out["decode_tokens_per_s"] > 0
    # the config as run, "auto" weight formats resolved (float32: dense)
    assert out["config"]["weight_format"] == "dense" and out["config"]["spec"]["method"] == "ngram"
    spec = out["spec"]
    assert spec["num_drafts"] > 0 and 0 < spec["accepted"] <= spec["drafted"], spec
    assert sum(spec["drafted_per_position"]) == spec["drafted"]
    assert sum(spec["accepted_per_position"]) == spec["accepted"]
    assert len(spec["acceptance_per_position"]) <= 4
    for acc, drafted, rate in zip(spec["accepted_per_position"], spec["drafted_per_position"],
                                  spec["acceptance_per_position"]):
        assert acc <= drafted and rate == pytest.approx(acc / drafted)
    # Accepting draft i+1 needs draft i accepted: the counts cannot grow with the position.
    assert spec["accepted_per_position"] == sorted(spec["accepted_per_position"], reverse=True)
    assert spec["mean_accepted_len"] == pytest.approx(spec["accepted"] / spec["num_drafts"])
    # One prefill pass yields 1 token and each verify pass 1 + its accepted drafts.
    assert out["completion_tokens"] <= spec["target_forwards"] + spec["accepted"]
    assert spec["target_forwards"] < out["completion_tokens"], "speculation saved no target pass"


def test_spec_none_drafts_nothing_and_greedy_output_is_unchanged(json_runs):
    plain, spec = json_runs["none"], json_runs["ngram"]
    s = plain["spec"]
    assert (s["num_drafts"], s["drafted"], s["accepted"]) == (0, 0, 0)
    assert s["target_forwards"] == plain["completion_tokens"] == MAX_TOKENS  # 1 prefill + 15 decodes
    assert plain["token_ids"] == spec["token_ids"] and plain["text"] == spec["text"]


def test_streaming_writes_the_text_to_stdout_and_a_summary_to_stderr(json_runs):
    res = verispec(*GENERATE, "--spec", "ngram")
    assert res.returncode == 0, res.stderr
    assert res.stdout == json_runs["ngram"]["text"] + "\n"
    assert f"[{MAX_TOKENS} tokens, length" in res.stderr and "Traceback" not in res.stderr


# --- bad input ---------------------------------------------------------------------------------



def bad_model_file(kind: str, tmp_path: Path) -> str:
    if kind == "missing":
        return str(tmp_path / "no-such-dir" / "model.gguf")
    if kind == "gpt2":
        return str(write_header_only_gguf(tmp_path / "gpt2.gguf", "gpt2"))
    path = tmp_path / "truncated.gguf"  # the magic and a version, then nothing
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    return str(path)


BAD_INPUTS = {
    # name: (extra generate arguments, words the one-line error must contain)
    "missing-model-file": (["--model", "@missing"], ["no such file"]),
    "unsupported-architecture": (["--model", "@gpt2"], ["unsupported", "gpt2"]),
    "truncated-model-file": (["--model", "@truncated"], ["truncated"]),
    "prompt-longer-than-context": (["--max-model-len", "64", "--prompt", "word " * 200],
                                   ["prompt is", "context is 64"]),
    "max-tokens-past-context": (["--max-model-len", "64", "--max-tokens", "100"], ["max_tokens", "context"]),
    "negative-temperature": (["--temperature", "-0.5"], ["temperature", ">= 0"]),
    "top-p-zero": (["--top-p", "0"], ["top_p", "(0, 1]"]),
    "top-p-above-one": (["--top-p", "1.5"], ["top_p", "(0, 1]"]),
    "max-tokens-zero": (["--max-tokens", "0"], ["max_tokens", "> 0"]),
    "config-not-yaml": (["--config", "@yaml"], ["not valid YAML"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_on_stderr_and_a_nonzero_exit(case, tmp_path):
    extra, words = BAD_INPUTS[case]
    args = ["generate", "--prompt", "Hello", "--kv-tokens", "2048"]
    for a in extra:
        if a == "@yaml":
            (tmp_path / "broken.yaml").write_text("spec: [1, 2\n")
            a = str(tmp_path / "broken.yaml")
        elif a.startswith("@"):
            a = bad_model_file(a[1:], tmp_path)
        args.append(a)
    # A private weight cache: a bad GGUF must not leave anything in the user's.
    res = verispec(*args, env={"VERISPEC_CACHE": str(tmp_path / "cache")} if "--model" in extra else None)
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in res.stderr and len(err.splitlines()) == 1, err
    assert err.startswith("verispec: error: ")
    for w in words:
        assert w in err, (w, err)
    assert res.stdout == ""


# --- other commands ----------------------------------------------------------------------------

def test_check_pair_of_the_default_model_with_itself_is_compatible():
    res = verispec("check-pair", "--target", MODEL, "--draft", MODEL)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("compatible:") and "identical tokenizers" in res.stdout


def test_models_list_shows_the_default_model_as_available():
    res = verispec("models", "list")
    assert res.returncode == 0, res.stderr
    line = next(line for line in res.stdout.splitlines() if line.startswith(MODEL))
    assert "available" in line.split()


# --- vLLM's spellings: positional model, --speculative-config, --chat-template -----------------

@pytest.fixture
def parsed(monkeypatch):
    """main(ARGV) up to the command: returns the EngineConfig `generate`/`serve` would load
    (in process, nothing loaded or started)."""
    from verispec import cli
    from verispec.config import config_from_args
    seen = {}

    def capture(args):
        seen["config"] = config_from_args(args)
        return 0
    monkeypatch.setattr(cli, "cmd_generate", capture)
    monkeypatch.setattr(cli, "cmd_serve", capture)

    def run(*argv):
        assert cli.main(list(argv)) == 0
        return seen.pop("config")
    return run


def test_the_model_may_be_positional_as_in_vllm_serve(parsed):
    assert parsed("serve", "some-model").model == "some-model"
    assert parsed("serve", "some-model", "--model", "some-model").model == "some-model"
    assert parsed("serve", "--model", "other").model == "other"
    assert parsed("generate", "some-model", "--prompt", "x").model == "some-model"
    assert parsed("generate", "--prompt", "x").model == MODEL


def test_speculative_config_json_and_vllm_scheduler_flags_reach_the_config(parsed, tmp_path):
    cfg = parsed("serve", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}',
                 "--max-num-batched-tokens", "1024", "--max-num-seqs", "8")
    assert (cfg.spec.method, cfg.spec.num_spec_tokens, cfg.spec.ngram_max, cfg.spec.ngram_min) == ("ngram", 3, 5, 2)
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs) == (1024, 8)
    cfg = parsed("generate", "--prompt", "x", "--speculative-config", '{"model": "d", "num_speculative_tokens": 5}')
    assert (cfg.spec.method, cfg.draft_model, cfg.spec.num_spec_tokens) == ("draft", "d", 5)
    cfg = parsed("serve", "--speculative-config", '{"method": "eagle", "model": "/heads/h"}')
    assert (cfg.spec.method, cfg.draft_head, cfg.draft_model) == ("eagle", "/heads/h", None)
    cfg = parsed("serve", "--spec", "suffix", "--suffix-max-cached-requests", "0")
    assert (cfg.spec.method, cfg.spec.suffix_max_cached_requests) == ("suffix", 0)
    cfg = parsed("serve", "--speculative-config", '{"method": "eagle"}', "--draft-head", "/heads/h")
    assert (cfg.spec.method, cfg.draft_head) == ("eagle", "/heads/h")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert parsed("serve", "--chat-template", str(template)).chat_template == "{{ messages[0]['content'] }}"
    assert parsed("serve", "--chat-template", "{{ 'x' }}").to_dict()["chat_template"] == "{{ 'x' }}"


@pytest.mark.parametrize("argv, words", [
    (["serve", "a", "--model", "b"], ["given twice", "'a'", "'b'"]),
    (["serve", "--speculative-config", '{"method": "mtp"}'], ["'mtp'", "allowed methods"]),
    (["serve", "--speculative-config", '{"method": "ngram", "k": 3}'], ["['k']", "num_speculative_tokens"]),
    (["serve", "--speculative-config", "{nope"], ["not valid JSON"]),
    (["serve", "--speculative-config", '{"method": "eagle", "model": "/h"}', "--draft-head", "/g"], ["--draft-head"]),
    (["serve", "--speculative-config", "{}", "--num-spec-tokens", "3"], ["--num-spec-tokens"]),
    (["serve", "--spec", "suffix", "--suffix-max-cached-requests", "-2"], ["suffix_max_cached_requests", ">= 0"]),
    (["generate", "--prompt", "x", "--speculative-config", "{}", "--spec", "none"], ["--spec"]),
    (["generate", "--prompt", "x", "--chat-template", "missing.jinja"], ["missing.jinja", "no such file"]),
])
def test_bad_vllm_style_flags_are_one_line_errors(argv, words, capsys):
    from verispec import cli
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("verispec: error: "), err
    for w in words:
        assert w in err, (w, err)


def test_chat_template_reaches_the_engines_tokenizer():
    """The default template adds a system prompt; a bare one renders just the message."""
    res = verispec("generate", MODEL, "--prompt", "Hello", "--chat", "--max-tokens", "1", "--json",
                   "--kv-tokens", "2048", "--chat-template", "{{ messages[0]['content'] }}")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["prompt_tokens"] <= 2 and out["config"]["chat_template"] == "{{ messages[0]['content'] }}"
