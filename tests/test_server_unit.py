"""Server unit tests, in process, against the fake engine (tests/fake_engine.py).

Protocol validation (every bad input -> 4xx naming the field, never a 5xx), API key and
body limit, metric names and their agreement with per-response stats, and the AsyncEngine
contract: abort on cancel/disconnect, 429 on a full queue, step failures, shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(__file__))
from fake_engine import FakeEngine, SpecOverride  # noqa: E402

from verispec.sampling import SamplingParams  # noqa: E402
from verispec.server.app import ServerConfig, create_app  # noqa: E402
from verispec.server.async_engine import (AsyncEngine, EngineClosed, QueueFull,  # noqa: E402
                                          RequestFailed)

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine | None = None, **config):
    """An app on `engine` with its lifespan running, and an httpx client talking ASGI to it."""
    engine = engine or FakeEngine()
    app = create_app(engine, ServerConfig(**config))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            yield app, client, engine


async def wait_idle(client: httpx.AsyncClient) -> dict:
    """Poll /health until no request is in flight; returns the last health body."""
    for _ in range(500):
        health = (await client.get("/health")).json()
        if health["in_flight"] == 0 and health["num_running"] == 0 and health["num_waiting"] == 0:
            return health
        await asyncio.sleep(0.01)
    raise AssertionError(f"server never went idle: {health}")


# ---------------------------------------------------------------------------- validation
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    # (path, body, status, param)
    (COMP, b"{not json", 400, None),
    (COMP, b"[1, 2]", 400, None),
    (COMP, b'{"prompt": "x", "temperature": NaN}', 400, None),
    (COMP, b'{"prompt": "x", "top_k": 99999999999999999999999}', 400, "top_k"),
    (COMP, b'{"prompt": "x", "max_tokens": 99999999999999999999999}', 400, "max_tokens"),
    (COMP, b'{"prompt": "x", "seed": 99999999999999999999999}', 400, "seed"),
    (COMP, "\u00ff".encode("latin-1"), 400, None),
    (COMP, {"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    (COMP, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    (COMP, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (COMP, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (COMP, {"prompt": "x", "frequency_penalty": -2.1}, 400, "frequency_penalty"),
    (COMP, {"prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    (COMP, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMP, {"prompt": "x", "logit_bias": {"3": 101}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"-3": 1}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"3": True}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    (COMP, {"prompt": "x", "min_tokens": 5, "max_tokens": 3}, 400, "min_tokens"),
    (COMP, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (COMP, {"prompt": "x", "stop_token_ids": ["1"]}, 400, "stop_token_ids[0]"),
    (COMP, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    (COMP, {"prompt": "x" * 600}, 400, "prompt"),
    (COMP, {"prompt": ""}, 400, "prompt"),
    (COMP, {"prompt": [1, 2, 999]}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": ["a", ""]}, 400, "prompt"),
    (COMP, {"prompt": [[1, 2], []]}, 400, "prompt"),
    (COMP, {"prompt": ["a", 5]}, 400, "prompt"),
    (COMP, {"prompt": ["a", "x" * 600]}, 400, "prompt"),
    (COMP, {"prompt": [[1, 2], [3, 999]]}, 400, "prompt"),
    (COMP, {"prompt": ["a", "b" * 500], "max_tokens": 100}, 400, "max_tokens"),
    (COMP, {"prompt": ["a"] * 17}, 400, "prompt"),
    (COMP, {"prompt": ["a"] * 4, "n": 5}, 400, "n"),
    (COMP, {"prompt": 5}, 400, "prompt"),
    (COMP, {}, 400, "prompt"),
    (COMP, {"prompt": "x", "model": "gpt-4"}, 400, "model"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n"),
    (COMP, {"prompt": "x", "n": 17}, 400, "n"),
    (COMP, {"prompt": "x", "n": "2"}, 400, "n"),
    (COMP, {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
    (COMP, {"prompt": "x", "best_of": 2}, 400, "best_of"),
    (COMP, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (COMP, {"prompt": "x", "seed": 1.5}, 400, "seed"),
    (COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (COMP, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    (COMP, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": False, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": 2}, 400, "logprobs"),
    (COMP, {"prompt": "x", "echo": True, "logprobs": 0}, 400, "echo"),
    (COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMP, {"prompt": "x", "speculative": {"method": "medusa"}}, 400, "speculative.method"),
    (COMP, {"prompt": "x", "speculative": {"num_tokens": -1}}, 400, "speculative.num_tokens"),
    (COMP, {"prompt": "x", "speculative": {"num_tokens": 99}}, 400, "speculative.num_tokens"),
    (COMP, {"prompt": "x", "speculative": {"method": "draft"}}, 400, "speculative.method"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10_000}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "n": -1}, 400, "n"),
    (CHAT, {"messages": MSG, "presence_penalty": -3}, 400, "presence_penalty"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    # unknown fields: 400 naming them, at every level, even when null (--allow-unknown-fields)
    (COMP, {"prompt": "x", "repetiton_penalty": 1.2}, 400, "repetiton_penalty"),
    (COMP, {"prompt": "x", "foo": None}, 400, "foo"),
    (CHAT, {"messages": MSG, "reasoning_effort": "high"}, 400, "reasoning_effort"),
    (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "foo": 1}]}, 400, "messages[0].foo"),
    (CHAT, {"messages": MSG, "stream": True, "stream_options": {"include_usage": True, "bar": 1}},
     400, "stream_options.bar"),
    (COMP, {"prompt": "x", "speculative": {"method": "ngram", "k": 3}}, 400, "speculative.k"),
    (CHAT, {"messages": MSG, "store": True}, 400, "store"),
    # nesting past any recursion limit, and just past MAX_JSON_DEPTH
    (COMP, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    (CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    (COMP, b'{"prompt": "x", "user": ' + b"[" * 64 + b"]" * 64 + b"}", 400, "user"),
    # a lone surrogate decodes from JSON but is not Unicode text: every route, every field
    (COMP, b'{"prompt": "ab\\ud800cd"}', 400, "prompt"),
    (COMP, b'{"prompt": "x", "stop": ["\\udfff"]}', 400, "stop[0]"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400, "messages[0].content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     400, "messages[0].content[0].text"),
]


def test_every_bad_input_is_a_4xx_naming_the_field_and_the_server_keeps_serving():
    async def scenario():
        async with serving() as (_, client, _engine):
            for path, body, status, param in BAD_REQUESTS:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await client.post(path, content=content, headers={"content-type": "application/json"})
                assert r.status_code == status, (body, r.text)
                err = r.json()["error"]
                assert err["param"] == param, (body, err)
                assert err["type"] == "invalid_request_error" and err["message"], err
            ok = await client.post(COMP, json={"prompt": "still alive", "max_tokens": 3})
            assert ok.status_code == 200
            health = await wait_idle(client)
            assert health["kv_blocks_used"] == 0 and health["integrity"] == "ok"
    run(scenario())


UNKNOWN_FIELDS = [
    (COMP, {"prompt": "x", "max_tokens": 2, "repetiton_penalty": 1.2, "foo": None}),
    (CHAT, {"messages": [{"role": "user", "content": "x", "foo": 1}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True, "bar": 1},
            "speculative": {"k": 3}, "reasoning_effort": "high"}),
    ("/tokenize", {"prompt": "x", "foo": 1}),
    ("/detokenize", {"tokens": [104], "foo": 1}),
]


def test_allow_unknown_fields_ignores_them_and_logs_them_at_debug(caplog):
    async def scenario():
        async with serving(allow_unknown_fields=True) as (_, client, _engine):
            for path, body in UNKNOWN_FIELDS:
                with caplog.at_level("DEBUG", logger="verispec.server"):
                    caplog.clear()
                    r = await client.post(path, json=body)
                assert r.status_code == 200, (body, r.text)
                assert any("unknown request field" in m for m in caplog.messages), caplog.messages
        async with serving() as (_, client, _engine):
            for path, body in UNKNOWN_FIELDS:
                r = await client.post(path, json=body)
                assert r.status_code == 400, (body, r.text)
                assert r.json()["error"]["message"].startswith("Unrecognized request argument supplied")
    run(scenario())


def test_harmless_fields_openai_clients_send_are_accepted():
    """Hints that change nothing about the output are accepted explicitly, not as unknown."""
    async def scenario():
        async with serving() as (_, client, _engine):
            extras = {"user": "u1", "safety_identifier": "s", "prompt_cache_key": "k",
                      "service_tier": "auto", "metadata": {"a": "b"}, "store": False}
            for path, body in [(COMP, {"prompt": "x", "max_tokens": 2, **extras}),
                               (CHAT, {"messages": MSG, "max_tokens": 2, "stream": True,
                                       "stream_options": {"include_usage": True,
                                                          "include_obfuscation": False}, **extras})]:
                r = await client.post(path, json=body)
                assert r.status_code == 200, (body, r.text)
    run(scenario())


def test_allow_unknown_fields_flag_reaches_the_config():
    import argparse

    from verispec.server.app import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert ServerConfig.from_args(parser.parse_args([])).allow_unknown_fields is False
    assert ServerConfig.from_args(parser.parse_args(["--allow-unknown-fields"])).allow_unknown_fields


def test_every_server_config_field_has_its_flag():
    """from_args reads field `name_s` from flag `--name`: a field without a flag of that
    name would silently keep its default."""
    import argparse
    import dataclasses

    from verispec.server.app import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = set(vars(parser.parse_args([])))
    missing = {f.name for f in dataclasses.fields(ServerConfig)} - {f + "_s" for f in flags} - flags
    assert not missing, missing
    args = parser.parse_args(["--stall-timeout", "7", "--max-connections", "9", "--allowed-hosts", "a,b"])
    config = ServerConfig.from_args(args)
    assert (config.stall_timeout_s, config.max_connections, config.allowed_hosts) == (7.0, 9, ("a", "b"))


def _recording(engine: FakeEngine) -> list:
    """Record the SamplingParams each request reaches the engine with."""
    seen, add = [], engine.add_request

    def add_request(request_id, prompt, params, spec=None):
        seen.append(params)
        return add(request_id, prompt, params, spec)
    engine.add_request = add_request
    return seen


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_omitted_sampling_fields_take_the_models_generation_config(mode):
    """--generation-config auto: the model's values (carried in EngineInfo) fill what a
    request omits; vllm: the neutral ones. Sent values always win; /v1/models shows them."""
    import types
    engine = FakeEngine()
    engine.tokenizer.meta = types.SimpleNamespace(sampling_defaults={
        "temperature": 0.0, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.1})
    seen = _recording(engine)
    expected = ({"temperature": 0.0, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1}
                if mode == "auto" else
                {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0})

    async def scenario():
        async with serving(engine, generation_config=mode) as (_, client, _engine):
            card = (await client.get("/v1/models")).json()["data"][0]
            assert card["sampling_defaults"] == expected
            r = await client.post(COMP, json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await client.post(CHAT, json={"messages": MSG, "max_tokens": 2, "temperature": 0.5,
                                              "top_k": None, "repetition_penalty": 1.0})
            assert r.status_code == 200, r.text
    run(scenario())
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    assert {n: getattr(seen[0], n) for n in names} == expected
    assert {n: getattr(seen[1], n) for n in names} == {**expected, "temperature": 0.5,
                                                       "repetition_penalty": 1.0}


def test_generation_config_flag():
    import argparse

    from verispec.server.app import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert ServerConfig.from_args(parser.parse_args([])).generation_config == "auto"
    assert ServerConfig.from_args(parser.parse_args(["--generation-config", "vllm"])).generation_config == "vllm"
    with pytest.raises(ValueError, match="generation_config"):
        ServerConfig(generation_config="hf")


def test_oversized_body_is_refused_with_413_declared_or_streamed():
    async def scenario():
        async with serving(max_body_bytes=2048) as (_, client, _engine):
            big = json.dumps({"prompt": "x" * 5000}).encode()
            r = await client.post(COMP, content=big)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no Content-Length: the limit must apply while reading
                for _ in range(10):
                    yield b" " * 1024
            r = await client.post(COMP, content=chunks())
            assert r.status_code == 413
    run(scenario())


def test_body_limit_stops_reading_early():
    """The app must refuse once past the limit, not after reading the whole body."""
    async def scenario():
        app = create_app(FakeEngine(), ServerConfig(max_body_bytes=4096))
        received = 0
        sent = []

        async def receive():
            nonlocal received
            received += 1
            return {"type": "http.request", "body": b" " * 1024, "more_body": received < 1000}

        async def send(message):
            sent.append(message)

        async with app.router.lifespan_context(app):
            await app({**_post_scope(COMP), "headers": []}, receive, send)
        assert sent[0]["status"] == 413
        assert received <= 6, f"read {received} KiB of a 1000 KiB body before refusing"
    run(scenario())


def test_api_key_guards_v1_routes_only():
    async def scenario():
        async with serving(api_key="s3cret") as (_, client, _engine):
            body = {"prompt": "x", "max_tokens": 2}
            assert (await client.post(COMP, json=body)).status_code == 401
            r = await client.post(COMP, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await client.get("/v1/models")).status_code == 401
            r = await client.post(COMP, json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
    run(scenario())


def test_unknown_route_and_method_get_openai_error_bodies():
    async def scenario():
        async with serving() as (_, client, _engine):
            r = await client.get("/v1/nothing")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = await client.get(COMP)
            assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    run(scenario())


# ---------------------------------------------------------------------------- responses
def test_completion_and_chat_report_exact_usage_and_spec():
    async def scenario():
        async with serving() as (_, client, engine):
            tok = engine.tokenizer
            r = (await client.post(COMP, json={"prompt": "count me", "max_tokens": 7, "temperature": 0,
                                               "ignore_eos": True})).json()
            assert r["usage"] == {"prompt_tokens": len(tok.encode("count me")), "completion_tokens": 7,
                                  "total_tokens": len(tok.encode("count me")) + 7,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
            assert r["choices"][0]["finish_reason"] == "length"
            assert set(r["spec"]) >= {"drafted", "accepted", "acceptance_per_position",
                                      "mean_accepted_len", "num_drafts"}
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
            r = (await client.post(CHAT, json={"messages": msgs, "max_tokens": 5, "temperature": 0,
                                               "ignore_eos": True})).json()
            assert r["usage"]["prompt_tokens"] == len(tok.encode_chat(msgs))
            assert r["usage"]["completion_tokens"] == 5
            assert r["choices"][0]["message"]["role"] == "assistant"
            r = (await client.post(COMP, json={"prompt": [104, 105], "max_tokens": 2})).json()
            assert r["usage"]["prompt_tokens"] == 2
    run(scenario())


def _sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_matches_non_stream_and_puts_usage_and_spec_on_the_last_chunk():
    async def scenario():
        async with serving() as (_, client, _engine):
            body = {"prompt": "same as it ever was", "max_tokens": 24, "temperature": 0}
            whole = (await client.post(COMP, json=body)).json()
            r = await client.post(COMP, json={**body, "stream": True,
                                              "stream_options": {"include_usage": True}})
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _sse_events(r.text)
            text = "".join(c["text"] for e in events for c in e["choices"])
            assert text == whole["choices"][0]["text"]
            # the same prompt again: its whole blocks now come from the prefix cache
            cached = {"cached_tokens": len(body["prompt"]) // 16 * 16}
            assert events[-1]["choices"] == [] and events[-1]["usage"] == {
                **whole["usage"], "prompt_tokens_details": cached}
            assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            assert events[-1]["spec"] == whole["spec"]
            assert all("spec" not in e for e in events[:-1])
            # without include_usage the finishing chunk carries spec
            events = _sse_events((await client.post(COMP, json={**body, "stream": True})).text)
            assert events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
            assert events[-1]["spec"] == whole["spec"] and "usage" not in events[-1]
    run(scenario())


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_n_choices_equal_requests_seeded_s_plus_i_streamed_or_not(path):
    async def scenario():
        async with serving() as (_, client, _engine):
            base = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
            base.update({"prompt": "fan out"} if path == COMP else {"messages": MSG})

            def text(choice: dict) -> str:
                return choice["text"] if path == COMP else choice["message"]["content"]
            singles = [(await client.post(path, json={**base, "seed": 5 + i})).json() for i in range(3)]
            r = (await client.post(path, json={**base, "seed": 5, "n": 3})).json()
            assert [c["index"] for c in r["choices"]] == [0, 1, 2]
            assert [text(c) for c in r["choices"]] == [text(s["choices"][0]) for s in singles]
            assert r["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
            assert r["usage"]["completion_tokens"] == 18
            assert r["spec"]["num_drafts"] == sum(s["spec"]["num_drafts"] for s in singles)
            sr = await client.post(path, json={**base, "seed": 5, "n": 3, "stream": True,
                                               "stream_options": {"include_usage": True}})
            events = _sse_events(sr.text)
            assert sr.text.count("[DONE]") == 1
            assert all(e["id"] == events[0]["id"] for e in events)
            texts, roles, finishes = ["", "", ""], [0, 0, 0], [0, 0, 0]
            for e in events[:-1]:
                (c,) = e["choices"]
                if path == COMP:
                    texts[c["index"]] += c["text"]
                else:
                    roles[c["index"]] += c["delta"].get("role") == "assistant"
                    texts[c["index"]] += c["delta"].get("content") or ""
                finishes[c["index"]] += c["finish_reason"] is not None
            assert texts == [text(s["choices"][0]) for s in singles]
            assert finishes == [1, 1, 1] and roles == ([1, 1, 1] if path == CHAT else [0, 0, 0])
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 18
            assert events[-1]["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]
            health = await wait_idle(client)
            assert health["kv_blocks_used"] == 0
    run(scenario())


def test_a_failing_sibling_fails_the_request():
    async def scenario():
        engine = FakeEngine(step_delay_s=0.002)
        async with serving(engine) as (_, client, _engine):
            body = {"prompt": "FAIL_REQUEST", "max_tokens": 20, "n": 2}
            r = await client.post(COMP, json=body)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
            sr = await client.post(COMP, json={**body, "stream": True})
            events = _sse_events(sr.text)
            assert "error" in events[-1] and sr.text.count("[DONE]") == 1
            health = await wait_idle(client)
            assert health["kv_blocks_used"] == 0 and health["integrity"] == "ok"
    run(scenario())


def test_speculative_override_reaches_the_engine():
    async def scenario():
        async with serving() as (_, client, _engine):
            base = {"prompt": "speculate", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            plain = (await client.post(COMP, json={**base, "speculative": {"method": "none"}})).json()
            assert plain["spec"]["method"] == "none" and plain["spec"]["num_drafts"] == 0
            k1 = (await client.post(COMP, json={**base, "speculative": {"num_tokens": 1}})).json()
            assert k1["spec"]["method"] == "ngram" and len(k1["spec"]["drafted_per_position"]) == 1
            assert plain["choices"][0]["text"] == k1["choices"][0]["text"]  # lossless (fake's promise)
    run(scenario())


# ---------------------------------------------------------------------------- metrics
def scrape(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from a Prometheus exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == val for k, val in labels.items()))


EXPECTED_METRICS = [
    "vllm:request_success_total", "verispec:request_aborted_total", "verispec:request_error_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "verispec:prefix_cache_hit_rate",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
]


def test_metric_names_and_spec_counters_equal_the_sum_of_response_stats():
    async def scenario():
        async with serving() as (_, client, _engine):
            before = scrape((await client.get("/metrics")).text)
            sums = {"drafts": 0, "drafted": 0, "accepted": 0, "prompt": 0, "completion": 0}
            per_pos: dict[int, int] = {}
            for i in range(6):
                body = {"prompt": f"metrics {i} " * (i + 1), "max_tokens": 10 + i, "temperature": 0,
                        "speculative": {"num_tokens": 1 + i % 4}}
                r = (await client.post(COMP, json=body)).json()
                spec = r["spec"]
                sums["drafts"] += spec["num_drafts"]
                sums["drafted"] += spec["drafted"]
                sums["accepted"] += spec["accepted"]
                sums["prompt"] += r["usage"]["prompt_tokens"]
                sums["completion"] += r["usage"]["completion_tokens"]
                for pos, n in enumerate(spec["accepted_per_position"]):
                    per_pos[pos] = per_pos.get(pos, 0) + n
            after = scrape((await client.get("/metrics")).text)
            for name in EXPECTED_METRICS:
                assert any(n == name for n, _ in after), f"missing metric {name}"

            def delta(name, **labels):
                return total(after, name, **labels) - total(before, name, **labels)
            m = {"model_name": "fake-model", "method": "ngram"}
            assert delta("vllm:spec_decode_num_drafts_total", **m) == sums["drafts"] > 0
            assert delta("vllm:spec_decode_num_draft_tokens_total", **m) == sums["drafted"]
            assert delta("vllm:spec_decode_num_accepted_tokens_total", **m) == sums["accepted"]
            for pos, n in per_pos.items():
                assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                             position=str(pos), **m) == n
            assert delta("vllm:prompt_tokens_total") == sums["prompt"]
            assert delta("vllm:generation_tokens_total") == sums["completion"]
            assert delta("vllm:request_success_total") == 6
            assert delta("vllm:e2e_request_latency_seconds_count") == 6
            assert total(after, "verispec:request_rejected_total") == 0
    run(scenario())


def test_rejections_are_counted_by_reason():
    async def scenario():
        async with serving() as (_, client, _engine):
            await client.post(COMP, json={"prompt": "x", "n": 0})
            await client.get("/v1/missing")
            m = scrape((await client.get("/metrics")).text)
            assert total(m, "verispec:request_rejected_total", reason="invalid_request") == 1
            assert total(m, "verispec:request_rejected_total", reason="not_found") == 1
    run(scenario())


# ---------------------------------------------------------------------------- async engine
@contextlib.asynccontextmanager
async def async_engine(engine: FakeEngine, **kwargs):
    ae = AsyncEngine(engine, **kwargs)
    ae.start()
    try:
        yield ae
    finally:
        await ae.shutdown()


def _state(engine: FakeEngine):
    return engine.stats(), sorted(engine.requests)


def _check_integrity(engine: FakeEngine) -> None:
    engine.check_integrity()


async def engine_state(ae: AsyncEngine, engine: FakeEngine):
    """(stats, live request ids) read by the engine core between two steps."""
    return await ae.call(_state)


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_blocks():
    async def scenario():
        engine = FakeEngine(step_delay_s=0.005)
        async with async_engine(engine) as ae:
            got = []

            async def consume():
                async for out in ae.generate("r1", [1, 2, 3] * 20, SamplingParams(max_tokens=400,
                                                                                  ignore_eos=True)):
                    got.append(out)
            task = asyncio.create_task(consume())
            while len(got) < 3:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats, live = await engine_state(ae, engine)
            assert live == [] and stats.kv_blocks_used == 0
            await ae.call(_check_integrity)
    run(scenario())


def test_leaving_a_stream_early_aborts_it():
    async def scenario():
        engine = FakeEngine(step_delay_s=0.002)
        async with async_engine(engine) as ae:
            stream = await ae.add_request("r1", [5] * 30, SamplingParams(max_tokens=300, ignore_eos=True))
            async with stream:
                async for out in stream:
                    if len(out.token_ids) >= 3:
                        break
            stats, live = await engine_state(ae, engine)
            assert live == [] and stats.kv_blocks_used == 0
    run(scenario())


def test_engine_value_error_surfaces_from_add_request():
    async def scenario():
        engine = FakeEngine()
        async with async_engine(engine) as ae:
            with pytest.raises(ValueError, match="speculative.method"):
                await ae.add_request("r1", [1, 2], GREEDY, SpecOverride(method="draft"))
            assert ae.num_in_flight == 0
    run(scenario())


def test_full_waiting_queue_raises_queue_full_and_http_429():
    async def scenario():
        engine = FakeEngine(step_delay_s=0.02, max_num_seqs=1)
        async with async_engine(engine, max_waiting=2) as ae:
            long = SamplingParams(max_tokens=100, ignore_eos=True)
            streams = [await ae.add_request(f"r{i}", [1] * 10, long) for i in range(2)]
            with pytest.raises(QueueFull):
                for i in range(2, 6):
                    streams.append(await ae.add_request(f"r{i}", [1] * 10, long))
            for s in streams:
                s.abort()

        engine = FakeEngine(step_delay_s=0.02, max_num_seqs=1)
        async with serving(engine, max_waiting=1) as (_, client, _engine):
            body = {"prompt": "queue", "max_tokens": 30, "ignore_eos": True}
            results = await asyncio.gather(*[client.post(COMP, json=body) for _ in range(6)])
            codes = sorted(r.status_code for r in results)
            assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
            limited = next(r for r in results if r.status_code == 429)
            assert 1 <= int(limited.headers["retry-after"]) <= 90  # the drain rate: see test_retry_after_*
            assert limited.json()["error"]["code"] == "queue_full"
            await wait_idle(client)
    run(scenario())


def test_n_counts_n_against_the_waiting_queue():
    """An n > 1 request needs room for n waiting requests, a batch of prompts for prompts x n:
    with max_waiting below that it is a 429 before any sibling reaches the engine; with room
    it answers every choice."""
    async def scenario():
        async with serving(max_waiting=2) as (_, client, engine):
            r = await client.post(COMP, json={"prompt": "x", "max_tokens": 3, "n": 3})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            r = await client.post(COMP, json={"prompt": ["x", "y", "z"], "max_tokens": 3})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert engine.requests == {}
            r = await client.post(COMP, json={"prompt": ["x", "y"], "max_tokens": 3})
            assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1], r.text
            r = await client.post(COMP, json={"prompt": "x", "max_tokens": 3, "n": 2, "best_of": 2})
            assert r.status_code == 200, r.text
            assert [c["index"] for c in r.json()["choices"]] == [0, 1]
            await wait_idle(client)
    run(scenario())


def test_retry_after_follows_the_measured_drain_rate_with_jitter(monkeypatch):
    """Retry-After = the queue ahead at the measured rate of finishes, clamped to
    [1, 60] s, times 1..1.5 at random, so refused clients do not come back together."""
    from verispec.server import async_engine as AE
    ae = AsyncEngine(FakeEngine())
    assert {ae.retry_after_s(50) for _ in range(200)} <= {1, 2}  # no rate measured yet: 1 s
    ae._finishes.extend(10.0 + i / 4 for i in range(9))        # 4 finishes a second
    values = [ae.retry_after_s(40) for _ in range(400)]        # 40 waiting: 10 s to drain
    assert min(values) in (10, 11) and max(values) == 15 and len(set(values)) >= 4, sorted(set(values))
    assert max(ae.retry_after_s(10_000) for _ in range(100)) <= 90  # clamped at 60 s (+50%)
    monkeypatch.setattr(AE, "RETRY_JITTER", 0.0)
    assert {ae.retry_after_s(40) for _ in range(20)} == {10}  # the twin without jitter: one wave


def test_admission_refuses_before_the_body_is_read_or_parsed():
    """With the queue full, a request is refused 429 before its body is even parsed: the
    same answer for an invalid body as for a valid one."""
    async def scenario():
        engine = FakeEngine(step_delay_s=0.02, max_num_seqs=1)
        async with serving(engine, max_waiting=1) as (app, client, _engine):
            app.state.server._preparing = 1  # one request is being prepared: the queue is full
            bad = await client.post(COMP, content=b"{not json", headers={"content-type": "application/json"})
            assert bad.status_code == 429 and bad.json()["error"]["code"] == "queue_full", bad.text
            app.state.server._preparing = 0
            bad = await client.post(COMP, content=b"{not json", headers={"content-type": "application/json"})
            assert bad.status_code == 400
    run(scenario())


def test_step_exception_fails_in_flight_requests_and_the_loop_keeps_serving():
    async def scenario():
        engine = FakeEngine(step_delay_s=0.002)
        async with serving(engine) as (_, client, _engine):
            bad, other = await asyncio.gather(
                client.post(COMP, json={"prompt": "FAIL_STEP please", "max_tokens": 20}),
                client.post(COMP, json={"prompt": "innocent", "max_tokens": 50, "ignore_eos": True}))
            assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
            assert other.status_code in (200, 500)  # in flight during the failed step, or not
            ok = await client.post(COMP, json={"prompt": "after the storm", "max_tokens": 5})
            assert ok.status_code == 200
            health = await wait_idle(client)
            assert health["integrity"] == "ok" and health["kv_blocks_used"] == 0
            assert "injected step failure" in health["last_step_error"]
            m = scrape((await client.get("/metrics")).text)
            assert total(m, "verispec:engine_step_errors_total") == 1
    run(scenario())


def test_failed_request_is_an_error_for_that_client_only():
    async def scenario():
        engine = FakeEngine(step_delay_s=0.002)
        async with serving(engine) as (_, client, _engine):
            bad, good, bad_stream = await asyncio.gather(
                client.post(COMP, json={"prompt": "FAIL_REQUEST", "max_tokens": 20}),
                client.post(COMP, json={"prompt": "fine", "max_tokens": 20, "ignore_eos": True}),
                client.post(CHAT, json={"messages": [{"role": "user", "content": "FAIL_REQUEST"}],
                                        "stream": True}))
            assert bad.status_code == 500 and "injected" in bad.json()["error"]["message"]
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 20
            events = _sse_events(bad_stream.text)
            assert "injected" in events[-1]["error"]["message"]
            m = scrape((await client.get("/metrics")).text)
            assert total(m, "verispec:request_error_total") == 2
            assert total(m, "verispec:request_rejected_total") == 0  # failed, not refused
    run(scenario())


async def _disconnecting_call(app, body: dict, after_messages: int):
    """Call the app as a client that disconnects after `after_messages` sends (or at once)."""
    sent = []
    disconnect = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if len(sent) >= after_messages:
            disconnect.set()

    task = asyncio.create_task(app(_post_scope(COMP), receive, send))
    if after_messages == 0:
        await asyncio.sleep(0.05)
        disconnect.set()
    await asyncio.wait_for(task, 10)
    return sent


async def _assert_aborted_and_freed(app, engine: FakeEngine, ran_on: str, aborts: int = 1) -> None:
    """The requests in flight (`aborts` of them) end aborted within a second, their KV
    blocks free, the engine well short of the steps their max_tokens would take."""
    ae = app.state.server.async_engine
    for _ in range(100):
        if ae.num_in_flight == 0:
            break
        await asyncio.sleep(0.01)
    stats, live = await engine_state(ae, engine)
    assert live == [] and stats.kv_blocks_used == 0
    assert engine.steps < 100, ran_on
    m = scrape(app.state.server.metrics.render()[0].decode())
    assert total(m, "verispec:request_aborted_total") == aborts


def _post_scope(path: str) -> dict:
    """An ASGI scope for a JSON POST to `path`."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "path": path, "raw_path": path.encode(), "query_string": b"",
            "headers": [(b"content-type", b"application/json")], "scheme": "http",
            "server": ("test", 80), "client": ("test", 1), "root_path": ""}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_every_choice_at_once(stream, n):
    """A client that leaves ends its request's engine work at once, all n siblings of it."""
    async def scenario():
        engine = FakeEngine(step_delay_s=0.01)
        app = create_app(engine, ServerConfig())
        async with app.router.lifespan_context(app):
            body = {"prompt": "walk away", "max_tokens": 400, "ignore_eos": True, "stream": stream, "n": n}
            await _disconnecting_call(app, body, after_messages=(3 if n == 1 else 4) if stream else 0)
            await _assert_aborted_and_freed(app, engine, f"{n} choice(s) ran on after the client left", aborts=n)
    run(scenario())


def test_shutdown_aborts_in_flight_requests_and_refuses_new_ones():
    async def scenario():
        engine = FakeEngine(step_delay_s=0.005)
        ae = AsyncEngine(engine)
        ae.start()
        stream = await ae.add_request("long", [1] * 10, SamplingParams(max_tokens=400, ignore_eos=True))
        short = await ae.add_request("short", [2] * 10, SamplingParams(max_tokens=2, ignore_eos=True))
        await ae.shutdown(drain_timeout_s=0.2)
        assert not ae.is_alive
        assert [o.finish_reason for o in [o async for o in short]][-1] == "length"  # drained
        with pytest.raises(EngineClosed):
            async for _ in stream:
                pass
        assert engine.requests == {} and engine.stats().kv_blocks_used == 0
        engine.check_integrity()
        with pytest.raises(EngineClosed):
            await ae.add_request("late", [1], GREEDY)
    run(scenario())


def test_health_reports_a_kv_leak_as_degraded():
    """The idle integrity check catches an engine that leaks blocks on abort (injected bug)."""
    async def scenario():
        engine = FakeEngine(step_delay_s=0.002, leak_blocks_on_abort=True)
        async with serving(engine) as (app, client, _engine):
            ae = app.state.server.async_engine
            stream = await ae.add_request("leaky", [1] * 40, SamplingParams(max_tokens=200, ignore_eos=True))
            await stream.__anext__()
            stream.abort()
            for _ in range(100):
                r = await client.get("/health")
                if r.json()["in_flight"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert r.status_code == 503 and r.json()["status"] == "degraded"
            assert r.json()["integrity"].startswith("failed") and r.json()["kv_blocks_used"] > 0
    run(scenario())


def test_request_failed_is_raised_from_the_stream():
    async def scenario():
        engine = FakeEngine()
        async with async_engine(engine) as ae:
            with pytest.raises(RequestFailed, match="injected"):
                async for _ in ae.generate("f", list(b"FAIL_REQUEST"), GREEDY):
                    pass
    run(scenario())


def test_a_client_that_never_reads_its_stream_is_aborted_at_the_buffer_bound():
    """A stalled reader (the ASGI `send` never returns, as when a client stops reading and
    the socket fills) must not make its request's buffer grow: at max_buffered_outputs
    unread outputs the request is aborted and its KV freed. Without the bound the request
    runs to max_tokens with every output queued (the engine's steps show it)."""
    async def scenario():
        engine = FakeEngine(step_delay_s=0.002)
        app = create_app(engine, ServerConfig(max_buffered_outputs=8))
        async with app.router.lifespan_context(app):
            body = {"prompt": "never read", "max_tokens": 450, "ignore_eos": True, "stream": True}
            stuck = asyncio.Event()

            async def receive():
                await asyncio.Event().wait()  # no disconnect: the client is there, not reading

            async def send(message):
                if message.get("more_body") and message.get("body"):
                    stuck.set()
                    await asyncio.Event().wait()  # the socket is full: send never returns

            task = asyncio.create_task(app(_post_scope(COMP), _once(json.dumps(body).encode(), receive), send))
            await stuck.wait()
            await _assert_aborted_and_freed(app, engine, "the request ran on while nobody read it")
            task.cancel()
    run(scenario())


def _once(body: bytes, then):
    """An ASGI receive that delivers `body` once, then defers to `then`."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()
    return receive


def _where(engine: FakeEngine) -> tuple[int, bool, int]:
    import gc
    import threading
    return os.getpid(), threading.current_thread() is threading.main_thread(), gc.get_freeze_count()


def test_a_spawned_engine_runs_on_the_main_thread_of_another_process():
    """AsyncEngine.spawn (what `verispec serve` uses) builds and steps the engine on the main
    thread of a child process, with the objects it was built from frozen out of the garbage
    collector; the thread form (tests) shares this process."""
    import functools

    async def scenario():
        ae = AsyncEngine.spawn(functools.partial(FakeEngine, step_delay_s=0.001))
        ae.start()
        try:
            pid, on_main, frozen = await ae.call(_where)
            assert pid == ae.engine_pid != os.getpid() and on_main
            assert frozen > 0  # what the engine was built from is out of the collector's sight
            outs = [o async for o in ae.generate("r", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))]
            assert outs[-1].finished and len(outs[-1].token_ids) == 5
        finally:
            await ae.shutdown()
        assert not ae.is_alive
        async with async_engine(FakeEngine()) as threaded:
            assert (await threaded.call(_where))[0] == os.getpid()
    run(scenario())


def test_the_spec_of_sibling_choices_sums_their_counts_and_recomputes_the_rates():
    from verispec.outputs import SpecStats
    from verispec.server.protocol import merge_spec, spec_summary
    a, b = SpecStats(), SpecStats()
    a.record_round(2, 2, "ngram")
    a.record_round(1, 0, "eagle")
    b.record_round(3, 1, "ngram")
    merged = merge_spec([spec_summary(a, "auto"), spec_summary(b, "auto")])
    assert merged == {"method": "auto", "num_drafts": 3, "drafted": 6, "accepted": 3,
                      "acceptance_per_position": [2 / 3, 1 / 2, 0.0], "mean_accepted_len": 1.0,
                      "accepted_per_position": [2, 1, 0], "drafted_per_position": [3, 2, 1],
                      "proposers": {"ngram": {"drafted": 5, "accepted": 3}, "eagle": {"drafted": 1, "accepted": 0}}}
