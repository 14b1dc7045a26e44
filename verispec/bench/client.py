"""Clients that send one chat request and return the raw streamed evidence.

`ChatBackend` is the interface the protocol runner talks to; `OpenAIHTTPBackend` implements it
for any OpenAI-compatible server (verispec, vLLM, SGLang, llama.cpp). An in-process engine
backend can implement the same two methods later. A backend never raises for a failed request:
it returns a `StreamResult` whose `error` says what went wrong, so every failure is recorded.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion request as the harness sends it."""

    messages: tuple[dict, ...]
    model: str
    max_tokens: int
    temperature: float
    seed: int | None = None
    extra_body: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkEvent:
    """One parsed SSE chunk and the moment it was read (seconds after the request was sent)."""

    t: float
    text: str                          # choices[0].delta.content ("" if none)
    usage_completion_tokens: int | None  # cumulative usage in this chunk, if the server sent it
    token_count: int | None            # the server's own count for this chunk (len(token_ids))
    has_choice: bool                   # False for the usage-only chunk that ends a stream
    finish_reason: str | None


@dataclass(frozen=True)
class RequestError:
    """Why a request did not complete; stored verbatim in the record."""

    kind: str
    message: str
    http_status: int | None = None
    body: str | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message, "http_status": self.http_status,
                "body": self.body}


@dataclass
class StreamResult:
    """Everything observed for one request, before any derived metric is computed."""

    start_unix: float
    http_status: int | None = None
    events: list[ChunkEvent] = field(default_factory=list)
    usage: dict | None = None          # the last `usage` object seen
    saw_done: bool = False
    finish_reason: str | None = None
    spec: dict | None = None           # verispec's per-response speculation stats
    error: RequestError | None = None
    e2e_s: float | None = None

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)


class ChatBackend(Protocol):
    """What the runner needs from a server: stream one chat request; list models."""

    async def chat(self, request: ChatRequest) -> StreamResult: ...

    async def list_models(self) -> list[str]: ...

    async def aclose(self) -> None: ...


_BODY_LIMIT = 4000  # characters of an error body kept in the record


class OpenAIHTTPBackend:
    """Streams /v1/chat/completions over HTTP with usage in the stream; one instance per run."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 continuous_usage: bool = True, keepalive: bool = True):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.continuous_usage = continuous_usage
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No connection-pool limit below the semaphore's: the runner decides concurrency.
        # keepalive=False: a new connection per request, for servers that close kept-alive
        # connections after a few requests (llama-server's HTTP library: after 5), where a
        # request sent on one just closed fails with "Server disconnected".
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None if keepalive else 0)
        self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s), limits=limits)

    def body(self, request: ChatRequest) -> dict:
        """The JSON body sent for `request` (extra_body keys override ours, on purpose)."""
        stream_options = {"include_usage": True}
        if self.continuous_usage:
            # vLLM/SGLang put cumulative usage in every chunk: exact tokens per chunk.
            stream_options["continuous_usage_stats"] = True
        body = {"model": request.model, "messages": list(request.messages),
                "max_tokens": request.max_tokens, "temperature": request.temperature,
                "stream": True, "stream_options": stream_options}
        if request.seed is not None:
            body["seed"] = request.seed
        body.update(request.extra_body)
        return body

    async def chat(self, request: ChatRequest) -> StreamResult:
        """Send one streamed request; never raises for request-level failures."""
        result = StreamResult(start_unix=time.time())
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._stream(request, result, t0), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            result.error = RequestError("timeout", f"no complete response within {self.timeout_s} s",
                                        result.http_status)
        except httpx.HTTPError as e:
            result.error = RequestError("transport", f"{type(e).__name__}: {e}", result.http_status)
        result.e2e_s = time.perf_counter() - t0
        if result.error is None:
            result.error = _completion_problem(result)
        return result

    async def _stream(self, request: ChatRequest, result: StreamResult, t0: float) -> None:
        url = f"{self.base_url}/chat/completions"
        async with self._client.stream("POST", url, json=self.body(request)) as response:
            result.http_status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")[:_BODY_LIMIT]
                result.error = RequestError("http_status", f"HTTP {response.status_code}",
                                            response.status_code, body)
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # SSE comments, event names and blank separators
                payload = line[5:].strip()
                if payload == "[DONE]":
                    result.saw_done = True
                    continue
                if not _absorb_chunk(payload, time.perf_counter() - t0, result):
                    return

    async def list_models(self) -> list[str]:
        """Model ids from /v1/models, or [] if the server does not answer it."""
        try:
            r = await self._client.get(f"{self.base_url}/models", timeout=30)
            return [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []

    async def aclose(self) -> None:
        await self._client.aclose()


def _absorb_chunk(payload: str, t: float, result: StreamResult) -> bool:
    """Parse one SSE data payload into `result`; False (with result.error set) stops the stream."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as e:
        result.error = RequestError("bad_chunk", f"chunk is not JSON ({e.msg})", result.http_status,
                                    payload[:_BODY_LIMIT])
        return False
    if not isinstance(obj, dict):
        result.error = RequestError("bad_chunk", "chunk is not a JSON object", result.http_status,
                                    payload[:_BODY_LIMIT])
        return False
    if "error" in obj:  # servers report mid-stream failures as a data line with an error
        result.error = RequestError("http_status", "error object in stream", result.http_status,
                                    payload[:_BODY_LIMIT])
        return False
    usage = obj.get("usage")
    if isinstance(usage, dict):
        result.usage = usage
    choices = obj.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    spec = obj.get("spec", choice.get("spec"))
    if isinstance(spec, dict):
        result.spec = spec
    delta = choice.get("delta") or {}
    token_ids = choice.get("token_ids")
    finish = choice.get("finish_reason")
    if finish:
        result.finish_reason = finish
    cum = usage.get("completion_tokens") if isinstance(usage, dict) else None
    result.events.append(ChunkEvent(
        t=t, text=delta.get("content") or "",
        usage_completion_tokens=cum if isinstance(cum, int) and not isinstance(cum, bool) else None,
        token_count=len(token_ids) if isinstance(token_ids, list) else None,
        has_choice=bool(choice), finish_reason=finish))
    return True


def _completion_problem(result: StreamResult) -> RequestError | None:
    """The first reason a stream that closed cleanly still is not a complete response."""
    if not result.saw_done:
        return RequestError("stream_truncated", "stream ended without data: [DONE]",
                            result.http_status)
    if result.finish_reason is None:
        return RequestError("no_finish_reason", "no chunk carried a finish_reason",
                            result.http_status)
    usage = result.usage or {}
    for key in ("prompt_tokens", "completion_tokens"):
        value = usage.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            # Never fall back to counting words: a run without exact counts is not evidence.
            return RequestError("missing_usage", f"usage.{key} missing from the stream "
                                "(stream_options.include_usage not honoured?)", result.http_status)
    return None
