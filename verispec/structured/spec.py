"""What a request constrains its output to: a JSON schema, a regex, a choice or a grammar.

Pure Python (it travels inside SamplingParams to the engine process). The grammar engine
that enforces it is in `grammar.py`; `from_request_fields` turns OpenAI's
`response_format` and vLLM's `guided_*` fields into one `StructuredOutput`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "lark")


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on the whole output.

    kind "json": `source` is a JSON schema (a JSON text; '{"type": "object"}' for OpenAI's
    json_object). "regex": a regular expression the whole output matches. "choice": a JSON
    list of strings, the output is exactly one of them. "lark": a Lark grammar (llguidance's
    dialect). The model's EOS token ends the output once the constraint is complete.
    """

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("structured output needs a non-empty source")


JSON_OBJECT = StructuredOutput("json", '{"type": "object"}')


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's Python spelling of a constraint (`SamplingParams(structured_outputs=...)`; its
    older name, `guided_decoding=GuidedDecodingParams(...)`, is the same class): exactly one
    of json (a schema, dict or JSON text), regex, choice, grammar (Lark) or json_object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_structured(self) -> StructuredOutput:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json_object:
            return JSON_OBJECT
        choice = list(self.choice) if self.choice is not None else None
        return from_guided(self.json, self.regex, choice, self.grammar)


GuidedDecodingParams = StructuredOutputsParams


def from_response_format(value: dict) -> StructuredOutput | None:
    """OpenAI's `response_format` -> a constraint (None for {"type": "text"}); ValueError
    naming the sub-field otherwise."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("json_schema: must be an object with a `schema` (and a `name`)")
        schema = spec.get("schema", {"type": "object"})  # OpenAI makes `schema` optional
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema: must be a JSON schema object")
        return StructuredOutput("json", json.dumps(schema))
    raise ValueError(f'type: must be "text", "json_object" or "json_schema", got {kind!r}')


def from_guided(json_schema=None, regex=None, choice=None, grammar=None) -> StructuredOutput | None:
    """vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (at most
    one given; the caller checks that) -> a constraint."""
    if json_schema is not None:
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except ValueError:
                raise ValueError("guided_json: is not valid JSON") from None
        if not isinstance(json_schema, dict):
            raise ValueError("guided_json: must be a JSON schema object")
        return StructuredOutput("json", json.dumps(json_schema))
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ValueError("guided_regex: must be a non-empty string")
        return StructuredOutput("regex", regex)
    if choice is not None:
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise ValueError("guided_choice: must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(choice))
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar:
            raise ValueError("guided_grammar: must be a non-empty Lark grammar")
        return StructuredOutput("lark", grammar)
    return None
