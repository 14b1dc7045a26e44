"""OpenAI-compatible request schemas, their validation, and the response/error bodies.

Requests are parsed strictly (no "1" for 1, no true for 1): a wrong type is a 400 that
names the field, never a silent coercion. An unknown field is a 400 naming it, at every
level (OpenAI's "Unrecognized request argument supplied: foo"), unless the server runs with
--allow-unknown-fields (then it is dropped and logged at debug level); a known feature this
server does not implement is rejected too, never silently dropped. Fields that change
nothing about the output are accepted and ignored, each listed with its reason: `user`,
`safety_identifier`, `prompt_cache_key`, `service_tier`, `metadata`, `store` (false only),
`stream_options.include_obfuscation`.

Tools: `tools`, `tool_choice` ("none" | "auto" | "required" | a named function; the last
two best effort, nothing forces a call), `parallel_tool_calls`, assistant `tool_calls` and
`tool` messages are accepted and rendered by the chat template (the server answers 400 when
the template has no tool support); the output's <tool_call> blocks are parsed by
verispec/server/tools.py.

Extensions over the OpenAI API (vLLM's names and semantics): `top_k` (-1 or 0 disables),
`min_p`, `ignore_eos`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, and
`speculative: {"method": "auto"|"ngram"|"suffix"|"eagle"|"draft"|"none", "num_tokens": k,
"adaptive": bool}` on requests; `spec` (the request's speculation statistics) on responses.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from verispec.outputs import SpecStats
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams
from verispec.server.tools import call_grammar
from verispec.structured.spec import StructuredOutput, from_guided, from_response_format

log = logging.getLogger("verispec.server")

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1
MAX_LOGPROBS = 20   # alternatives per token (OpenAI's top_logprobs bound; vLLM's default)
MAX_N = 16          # choices per request (prompts x n); each is one engine request
# Deepest JSON nesting accepted: chat messages with content parts need 5 levels and a
# tool's JSON Schema rarely 20; Python's decoder would raise RecursionError near 1,000.
MAX_JSON_DEPTH = 64


class APIError(Exception):
    """An error answered to the client as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, rejected: bool = True):
        super().__init__(message)
        self.rejected = rejected  # False: the engine had the request (counted as error/abort)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}} as the OpenAI API returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    # extra="forbid": an unknown field is a 400 naming it (OpenAI's "Unrecognized request
    # argument supplied"), at every level; parse_request(allow_unknown=True) (the server's
    # --allow-unknown-fields) drops them here instead and counts them.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any, info: ValidationInfo) -> Any:
        # OpenAI clients send `"field": null` for "not set"; treat it as absent. An unknown
        # field is refused even when null: a typo is a typo whatever its value.
        if not isinstance(data, dict):
            return data
        known = cls.model_fields
        ignored = info.context.get("ignored") if isinstance(info.context, dict) else None
        out = {}
        for k, v in data.items():
            if k not in known and ignored is not None:
                ignored.append(k)
            elif v is not None or k not in known:
                out[k] = v
        return out


class SpeculativeOptions(_Strict):
    method: Literal["ngram", "draft", "none"] | None = None
    num_tokens: int | None = Field(None, ge=0, le=MAX_INT32)  # the engine has its own bound
    adaptive: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk (with include_usage)
    include_obfuscation: bool | None = None  # accepted, ignored: OpenAI's padding against
                                             # side channels; chunks here carry none


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    # None: not sent; the server's default applies (the model's generation config with
    # --generation-config auto, else NEUTRAL_SAMPLING): see sampling_params.
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # extension; 0 or -1 disables
    min_p: float | None = Field(None, ge=0, le=1)  # extension
    seed: int | None = Field(None, ge=-MAX_SEED, le=MAX_SEED)
    stop: Any = ()
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None  # extension
    ignore_eos: bool = False                       # extension
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # extension
    logit_bias: dict | None = None                    # {"token id": bias in [-100, 100]}
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)   # extension
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)  # extension
    # Structured output (docs/serving.md, "Structured output"): OpenAI's response_format,
    # or one of vLLM's guided_* extensions.
    response_format: dict | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Accepted and ignored: hints that change nothing about the output (each one's reason).
    user: str | None = None               # an end-user id for abuse tracking; nothing is tracked
    safety_identifier: str | None = None  # OpenAI's successor of `user`; same
    prompt_cache_key: str | None = None   # a cache-routing hint; the prefix cache is automatic
    service_tier: str | None = None       # a price/latency tier; there is one tier here
    metadata: dict | None = None          # tags for stored completions (see `store`)
    store: bool | None = None             # store the completion at OpenAI: only false is honest

    @field_validator("store")
    @classmethod
    def _check_store(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("store=true is not supported (this server stores no completions)")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        return tuple(stops)

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if not 1 <= v <= MAX_N:
            raise ValueError(f"must be an integer in [1, {MAX_N}], got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict | None) -> dict[int, float] | None:
        """OpenAI's string keys ("123") to token ids; ids past the vocabulary are the engine's 400."""
        if not v:
            return None
        out = {}
        for key, bias in v.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"values must be numbers in [-100, 100], got {bias!r} for {key!r}")
            out[int(key)] = float(bias)
        return out

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError(f"must be token ids (integers >= 0), got {v}")
        return v

    def structured_output(self) -> StructuredOutput | None:
        """The one output constraint the request sets (response_format or a guided_*
        field), or None; APIError(400) naming the field for a bad or conflicting one."""
        given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
        if len(given) > 1:
            raise APIError(400, f"{given[1]}: cannot be combined with {given[0]} (give one constraint)",
                           param=given[1], code="invalid_value")
        if not given:
            return None
        try:
            if given[0] == "response_format":
                return from_response_format(self.response_format)
            return from_guided(self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        except ValueError as exc:
            text = str(exc)
            param = given[0] if given[0] != "response_format" else "response_format." + text.split(":")[0]
            if given[0] == "response_format":
                text = "response_format." + text
            raise APIError(400, text, param=param, code="invalid_value") from None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           param="stream_options", code="invalid_value")

    def stream_usage_mode(self) -> str:
        """"none", "final" (include_usage) or "continuous" (and continuous_usage_stats)."""
        o = self.stream_options
        if o is None or not o.include_usage:
            return "none"
        return "continuous" if o.continuous_usage_stats else "final"


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a batch (a list
    of either), parsed into a list of prompts; each prompt gets `n` choices."""

    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> list[str | list[int]]:
        """OpenAI's four shapes (a string, a list of token ids, a list of strings, a list of
        token-id lists) as a non-empty list of non-empty prompts."""
        if isinstance(v, str) or (isinstance(v, list) and v and all(map(_is_token_id, v))):
            v = [v]
        if not isinstance(v, list) or not v:
            raise ValueError("must be a string, a list of token ids (integers), or a non-empty "
                             "list of strings or of token-id lists (a batch)")
        for i, prompt in enumerate(v):
            where = f"prompt {i} of the batch" if len(v) > 1 else "the prompt"
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(map(_is_token_id, prompt)))):
                raise ValueError(f"{where} must be a string or a list of token ids (integers)")
            if not prompt:
                raise ValueError(f"{where} is empty")
        return v

    @model_validator(mode="after")
    def _check_batch_and_echo(self) -> "CompletionRequest":
        choices = len(self.prompt) * self.n
        if choices > MAX_N:
            param = "n" if self.n > 1 else "prompt"
            raise APIError(400, f"{param}: {len(self.prompt)} prompt(s) with n={self.n} ask for "
                           f"{choices} choices; at most {MAX_N} per request", param=param,
                           code="invalid_value")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo: cannot be combined with logprobs (that needs the prompt "
                           "tokens' log-probabilities, which this server does not compute); "
                           "send echo or logprobs, not both", param="echo", code="invalid_value")
        return self

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"must be an integer in [0, {MAX_LOGPROBS}], got {v}")
        return v

    def requested_logprobs(self) -> int | None:
        """SamplingParams.logprobs: alternatives per token, None = no logprobs."""
        return self.logprobs

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)  # n is validated first (a field of the base class)
        if v is not None and v != n:
            raise ValueError(f"only best_of equal to n ({n}) is supported, got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """An assistant message's earlier call (rendered back through the chat template)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict:
        # Templates (Qwen's, Hermes') write `arguments | tojson`: they expect an object.
        try:
            args = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": args}}


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema, passed to the template as given
    strict: bool | None = None      # accepted; nothing constrains decoding (docs/serving.md)


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # required, except in an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None           # tool messages: the call this answers

    @field_validator("content")
    @classmethod
    def _check_content(cls, v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
        raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')

    @model_validator(mode="after")
    def _check_role_fields(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: is required (it may be omitted only in an assistant "
                             "message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages have tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: is required in a tool message")
        return self

    def template_dict(self) -> dict:
        d: dict = {"role": self.role, "content": self.content if self.content is not None else ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}};
    # "required" and a named function are best effort (docs/serving.md, "Tools").
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: only the first call is returned

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"must be an integer in [0, {MAX_LOGPROBS}], got {v}")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs",
                           code="invalid_value")
        return self

    def requested_logprobs(self) -> int | None:
        """SamplingParams.logprobs: alternatives per token, None = no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tool_choice")
    @classmethod
    def _parse_tool_choice(cls, v: Any) -> str | NamedToolChoice:
        if v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict):
            return NamedToolChoice.model_validate(v)
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')

    @model_validator(mode="after")
    def _check_tool_choice(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise APIError(400, "tool_choice: is only allowed when tools are given",
                           param="tool_choice", code="invalid_value")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools}:
            raise APIError(400, f"tool_choice: function {choice.function.name!r} is not in tools",
                           param="tool_choice.function.name", code="invalid_value")
        return self

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template renders: none for tool_choice "none", only the named
        function for a named choice."""
        if not self.tools or self.tool_choice == "none":
            return None
        tools = self.tools
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.tool_choice.function.name]
        return [t.model_dump(exclude_none=True) for t in tools]

    def template_kwargs(self, tokenizer) -> dict:
        """{"tools": [...]} for the chat template, or {} without tools; 400 when the model's
        template cannot render tools (it never mentions `tools`: see --chat-template)."""
        tool_defs = self.template_tools()
        if not tool_defs:
            return {}
        if not getattr(tokenizer, "supports_tools", False):
            raise APIError(400, "tools: the model's chat template does not support tools (it "
                           "does not render a `tools` variable); start the server with a "
                           "--chat-template that does", param="tools", code="invalid_value")
        return {"tools": tool_defs}

    def structured_output(self) -> StructuredOutput | None:
        """As for every request, plus: tool_choice "required" or a named function is
        enforced by a grammar of `<tool_call>` blocks (`tools.call_grammar`), which cannot
        be combined with another constraint."""
        other = super().structured_output()
        if self.tool_choice != "required" and not isinstance(self.tool_choice, NamedToolChoice):
            return other
        if other is not None:
            raise APIError(400, "tool_choice: a required or named tool choice is itself a constraint "
                           "and cannot be combined with response_format or guided_* fields",
                           param="tool_choice", code="invalid_value")
        return StructuredOutput("lark", call_grammar(self.template_tools(),
                                                     parallel=self.parallel_tool_calls is not False))

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]


def parse_request(model: type[_Strict], body: bytes, allow_unknown: bool = False) -> Any:
    """Decode and validate a JSON body; raises APIError(400) naming the offending field.
    An unknown field is such a 400 unless allow_unknown (then it is dropped, and logged at
    debug level)."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, f"request body: JSON nested more than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    check_json_tree(data)
    ignored: list[str] | None = [] if allow_unknown else None
    try:
        request = model.model_validate(data, context={"ignored": ignored})
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if ignored:
        log.debug("ignored %d unknown request field(s) (--allow-unknown-fields): %s",
                  len(ignored), ", ".join(sorted(set(ignored))))
    request.check_stream_options()
    return request


def check_json_tree(data: Any) -> None:
    """Refuse (400) JSON nested deeper than MAX_JSON_DEPTH and strings that are not valid
    Unicode (a lone surrogate such as "\\ud800" decodes but cannot be encoded, so it would
    fail later, in the tokenizer). Iterative: no recursion limit to hit."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, loc, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, loc)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            field = str(loc[0]) if loc else None
            raise APIError(400, f"{field or 'request body'}: JSON nested more than {MAX_JSON_DEPTH} "
                           "levels", param=field, code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_unicode(key, loc)
            stack.append((item, (*loc, key), depth + 1))


def _check_unicode(text: str, loc: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = format_param(loc) or "request body"
        raise APIError(400, f"{param}: not valid Unicode (a lone surrogate at character "
                       f"{exc.start})", param=format_param(loc) or None, code="invalid_value") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    param = format_param(err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":  # OpenAI's wording; the server flag to accept extras
        return APIError(400, f"Unrecognized request argument supplied: {param} (the server "
                        "refuses unknown fields unless started with --allow-unknown-fields)",
                        param=param, code="unknown_parameter")
    if err["type"] == "missing":
        message = "is required"
    code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
    return APIError(400, f"{param}: {message}", param=param, code=code)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def format_param(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# ---------------------------------------------------------------------------- to the engine
# OpenAI's (and vLLM's --generation-config vllm) defaults: sampling left untouched.
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def resolve_sampling_defaults(model_defaults: dict | None) -> dict:
    """NEUTRAL_SAMPLING overlaid with the model's own values (`--generation-config auto`)."""
    return {**NEUTRAL_SAMPLING, **{k: v for k, v in (model_defaults or {}).items() if k in NEUTRAL_SAMPLING}}


def sampling_params(request: _GenerationRequest, max_tokens: int,
                    defaults: dict | None = None) -> SamplingParams:
    """SamplingParams for a validated request; `max_tokens` is already resolved. A sampling
    field the request omits takes `defaults` (resolve_sampling_defaults; neutral if None)."""
    d = defaults or NEUTRAL_SAMPLING

    def pick(name: str):
        value = getattr(request, name)
        return d.get(name, NEUTRAL_SAMPLING[name]) if value is None else value
    try:
        return SamplingParams(temperature=pick("temperature"), top_p=pick("top_p"),
                              top_k=pick("top_k"), min_p=pick("min_p"), max_tokens=max_tokens,
                              seed=request.seed, stop=request.stop, ignore_eos=request.ignore_eos,
                              presence_penalty=request.presence_penalty,
                              frequency_penalty=request.frequency_penalty,
                              repetition_penalty=pick("repetition_penalty"),
                              logit_bias=request.logit_bias, min_tokens=request.min_tokens,
                              stop_token_ids=request.stop_token_ids,
                              logprobs=request.requested_logprobs(),
                              structured=request.structured_output())
    except ValueError as exc:  # the protocol checks first, so this is a belt-and-braces path
        raise APIError(400, str(exc), param=engine_error_param(str(exc))) from None


def spec_override(request: _GenerationRequest) -> SpecOverride | None:
    """The request's speculative options as a SpecOverride, or None."""
    s = request.speculative
    if s is None:
        return None
    return SpecOverride(method=s.method, num_tokens=s.num_tokens, adaptive=s.adaptive)


_KNOWN_PARAMS = ("speculative.method", "speculative.num_tokens", "speculative.adaptive",
                 "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "stop",
                 "prompt", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                 "min_tokens", "response_format")


def engine_error_param(message: str) -> str | None:
    """Best guess at the field an engine ValueError is about (its message starts with it)."""
    for name in _KNOWN_PARAMS:
        if message.startswith(name):
            return name
    return None


# ---------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` (prompt tokens served from the
    prefix cache) when cached_tokens is given."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def spec_summary(stats: SpecStats, method: str) -> dict:
    """The `spec` extension: acceptance summary plus the raw per-position counts."""
    return {
        "method": method,
        "num_drafts": stats.num_drafts,
        "drafted": stats.num_draft_tokens,
        "accepted": stats.num_accepted_tokens,
        "acceptance_per_position": stats.acceptance_per_position,
        "mean_accepted_len": stats.mean_accepted_len,
        "accepted_per_position": list(stats.accepted_per_position),
        "drafted_per_position": list(stats.drafted_per_position),
        "proposers": stats.proposers_dict(),
    }


def merge_spec(summaries: list[dict]) -> dict:
    """One `spec` for n sibling choices (spec_summary dicts): counts summed, rates recomputed."""
    if len(summaries) == 1:
        return summaries[0]
    stats = SpecStats.summed([SpecStats(s["num_drafts"], s["drafted"], s["accepted"], list(s["accepted_per_position"]),
                                        list(s["drafted_per_position"]),
                                        by_proposer={n: [c["drafted"], c["accepted"]] for n, c in s["proposers"].items()})
                              for s in summaries])
    return spec_summary(stats, summaries[0]["method"])


def merge_usage(usages: list[dict], n: int) -> dict:
    """The usage of sibling choices, n consecutive ones per prompt: each prompt (and its
    cached tokens) counted once, from its first choice; completion tokens summed."""
    firsts = usages[::n]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in firsts if "prompt_tokens_details" in u]
    return usage(sum(u["prompt_tokens"] for u in firsts), sum(u["completion_tokens"] for u in usages),
                 sum(cached) if cached else None)


def now() -> int:
    return int(time.time())


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str,
                        usage_: dict, spec: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_, "spec": spec}


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str,
                  usage_: dict, spec: dict) -> dict:
    message = {"role": "assistant", "content": text}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_, "spec": spec}


def completion_chunk(rid: str, created: int, model: str, text: str,
                     finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


MIN_LOGPROB = -9999.0  # what a -inf logprob (a token the filters removed) is written as (OpenAI's)


def _lp(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # -inf and anything below; JSON has no -inf


def completion_logprobs(tokens: list[tuple[int, tuple]], token_text, offset: int = 0) -> dict:
    """The completions API's `logprobs` for (token id, (logprob, top)) pairs: token strings,
    their logprobs, per token {token string: logprob} of the top N plus the sampled token
    (OpenAI: up to N + 1 entries), and each token's character offset in the completion text
    starting at `offset` (offsets are of the tokens' own strings, see docs/serving.md)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, (lp, top) in tokens:
        text = token_text(tid)
        alternatives = {token_text(t): _lp(v) for t, v in top}
        alternatives.setdefault(text, _lp(lp))
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokens: list[tuple[int, tuple]], token_text) -> dict:
    """The chat API's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(tid: int, lp: float) -> dict:
        text = token_text(tid)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in top]}
                        for tid, (lp, top) in tokens], "refusal": None}


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_: dict) -> dict:
    """The final stream chunk of `stream_options.include_usage`: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_}


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
