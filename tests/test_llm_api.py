"""The offline Python API in vLLM's shape: LLM(model, speculative_config=...),
generate(prompts, sampling_params) -> outputs[i].outputs[0].text, chat(), the quickstart.

The option mapping is checked without loading weights (LLMEngine.from_config is replaced);
the rest runs the default model once (float32, one thread, a small KV pool).
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

import verispec
from verispec.config import EngineConfig, SpecConfig, spec_from_speculative_config
from verispec.engine import llm as llm_mod
from verispec.engine.llm import LLM
from verispec.outputs import CompletionOutput, LLMRequestOutput
from verispec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from fake_engine import FakeEngine  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8)


# --- speculative_config: vLLM's keys onto SpecConfig -----------------------------------------

def test_ngram_speculative_config_maps_vllms_keys():
    spec, named = spec_from_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 5, "prompt_lookup_min": 2})
    assert named == {}
    assert (spec.method, spec.num_spec_tokens, spec.ngram_max, spec.ngram_min) == ("ngram", 3, 5, 2)
    assert spec.adaptive is True  # verispec's default, unless asked
    assert spec_from_speculative_config('{"method": "ngram", "adaptive": false}')[0].adaptive is False


def test_a_draft_model_is_implied_by_model_or_named_draft_model():
    for cfg in ({"model": "my-draft", "num_speculative_tokens": 5},
                {"method": "draft_model", "model": "my-draft", "num_speculative_tokens": 5}):
        spec, named = spec_from_speculative_config(cfg)
        assert (spec.method, spec.num_spec_tokens, named) == ("draft", 5, {"draft_model": "my-draft"})


def test_eagle_takes_verispecs_head_folder_as_its_model_or_the_registered_head():
    spec, named = spec_from_speculative_config({"method": "eagle", "model": "/heads/h", "num_speculative_tokens": 3})
    assert (spec.method, spec.num_spec_tokens, named) == ("eagle", 3, {"draft_head": "/heads/h"})
    assert spec_from_speculative_config({"method": "eagle"}) == (SpecConfig(method="eagle"), {})


def test_lookup_bounds_apply_to_ngram_and_auto_only():
    spec = spec_from_speculative_config({"method": "auto", "prompt_lookup_max": 5, "prompt_lookup_min": 2})[0]
    assert (spec.method, spec.ngram_min, spec.ngram_max) == ("auto", 2, 5)
    with pytest.raises(ValueError, match="need method 'ngram' or 'auto'"):
        spec_from_speculative_config({"method": "suffix", "prompt_lookup_max": 5})


def test_suffix_takes_vllms_suffix_decoding_keys():
    spec = spec_from_speculative_config({"method": "suffix", "suffix_decoding_max_cached_requests": 0,
                                         "suffix_decoding_max_spec_factor": 1.0,
                                         "suffix_decoding_min_token_prob": 0.3})[0]
    assert (spec.method, spec.suffix_max_cached_requests, spec.suffix_max_spec_factor,
            spec.suffix_min_token_prob) == ("suffix", 0, 1.0, 0.3)
    assert spec_from_speculative_config({"method": "suffix"})[0] == SpecConfig(method="suffix")


def test_a_lone_lookup_bound_keeps_the_other_default_clamped():
    assert spec_from_speculative_config({"method": "ngram", "prompt_lookup_max": 6})[0].ngram_min == 1
    spec = spec_from_speculative_config({"method": "ngram", "prompt_lookup_min": 6})[0]
    assert (spec.ngram_min, spec.ngram_max) == (6, 6)


@pytest.mark.parametrize("cfg, words", [
    ({"method": "eagle3", "model": "x"}, ["'eagle3'", "ngram", "draft_model", "eagle"]),
    ({"method": "medusa"}, ["'medusa'", "allowed methods"]),
    ({"method": "ngram", "lookahead": 3}, ["lookahead", "num_speculative_tokens"]),
    ({"method": "ngram", "model": "x"}, ["needs method 'draft_model' or 'eagle'"]),
    ({"method": "ngram", "num_speculative_tokens": "4"}, ["num_speculative_tokens", "integer"]),
    ({"method": "ngram", "num_speculative_tokens": 40}, ["num_spec_tokens"]),
    ({"model": "x", "draft_tensor_parallel_size": 2}, ["draft_tensor_parallel_size"]),
    ({"method": "ngram", "suffix_decoding_max_cached_requests": 2}, ["needs method 'suffix'"]),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, ["suffix_max_cached_requests", ">= 0"]),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": 1.5}, ["suffix_decoding_max_cached_requests",
                                                                         "integer"]),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, ["suffix_max_spec_factor", "> 0"]),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, ["suffix_min_token_prob", "[0, 1]"]),
    ({"method": "auto", "suffix_decoding_min_token_prob": 0.2}, ["needs method 'suffix'"]),
    ("{not json", ["not valid JSON"]),
])
def test_unsupported_speculative_configs_name_the_key_and_the_allowed_values(cfg, words):
    with pytest.raises(ValueError) as err:
        spec_from_speculative_config(cfg)
    for word in words:
        assert word in str(err.value)


# --- LLM(...) options onto one EngineConfig (no weights loaded) -------------------------------

@pytest.fixture
def captured(monkeypatch):
    """LLM(...) builds its EngineConfig and stops there: returns the config it would load."""
    seen = {}

    class Stop(Exception):
        pass

    def from_config(config):
        seen["config"] = config
        raise Stop

    monkeypatch.setattr(llm_mod.LLMEngine, "from_config", staticmethod(from_config))

    def build(*args, **kwargs) -> EngineConfig:
        with pytest.raises(Stop):
            LLM(*args, **kwargs)
        return seen["config"]
    return build


def test_vllm_options_map_onto_the_engine_config(captured):
    cfg = captured("some-model", speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                   dtype="float32", seed=7, max_model_len=512, max_num_seqs=3, max_num_batched_tokens=256,
                   enable_prefix_caching=False, block_size=8, num_kv_tokens=1024, gpu_memory_utilization=0.9,
                   tensor_parallel_size=1, trust_remote_code=True, enforce_eager=True, threads=1)
    assert (cfg.model, cfg.dtype, cfg.seed, cfg.threads) == ("some-model", "float32", 7, 1)
    assert (cfg.spec.method, cfg.spec.num_spec_tokens) == ("ngram", 2)
    assert (cfg.scheduler.max_model_len, cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (512, 3, 256)
    assert (cfg.cache.prefix_cache, cfg.cache.block_size, cfg.cache.num_kv_tokens) == (False, 8, 1024)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_defaults_and_verispecs_own_spellings_still_work(captured):
    cfg = captured()
    default = EngineConfig()
    assert (cfg.model, cfg.dtype, cfg.spec, cfg.seed) == (default.model, "bfloat16", default.spec, default.seed)
    cfg = captured(draft="d", dtype="bfloat16")
    assert (cfg.draft_model, cfg.spec.method) == ("d", "draft")
    assert captured(spec="none").spec.method == "none"
    assert captured(spec=SpecConfig(method="ngram", num_spec_tokens=2)).spec.num_spec_tokens == 2
    assert captured(speculative_config={"model": "d"}).draft_model == "d"
    cfg = captured(speculative_config={"method": "eagle", "model": "/heads/h"})
    assert (cfg.spec.method, cfg.draft_head, cfg.draft_model) == ("eagle", "/heads/h", None)
    base = EngineConfig(seed=3, spec=SpecConfig(num_spec_tokens=6))
    cfg = captured(config=base, max_num_seqs=2)
    assert (cfg.seed, cfg.spec.num_spec_tokens, cfg.scheduler.max_num_seqs) == (3, 6, 2)


def test_a_chat_template_is_stored_as_its_text(captured, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert captured(chat_template=str(path)).chat_template == "{{ messages[0]['content'] }}"
    assert captured(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}").chat_template.startswith("{%")


@pytest.mark.parametrize("kwargs, words", [
    ({"pipeline_parallel_size": 2}, ["pipeline_parallel_size=2", "not supported", "tensor_parallel_size="]),
    ({"quantization": "awq"}, ["quantization", "weight_format"]),
    ({"dtype": "float16"}, ["float16", "bfloat16"]),
    ({"no_such_option": 1}, ["no_such_option", "weight_format"]),
    ({"tokenizer": "other/tokenizer"}, ["tokenizer"]),
    ({"speculative_config": {"method": "ngram"}, "spec": "ngram"}, ["not both"]),
    ({"speculative_config": {"method": "eagle3"}}, ["eagle3"]),
    ({"chat_template": "no/such/template.jinja"}, ["no such file"]),
])
def test_options_verispec_cannot_honour_are_a_clear_error(captured, kwargs, words):
    with pytest.raises(ValueError) as err:
        LLM(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_the_package_root_exports_the_vllm_names_without_importing_torch():
    assert verispec.SamplingParams is SamplingParams and verispec.LLM is LLM
    code = "import sys, verispec; from verispec import SamplingParams; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


# --- on the default model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_tokens=2048, threads=1,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})


def test_generate_returns_vllms_request_outputs_in_order(llm):
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,"]
    outputs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outputs] == prompts
    for o in outputs:
        assert isinstance(o, LLMRequestOutput) and o.finished and o.error is None
        assert len(o.outputs) == 1 and isinstance(o.outputs[0], CompletionOutput)
        c = o.outputs[0]
        assert c.index == 0 and c.text and len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.cumulative_logprob is None and c.logprobs is None and c.stop_reason is None
        assert o.prompt_token_ids == llm.get_tokenizer().encode(o.prompt)
        # verispec's counters and the earlier shortcuts stay reachable
        assert o.spec.target_forwards >= 1 and o.text == c.text and o.token_ids == c.token_ids
    assert len({o.request_id for o in outputs}) == 2


def test_token_prompts_string_prompts_and_per_prompt_params_agree(llm):
    text = "def fibonacci(n):"
    ids = llm.tokenizer.encode(text)
    by_text = llm.generate(text, GREEDY, use_tqdm=False)[0]
    by_dict, by_list, by_textprompt = llm.generate(
        [{"prompt_token_ids": ids}, ids, {"prompt": text}],
        [GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=4)])
    assert by_dict.prompt is None and by_dict.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_dict.outputs[0].token_ids == by_list.outputs[0].token_ids
    assert by_textprompt.outputs[0].token_ids == by_text.outputs[0].token_ids[:4]
    assert llm.generate([], GREEDY) == []


def test_the_earlier_params_keyword_still_works(llm):
    out = llm.generate(["Hi"], params=SamplingParams(temperature=0, max_tokens=2))[0]
    assert len(out.token_ids) == 2
    with pytest.raises(ValueError, match="not both"):
        llm.generate(["Hi"], GREEDY, params=GREEDY)


def test_stop_reason_names_the_stop_string(llm):
    first = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    stop = first.strip()[:2]  # a stop string the greedy completion is sure to produce
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and stop not in out.text


def test_stop_reason_names_the_stop_token_id(llm):
    first = llm.generate("1, 2, 3, 4, 5,", GREEDY)[0].outputs[0].token_ids[1]
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=8,
                                                        stop_token_ids=[first]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == first and out.token_ids[-1] == first


@pytest.mark.parametrize("prompts, params, words", [
    ([1.5], None, ["prompt 0"]),
    ([{"prompt_token_ids": []}], None, ["non-empty"]),
    ([{"prompt": "a", "multi_modal_data": {}}], None, ["multi_modal_data"]),
    (["a", "b"], [GREEDY], ["1 SamplingParams for 2 prompts"]),
    (["a"], object(), ["verispec.SamplingParams"]),
])
def test_bad_prompts_and_params_are_a_clear_error(llm, prompts, params, words):
    with pytest.raises(ValueError) as err:
        llm.generate(prompts, params)
    for word in words:
        assert word in str(err.value)


def test_prompt_logprobs_are_refused_and_logprobs_returned(llm):
    @dataclass(frozen=True)
    class WithPromptLogprobs(SamplingParams):
        prompt_logprobs: int | None = 1

    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("Hi", WithPromptLogprobs(max_tokens=2))
    c = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0, logprobs=2))[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) and all(t in d for t, d in zip(c.token_ids, c.logprobs))
    assert all(len(d) in (2, 3) for d in c.logprobs)
    assert abs(c.cumulative_logprob - sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))) < 1e-9
    assert llm.generate("Hi", SamplingParams(n=1, max_tokens=2))[0].outputs[0].token_ids


def test_n_seeded_completions_equal_independent_runs_seeded_s_plus_i(llm):
    """SamplingParams.n = 3 with seed 5 gives, per prompt, the completions of three runs seeded
    5, 6 and 7 (verispec.request.choice_params, the server's rule), as outputs[0..2]."""
    prompts = ["Once upon a time", "My favourite food is"]
    sampled = dict(temperature=0.9, top_p=0.95, max_tokens=6, ignore_eos=True)
    bars = []

    def bar(total, **kw):
        bars.append(types.SimpleNamespace(total=total, n=0, close=lambda: None))
        bars[-1].update = lambda k: setattr(bars[-1], "n", bars[-1].n + k)
        return bars[-1]
    outs = llm.generate(prompts, SamplingParams(n=3, seed=5, **sampled), use_tqdm=bar)
    singles = [[llm.generate(p, SamplingParams(seed=5 + i, **sampled))[0].outputs[0].token_ids
                for i in range(3)] for p in prompts]
    assert [o.prompt for o in outs] == prompts and (bars[0].total, bars[0].n) == (2, 2)  # prompts
    for out, expected in zip(outs, singles):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == expected
        assert len({tuple(t) for t in expected}) > 1  # different seeds, different samples
        assert out.text == out.outputs[0].text and out.error is None and out.finished
        assert sum(out.spec.drafted_per_position) == out.spec.num_draft_tokens
    greedy = llm.generate("Hi", SamplingParams(n=2, best_of=2, temperature=0, max_tokens=4))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        llm.generate("Hi", SamplingParams(n=0, max_tokens=2))
    with pytest.raises(ValueError, match="best_of must equal n"):
        llm.generate("Hi", SamplingParams(n=2, best_of=3, max_tokens=2))


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_without_sampling_params_generate_and_chat_use_the_generation_config(monkeypatch, mode):
    """vLLM's LLM.get_default_sampling_params: the model's generation_config.json values
    ("auto"), or neutral ones ("vllm"); generate and chat use them when given no params."""
    engine = FakeEngine()
    engine.config = EngineConfig()
    engine.tokenizer.meta = types.SimpleNamespace(sampling_defaults={
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05})
    seen = []
    add = engine.add_request
    engine.add_request = lambda rid, ids, params, spec=None: (seen.append(params), add(rid, ids, params, spec))
    monkeypatch.setattr(llm_mod.LLMEngine, "from_config", staticmethod(lambda config: engine))
    llm = LLM(generation_config=mode)
    expected = (SamplingParams(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05)
                if mode == "auto" else SamplingParams())
    assert llm.get_default_sampling_params() == expected
    llm.generate("hi", use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert seen == [expected, expected]
    with pytest.raises(ValueError, match="generation_config 'hf'"):
        LLM(generation_config="hf")


def test_chat_takes_one_conversation_or_many(llm):
    conv = [{"role": "user", "content": "Say hello."}]
    one = llm.chat(conv, GREEDY)
    many = llm.chat([conv, [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]], GREEDY)
    assert len(one) == 1 and len(many) == 2
    assert one[0].prompt == llm.tokenizer.apply_chat_template(conv)
    assert one[0].outputs[0].token_ids == many[0].outputs[0].token_ids == many[1].outputs[0].token_ids
    assert one[0].prompt_token_ids == llm.tokenizer.encode_chat(conv)
    no_gen = llm.chat(conv, GREEDY, add_generation_prompt=False)[0]
    assert len(no_gen.prompt_token_ids) < len(one[0].prompt_token_ids)


def test_chat_template_overrides_the_models_for_one_call(llm):
    conv = [{"role": "user", "content": "abc"}]
    out = llm.chat(conv, GREEDY, chat_template="<<{{ messages[0]['content'] }}>>")[0]
    assert out.prompt == "<<abc>>" and out.prompt_token_ids == llm.tokenizer.encode("<<abc>>", add_special_tokens=False)
    assert llm.chat(conv, GREEDY)[0].prompt != "<<abc>>"  # the model's own is untouched
    with pytest.raises(ValueError, match="text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)


def test_the_progress_bar_counts_finished_prompts(llm):
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.closed, self.kw = total, 0, False, kw
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=Bar)
    assert len(bars) == 1 and (bars[0].total, bars[0].n, bars[0].closed) == (3, 3, True)
    assert bars[0].kw["desc"] == "Processed prompts"


# --- the quickstart, unchanged but for the import --------------------------------------------

def test_the_vllm_quickstart_example_runs_and_prints_four_generations():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MAX_TOKENS": "6"}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_quickstart.py")], capture_output=True,
                         text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("Prompt: ")]
    assert len(lines) == 4 and all("Generated text: " in line for line in lines), res.stdout
    assert "'The capital of France is'" in res.stdout
