"""Structured output: constraints compile, masks walk and roll back, drafts are cut at the
constraint, speculation leaves greedy and seeded outputs unchanged, and the server returns
output valid against the request's schema (over real HTTP with the `openai` client).

The distributional check (G1 with a grammar) is in tests/test_gate_lossless.py.
"""
from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
import torch

import verispec.engine.engine as engine_mod
from test_gate_lossless import PAIR, PROMPT, REGEX, STRUCTURED_EOS, VOCAB, allowed_by_regex
from test_server_http import BACKEND, clean_server, client
from tiny import TinyTokenizer, run_all, tiny_engine
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams
from verispec.structured.grammar import GrammarCompiler, GrammarError, allowed_tokens
from verispec.structured.spec import JSON_OBJECT, StructuredOutput, from_guided, from_response_format

CONSTRAINT = StructuredOutput("regex", REGEX)
PLAIN = SpecOverride(method="none")


def _compiler() -> GrammarCompiler:
    tok = TinyTokenizer(VOCAB, eos=STRUCTURED_EOS)
    return GrammarCompiler(tok.backend.to_str(), VOCAB, [STRUCTURED_EOS])


def _valid_walk(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(n):
        out.append(rng.choice(allowed_by_regex(out)))
    return out


# ---------------------------------------------------------------------------- the walk
def check_masks_match_the_reference(grammar, output: list[int], drafts: list[int]) -> list[str]:
    """Problems with one verify row's masks: position j (drafts[:j] treated as generated)
    must admit exactly allowed_by_regex, and the walk must leave the committed state as it
    found it."""
    before = allowed_tokens([(grammar, [])], VOCAB)
    got = allowed_tokens([(grammar, drafts[:j]) for j in range(len(drafts) + 1)], VOCAB)
    problems = []
    for j in range(len(drafts) + 1):
        want = torch.zeros(VOCAB, dtype=torch.bool)
        want[allowed_by_regex(output + drafts[:j])] = True
        if not torch.equal(got[j], want):
            problems.append(f"position {j}")
    if not torch.equal(allowed_tokens([(grammar, [])], VOCAB), before):
        problems.append("state not rolled back")
    return problems


def test_masks_along_drafts_equal_the_reference_and_leave_the_state_unchanged():
    compiler = _compiler()
    for seed in range(20):
        walk = _valid_walk(12, seed)
        grammar = compiler.matcher(CONSTRAINT)
        grammar.commit(walk[:5])
        assert check_masks_match_the_reference(grammar, walk[:5], walk[5:]) == []


def test_the_mask_check_catches_a_walk_that_is_not_rolled_back():
    compiler = _compiler()
    grammar = compiler.matcher(CONSTRAINT)
    walk = _valid_walk(6, 1)
    grammar.commit(walk[:3])
    real = grammar._m

    class NoRollback:  # the bug: the walk's tokens stay consumed
        def __getattr__(self, name):
            return getattr(real, name)

        def rollback(self, n):
            return True
    grammar._m = NoRollback()
    assert "state not rolled back" in check_masks_match_the_reference(grammar, walk[:3], walk[3:])


def test_valid_prefix_stops_at_the_first_token_outside_the_constraint():
    grammar = _compiler().matcher(CONSTRAINT)
    grammar.commit([0])                       # 'a': the next must be e-p
    assert grammar.valid_prefix([0], [5, 1, 6]) == 3
    assert grammar.valid_prefix([0], [5, 1, 2]) == 2   # after 'b', 'c' is outside
    assert grammar.valid_prefix([0], [1]) == 0
    assert grammar.valid_prefix([0], [5, 1, 6]) == 3   # nothing was consumed by asking


def test_committing_a_token_outside_the_constraint_raises():
    grammar = _compiler().matcher(CONSTRAINT)
    grammar.commit([0])
    with pytest.raises(RuntimeError, match="outside the request's structured-output constraint"):
        grammar.commit([1])


@pytest.mark.parametrize("spec,match", [
    (StructuredOutput("regex", "([a-"), "response_format: the regex constraint does not compile"),
    (StructuredOutput("lark", "start: undefined_rule"), "response_format: the lark constraint"),
    (StructuredOutput("json", '{"type": "no-such-type"}'), "response_format"),
])
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_response_format(spec, match):
    with pytest.raises(GrammarError, match=match):
        _compiler().matcher(spec)


def test_request_fields_map_to_one_constraint():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == JSON_OBJECT
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(from_response_format({"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}).source) == schema
    assert from_guided(choice=["yes", "no"]) == StructuredOutput("choice", '["yes", "no"]')
    assert from_guided(regex="[0-9]+") == StructuredOutput("regex", "[0-9]+")
    for bad, field in (({"type": "xml"}, "type"), ({"type": "json_schema"}, "json_schema")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            from_response_format(bad)
    with pytest.raises(ValueError, match="^guided_choice:"):
        from_guided(choice=[])


# ---------------------------------------------------------------------------- the engine
def _run(method: str, params: SamplingParams, n: int = 12, seed: int = 0) -> list[list[int]]:
    target, draft = PAIR
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=3,
                         eos=STRUCTURED_EOS, seed=seed)
    outs = run_all(engine, [PROMPT] * n, params, PLAIN if method == "none" else None)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_structured_output_is_identical_with_and_without_speculation(method):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, structured=CONSTRAINT)
    plain, spec = _run("none", params, n=1), _run(method, params, n=1)
    assert spec == plain
    assert all(t in allowed_by_regex(plain[0][:i]) for i, t in enumerate(plain[0]))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_structured_output_is_identical_with_and_without_speculation(method):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, structured=CONSTRAINT)
              for s in range(8)]
    target, draft = PAIR
    outputs = {}
    for m in ("none", method):
        engine = tiny_engine(target, draft if m == "draft" else None, method=m if m != "none" else "ngram",
                             k=3, eos=STRUCTURED_EOS)
        outs = run_all(engine, [PROMPT] * len(params), params, PLAIN if m == "none" else None)
        outputs[m] = [o.token_ids for o in outs]
    assert outputs[method] == outputs["none"]
    assert len({tuple(o) for o in outputs["none"]}) > 1  # the seeds matter


def _verified_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Record (output so far, drafts) of every decode row the target verifies."""
    seen = []
    real = engine_mod.LLMEngine._inputs

    def spy(self, batch, drafts):
        for req in batch.decode:
            d = drafts.get(req.request_id, ([], None))[0]
            if d:
                seen.append((list(req.output_ids), list(d)))
        return real(self, batch, drafts)
    monkeypatch.setattr(engine_mod.LLMEngine, "_inputs", spy)
    return seen


def _outside(seen) -> int:
    return sum(1 for output, drafts in seen
               if any(t not in allowed_by_regex(output + drafts[:j]) for j, t in enumerate(drafts)))


def test_drafts_are_cut_at_the_constraint_before_verification(monkeypatch):
    seen = _verified_drafts(monkeypatch)
    params = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, structured=CONSTRAINT)
    _run("ngram", params, n=16)
    assert seen, "nothing was drafted"
    assert _outside(seen) == 0


def test_the_cut_check_catches_drafts_verified_uncut(monkeypatch):
    monkeypatch.setattr(engine_mod, "_inside_grammar", lambda req, draft: draft)  # the bug
    seen = _verified_drafts(monkeypatch)
    params = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, structured=CONSTRAINT)
    _run("ngram", params, n=16)
    assert _outside(seen) > 0


# ---------------------------------------------------------------------------- over HTTP
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Give the person as JSON with name, age and city: "
                                        "Ada Lovelace, 36, lives in London."}]


# The default model's template does not render tools; this one does (a minimal ChatML one).
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nCall one of these tools: {{ tools | tojson }} as "
                  "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    with clean_server(BACKEND, ("--chat-template", TOOLS_TEMPLATE)) as srv:
        yield srv


@pytest.mark.parametrize("choice,name", [("required", None), ({"type": "function", "function": {"name": "get_time"}},
                                                               "get_time")])
def test_a_required_or_named_tool_choice_always_yields_valid_calls(server, choice, name):
    c = client(server)
    msgs = [{"role": "user", "content": "Tell me a joke about cats."}]  # no reason to call a tool
    for stream in (False, True):
        kw = dict(model=MODEL, messages=msgs, max_tokens=120, temperature=0, tools=[WEATHER, TIME],
                  tool_choice=choice, parallel_tool_calls=False)
        if stream:
            chunks = list(c.chat.completions.create(stream=True, **kw))
            calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        else:
            r = c.chat.completions.create(**kw)
            calls, finish = r.choices[0].message.tool_calls or [], [r.choices[0].finish_reason]
        assert len(calls) == 1 and finish == ["tool_calls"], (calls, finish)
        fn = calls[0].function
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        assert fn.name in tools and (name is None or fn.name == name)
        jsonschema.validate(json.loads(fn.arguments), tools[fn.name])


def test_a_tool_choice_with_another_constraint_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, tools=[WEATHER],
                                               tool_choice="required", response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_json_schema_output_is_valid_against_the_schema(server, method):
    c = client(server)
    r = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        extra_body={"speculative": {"method": method}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_object_streamed_equals_unstreamed_and_parses(server):
    c = client(server)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
              response_format={"type": "json_object"})
    whole = c.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == whole
    assert isinstance(json.loads(whole), dict)


def test_guided_choice_and_regex_on_completions(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8,
                             temperature=0.8, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = c.completions.create(model=MODEL, prompt="A phone number:", max_tokens=12, temperature=0,
                             extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert len(r.choices[0].text) == 8 and r.choices[0].text[3] == "-"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "([a-"}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "[0-9]+"}, "guided_regex"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=body)
    assert err.value.body["param"] == param, err.value.body


def test_vllms_structured_outputs_params_become_the_constraint_and_travel_to_the_core():
    from verispec import GuidedDecodingParams, StructuredOutputsParams
    from verispec.engine import messages as M

    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(regex=REGEX))
    assert p.structured == CONSTRAINT and p.structured_outputs is None
    assert SamplingParams(guided_decoding=GuidedDecodingParams(json_object=True)).structured == JSON_OBJECT
    add = M.Add("r", [1, 2], p, None)
    decoded = M.command_decoder().decode(M.encoder().encode(add))
    assert decoded.params == p and decoded.params.structured == CONSTRAINT
    out = _run("ngram", p, n=1)[0]
    assert all(t in allowed_by_regex(out[:i]) for i, t in enumerate(out))
    for bad in (dict(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"])),
                dict(structured_outputs=StructuredOutputsParams()),
                dict(structured=CONSTRAINT, guided_decoding=GuidedDecodingParams(regex="a"))):
        with pytest.raises(ValueError, match="structured_outputs|give one of"):
            SamplingParams(**bad)
