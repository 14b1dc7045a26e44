"""Drop-in compatibility with OpenAI and vLLM clients, over real HTTP on the fake engine:

- /metrics under vLLM's names (`vllm:*`), types and label sets, values consistent with a run
  (token counters equal the usage sums, each latency histogram counted once per request);
- POST /tokenize and /detokenize (vLLM's shapes) round-trip; GET /version;
- usage.prompt_tokens_details.cached_tokens from the engine's prefix cache (0 cold, whole
  cached blocks when a prompt shares a long prefix), in responses and streamed usage;
- system_fingerprint on responses and chunks, stable across requests.
"""
from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_engine import BOS, ByteTokenizer  # noqa: E402
from test_server_http import API_KEY, _fake_backend, clean_server  # noqa: E402

import verispec  # noqa: E402
from verispec.server.metrics import ServerMetrics  # noqa: E402

FAKE = _fake_backend()
MODEL = FAKE.model
BLOCK = 16          # the fake engine's block size: prefix hits count whole blocks
AUTH = {"Authorization": f"Bearer {API_KEY}"}

# name (as the family is parsed: counters without _total) -> (type, label names)
VLLM_METRICS = {
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name"}),
    "vllm:request_queue_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_inference_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_prefill_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_decode_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_time_per_output_token_seconds": ("histogram", {"model_name"}),
    "vllm:request_prompt_tokens": ("histogram", {"model_name"}),
    "vllm:request_generation_tokens": ("histogram", {"model_name"}),
    "vllm:num_requests_running": ("gauge", {"model_name"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name"}),
    "vllm:num_preemptions": ("counter", {"model_name"}),
    "vllm:prompt_tokens": ("counter", {"model_name"}),
    "vllm:generation_tokens": ("counter", {"model_name"}),
    "vllm:request_success": ("counter", {"model_name", "finished_reason"}),
    "vllm:spec_decode_num_drafts": ("counter", {"model_name", "method"}),
    "vllm:spec_decode_num_draft_tokens": ("counter", {"model_name", "method"}),
    "vllm:spec_decode_num_accepted_tokens": ("counter", {"model_name", "method"}),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", {"model_name", "method", "position"}),
}
VERISPEC_ONLY = {
    "verispec:request_aborted": "counter", "verispec:request_error": "counter",
    "verispec:request_rejected": "counter", "verispec:engine_step_errors": "counter",
    "verispec:kv_blocks_used": "gauge", "verispec:kv_blocks_total": "gauge",
    "verispec:prefix_cache_hit_rate": "gauge",
}
LATENCY_HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_inference_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens")


@pytest.fixture(scope="module")
def server():
    with clean_server(FAKE) as srv:
        yield srv


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, sample: str, **labels) -> float:
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    return sum(s.value for s in fams[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def unique(n: int = 120) -> str:
    """A prompt no earlier request shares a block with."""
    text = f"{uuid.uuid4().hex} " * 8
    return text[:n]


# ---------------------------------------------------------------------------- /metrics
def test_metrics_have_vllm_names_types_labels_and_consistent_values(server):
    c = client(server)
    server.wait_idle()
    before = families(server)
    usages = []
    for i in range(5):
        body = dict(model=MODEL, prompt=unique(30 + 10 * i), max_tokens=6 + i, temperature=0,
                    extra_body={"ignore_eos": True})
        if i % 2:
            chunks = list(c.completions.create(**body, stream=True, stream_options={"include_usage": True}))
            usages.append(chunks[-1].usage)
        else:
            usages.append(c.completions.create(**body).usage)
    server.wait_idle()
    after = families(server)

    for name, (kind, labels) in VLLM_METRICS.items():
        assert name in after, f"missing {name}"
        assert after[name].type == kind, (name, after[name].type)
        for s in after[name].samples:
            keys = set(s.labels) - {"le"}
            assert keys == labels, (s.name, s.labels)
            assert s.labels["model_name"] == MODEL
    for name, kind in VERISPEC_ONLY.items():
        assert name in after and after[name].type == kind, name
    assert not any(n.startswith("verispec:") and n.removeprefix("verispec:") in
                   {m.removeprefix("vllm:") for m in VLLM_METRICS} for n in after), \
        "a vLLM-named metric is also exported under verispec:"

    def delta(sample: str, **labels) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)
    n = len(usages)
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == completion
    assert delta("vllm:request_success_total", finished_reason="length") == n
    for h in LATENCY_HISTOGRAMS:
        assert delta(f"vllm:{h}_count") == n, h
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == completion
    assert delta("vllm:request_time_per_output_token_seconds_count") == n  # all have >= 2 tokens
    # one inter-token observation per later engine output: at least one per request, at
    # most one per token after the first (speculation may bring several tokens at once)
    assert n <= delta("vllm:inter_token_latency_seconds_count") <= completion - n
    # time splits: queue + inference = e2e and prefill + decode = inference, per request
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    parts = delta("vllm:request_queue_time_seconds_sum") + delta("vllm:request_inference_time_seconds_sum")
    assert parts == pytest.approx(e2e, abs=0.05)
    inference = delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum")
    assert inference == pytest.approx(delta("vllm:request_inference_time_seconds_sum"), abs=0.05)
    assert delta("vllm:prefix_cache_queries_total") == prompt
    assert value(after, "vllm:num_preemptions_total") == 0
    assert value(after, "vllm:num_requests_running") == 0
    # vLLM's bucket layout: 1-2-5 token buckets up to the context
    les = [s.labels["le"] for s in after["vllm:request_prompt_tokens"].samples
           if s.name.endswith("_bucket")]
    assert les[:4] == ["1.0", "2.0", "5.0", "10.0"] and les[-2:] == ["500.0", "+Inf"]


def test_verispec_prefix_keeps_the_old_names():
    m = ServerMetrics("m", stats_source=lambda: None, prefix="verispec", max_model_len=64)
    names = {f.name for f in text_string_to_metric_families(m.render()[0].decode())}
    assert "verispec:time_per_output_token_seconds" in names
    assert "verispec:spec_decode_num_drafts" in names and "verispec:num_preemptions" in names
    assert not any(n.startswith("vllm:") for n in names)
    with pytest.raises(ValueError):
        ServerMetrics("m", prefix="other")


# ---------------------------------------------------------------------------- extra endpoints
def test_tokenize_detokenize_round_trip(server):
    text = "hello, world: ünïcode"
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"tokens": ByteTokenizer().encode(text), "count": len(text.encode()), "max_model_len": 512}
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}, headers=AUTH)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    # the count is what a completion of the same prompt is billed
    usage = client(server).completions.create(model=MODEL, prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]


def test_tokenize_messages_matches_chat_billing(server):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}, headers=AUTH).json()
    tok = ByteTokenizer()
    assert r["tokens"] == tok.encode_chat(msgs) and r["tokens"][0] == BOS
    usage = client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage
    assert usage.prompt_tokens == r["count"]
    bare = httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "add_generation_prompt": False},
                      headers=AUTH).json()
    assert bare["tokens"] == tok.encode_chat(msgs, add_generation_prompt=False)
    assert bare["count"] < r["count"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "x" * 600}, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [99999]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenizer_routes_validate_with_openai_error_bodies(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(param), err


def test_tokenizer_routes_need_the_api_key_version_does_not(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [104]})):
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/version")
    assert r.status_code == 200 and r.json() == {"version": verispec.__version__}


# ---------------------------------------------------------------------------- usage details
def test_cached_tokens_count_the_shared_prefix(server):
    c = client(server)
    prefix = unique(100)
    cold = c.completions.create(model=MODEL, prompt=prefix + " first", max_tokens=3)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = c.completions.create(model=MODEL, prompt=prefix + " second", max_tokens=3)
    assert warm.usage.prompt_tokens_details.cached_tokens == 100 // BLOCK * BLOCK
    # streamed usage (final and continuous) carries it too
    chunks = list(c.completions.create(model=MODEL, prompt=prefix + " third", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 100 // BLOCK * BLOCK
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={
        "prompt": prefix + " fourth", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert all(e["usage"]["prompt_tokens_details"]["cached_tokens"] == 96 for e in events)
    # chat: a second identical conversation
    msgs = [{"role": "user", "content": unique(80)}]
    first = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    again = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // BLOCK * BLOCK > 0


def test_system_fingerprint_is_stable_and_on_every_chunk(server):
    c = client(server)
    a = c.completions.create(model=MODEL, prompt="fingerprint", max_tokens=2)
    b = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fp"}], max_tokens=2)
    assert a.system_fingerprint and a.system_fingerprint.startswith("fp_") and len(a.system_fingerprint) == 13
    assert b.system_fingerprint == a.system_fingerprint
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fp"}],
                                            max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert chunks and all(ch.system_fingerprint == a.system_fingerprint for ch in chunks)


# ---------------------------------------------------------------------------- batched prompts, echo
def _texts_by_index(chunks: list, count: int) -> tuple[list[str], list[str]]:
    """(whole text, first chunk's text) per choice index of a completions stream."""
    texts, firsts = [""] * count, [None] * count
    for ch in chunks:
        for choice in ch.choices:
            if firsts[choice.index] is None:
                firsts[choice.index] = choice.text
            texts[choice.index] += choice.text
    return texts, firsts


def test_a_batch_of_prompts_gets_n_choices_each_in_openais_order(server):
    """prompt = [p0, p1] with n = 2: choice p * n + j equals choice j of a request for p alone
    (same seed), for text and token-id prompts, streamed or not; usage sums the prompts."""
    c = client(server)
    prompts = [unique(40), unique(50)]  # the fake samples from (seed, length): lengths differ
    req = dict(model=MODEL, max_tokens=5, temperature=0.8, seed=11, n=2, extra_body={"ignore_eos": True})
    singles = [c.completions.create(prompt=p, **req) for p in prompts]
    expected = [ch.text for s in singles for ch in s.choices]
    assert len(set(expected)) == 4  # seeds s, s + 1 and two prompts: four different samples
    r = c.completions.create(prompt=prompts, **req)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and [ch.text for ch in r.choices] == expected
    assert r.usage.prompt_tokens == 90 and r.usage.completion_tokens == 20
    assert r.usage.total_tokens == 110 and r.id.startswith("cmpl-")
    by_ids = c.completions.create(prompt=[ByteTokenizer().encode(p) for p in prompts], **req)
    assert [ch.text for ch in by_ids.choices] == expected
    chunks = list(c.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **req))
    texts, _ = _texts_by_index(chunks, 4)
    assert texts == expected and len({ch.id for ch in chunks}) == 1
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (90, 20)
    assert sum(ch.choices[0].finish_reason is not None for ch in chunks if ch.choices) == 4


def test_echo_starts_each_choice_with_its_prompt_text(server):
    c = client(server)
    req = dict(model=MODEL, max_tokens=4, temperature=0)
    prompts = ["echo this", "and that"]
    plain = c.completions.create(prompt=prompts, **req)
    r = c.completions.create(prompt=prompts, echo=True, **req)
    assert [ch.text for ch in r.choices] == [p + ch.text for p, ch in zip(prompts, plain.choices)]
    assert r.usage.completion_tokens == plain.usage.completion_tokens  # the echo is not generated
    ids = c.completions.create(prompt=ByteTokenizer().encode("hi there"), echo=True, **req)
    assert ids.choices[0].text.startswith("hi there") and len(ids.choices[0].text) > len("hi there")
    chunks = list(c.completions.create(prompt=prompts, echo=True, n=2, stream=True, **req))
    texts, firsts = _texts_by_index(chunks, 4)
    assert firsts == [prompts[0], prompts[0], prompts[1], prompts[1]]  # the first chunk is the prompt
    assert texts == [r.choices[0].text] * 2 + [r.choices[1].text] * 2


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": []}, "prompt", "non-empty list"),
    ({"prompt": ["a", ""]}, "prompt", "prompt 1 of the batch is empty"),
    ({"prompt": [[104], []]}, "prompt", "prompt 1 of the batch is empty"),
    ({"prompt": ["a", [104, 1.5]]}, "prompt", "prompt 1 of the batch must be"),
    ({"prompt": ["a"] * 17}, "prompt", "at most 16"),
    ({"prompt": ["a"] * 3, "n": 6}, "n", "18 choices"),
    ({"prompt": ["a", "b" * 600]}, "prompt", "prompt 1 of the batch"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo", "cannot be combined with logprobs"),
])
def test_bad_batches_and_echo_with_logprobs_are_400s_naming_the_field(server, body, param, words):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, max_tokens=2, **body)
    assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body
