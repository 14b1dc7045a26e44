"""Tool calling: the <tool_call> parser (verispec/server/tools.py), the chat template
rendering tools, and the server end to end on the fake engine with the OpenAI client."""
from __future__ import annotations

import json
import os
import sys

import httpx
import openai
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

sys.path.insert(0, os.path.dirname(__file__))
from fake_engine import TOOL_CALL_OUTPUT, FakeEngine  # noqa: E402
from test_server_unit import CHAT, run, serving  # noqa: E402

from verispec.model.tokenizer import Tokenizer, TokenizerMeta, template_supports_tools  # noqa: E402
from verispec.server.tools import ToolCallParser, collect, parse_tool_calls  # noqa: E402


def block(name, args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def plain(calls: list[dict]) -> list[tuple[str, dict]]:
    """Calls without their random ids, arguments decoded."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---------------------------------------------------------------------------- the parser
def test_one_call():
    content, calls = parse_tool_calls(block("f", {"x": 1}))
    assert content is None and plain(calls) == [("f", {"x": 1})]
    c = calls[0]
    assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
    assert isinstance(c["function"]["arguments"], str)


def test_several_calls_with_text_around():
    text = "Sure.\n" + block("a", {"q": "é"}) + "\n" + block("b", {}) + "\nDone."
    content, calls = parse_tool_calls(text)
    assert content == "Sure.Done."
    assert plain(calls) == [("a", {"q": "é"}), ("b", {})]
    assert calls[0]["id"] != calls[1]["id"]


def test_plain_text_and_lookalikes_stay_text():
    for text in ["hello", "a < b <tool", "x <tool_calls> y", "<tool_call", "1 <tool_call> 2"]:
        assert parse_tool_calls(text) == (text, [])


def test_malformed_block_is_left_as_text():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    content, calls = parse_tool_calls("A " + bad + " " + block("f", {}) + no_name)
    assert content == "A " + bad + no_name and plain(calls) == [("f", {})]


def test_unclosed_block_at_the_end():
    content, calls = parse_tool_calls('x <tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert content == "x" and plain(calls) == [("f", {"a": 1})]
    assert parse_tool_calls('x <tool_call>{"name": "f", "argu') == ('x <tool_call>{"name": "f", "argu', [])


def test_string_arguments_are_kept():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"a": 2}'


CASES = [
    "Sure.\n" + block("a", {"q": "é"}) + "\n" + block("b", {}) + "\nDone.",
    "pre <tool_call>\n{bad}\n</tool_call> mid " + block("c", [1]) + block("d", {"k": "<tool_call>"}),
    "no calls at all, < and <tool and </tool_call>  \n",
    'x <tool_call>{"name": "f", "arguments": {"a": 1}}',
]


@pytest.mark.parametrize("text", CASES)
def test_streaming_split_anywhere_gives_the_same_result(text):
    whole = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            parser = ToolCallParser()
            events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
            content, calls = collect(events)
            assert content == whole[0], (cut, pieces)
            assert plain(calls) == plain(whole[1]), (cut, pieces)


def test_streaming_emits_text_before_a_block_completes():
    parser = ToolCallParser()
    assert parser.feed("Hi <tool") == [("text", "Hi")]
    assert parser.feed('_call>{"name": "f"}') == []
    assert [k for k, _ in parser.feed("</tool_call>")] == ["call"]


# ---------------------------------------------------------------------------- the template
# Qwen2.5's way of rendering tools (abridged from its chat template).
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
NO_TOOLS = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}}}}


def _tok(template: str) -> Tokenizer:
    return Tokenizer(Backend(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                     TokenizerMeta(None, (), False, template))


def test_chat_template_renders_tools_the_qwen_way():
    tok = _tok(QWEN_STYLE)
    assert tok.supports_tools and not _tok(NO_TOOLS).supports_tools
    assert not template_supports_tools(None)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "22C", "tool_call_id": "call_1"}]
    text = tok.apply_chat_template(messages, tools=[WEATHER])
    assert "<tools>" + json.dumps(WEATHER, ensure_ascii=False) + "</tools>" in text.replace("\n", "")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n22C\n</tool_response>" in text and text.endswith("<|im_start|>assistant")
    assert "<tools>" not in tok.apply_chat_template(messages[:1])  # no tools: none rendered


def test_the_default_model_template_has_no_tool_support():
    """SmolLM2's template never mentions tools (checked on its text, without loading it)."""
    from verispec.model.loader import load_config_and_tokenizer, resolve_model
    try:
        _, tok = load_config_and_tokenizer(resolve_model("smollm2-135m-instruct"))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"default model not available: {exc}")
    assert not tok.supports_tools


# ---------------------------------------------------------------------------- the server
TOOLS = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "TOOL_CALL please"}]


def _client(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost/v1")
    return openai.AsyncOpenAI(api_key="x", base_url="http://localhost/v1", http_client=http)


def test_openai_client_gets_message_tool_calls():
    async def scenario():
        async with serving(FakeEngine(max_model_len=2048)) as (app, _, _engine):
            client = _client(app)
            r = await client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                                     max_tokens=300)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Let me check."
            calls = choice.message.tool_calls
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
            assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
            assert r.usage.completion_tokens == len(TOOL_CALL_OUTPUT) + 1  # and EOS

            r = await client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                                     parallel_tool_calls=False, max_tokens=300)
            assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]

            # tool_choice "none": the tools are not rendered and the output is left as text
            r = await client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS,
                                                     tool_choice="none", max_tokens=300)
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
            assert r.choices[0].message.content == TOOL_CALL_OUTPUT

            # a conversation that continues after the calls
            follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0].id, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": calls[0].id, "content": "22C"}]
            r = await client.chat.completions.create(model="fake-model", messages=follow, tools=TOOLS,
                                                     max_tokens=5, temperature=0)
            assert r.choices[0].finish_reason in ("stop", "length")
    run(scenario())


def test_openai_client_gets_streamed_delta_tool_calls():
    async def scenario():
        async with serving(FakeEngine(max_model_len=2048)) as (app, _, _engine):
            client = _client(app)
            stream = await client.chat.completions.create(
                model="fake-model", messages=ASK, tools=TOOLS, max_tokens=300, stream=True,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                stream_options={"include_usage": True})
            text, calls, finish, usage = "", [], None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                text += delta.content or ""
                for tc in delta.tool_calls or []:
                    assert tc.index == len(calls) and tc.id.startswith("call_") and tc.type == "function"
                    calls.append((tc.function.name, json.loads(tc.function.arguments)))
                finish = chunk.choices[0].finish_reason or finish
            assert text == "Let me check."
            assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
            assert finish == "tool_calls" and usage.completion_tokens == len(TOOL_CALL_OUTPUT) + 1
    run(scenario())


def test_plain_text_streams_unchanged_with_tools():
    async def scenario():
        async with serving(FakeEngine(max_model_len=2048)) as (app, http, _engine):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
                    "tools": TOOLS, "ignore_eos": True}
            whole = (await http.post(CHAT, json=body)).json()["choices"][0]
            assert whole["message"].get("tool_calls") is None and whole["finish_reason"] == "length"
            r = await http.post(CHAT, json={**body, "stream": True})
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert streamed == whole["message"]["content"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    run(scenario())


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
])
def test_bad_tool_requests_are_400s_naming_the_field(body, param):
    async def scenario():
        async with serving() as (_, http, _engine):
            r = await http.post(CHAT, json={"messages": ASK, "max_tokens": 2, **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param, r.text
    run(scenario())


def test_tools_on_a_template_without_tool_support_are_a_400_naming_tools():
    async def scenario():
        async with serving(FakeEngine(tools_template=False)) as (_, http, _engine):
            r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
            assert "does not support tools" in r.json()["error"]["message"]
            r = await http.post(CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "none",
                                            "max_tokens": 2})
            assert r.status_code == 200, r.text
    run(scenario())
