"""HTTP routes of the OpenAI-compatible server (Starlette on uvicorn).

    POST /v1/completions, /v1/chat/completions   JSON or SSE (stream=true)
    GET  /v1/models                               the one served model
    GET  /health                                  engine liveness, KV usage, integrity check when idle
    GET  /metrics                                 Prometheus text format (vLLM's metric names)
    POST /tokenize, /detokenize                   vLLM's tokenizer endpoints (API key as /v1)
    GET  /version                                 {"version": ...} (open, like /health)

Security defaults: binds 127.0.0.1; with an API key (--api-key or VERISPEC_API_KEY) every
/v1 route needs `Authorization: Bearer <key>` (compared in constant time); /health and
/metrics stay open for probes and scrapers. Request bodies are capped while they are read.
A client that disconnects (streaming or not) has its request aborted, which frees its KV
blocks at once. Slow clients and browsers are guarded against (verispec/server/guard.py,
docs/serving.md): header, body and keep-alive timeouts; a connection cap below the
descriptor limit that evicts idle connections first; without an API key, only loopback
Host/Origin names (or --allowed-hosts); JSON-only POST bodies.

The CLI calls `add_arguments(parser)` and `serve(engine_factory, args)`; tests can call
`create_app(engine, ServerConfig(...))` and talk to it in-process.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, fields
from typing import Any, AsyncIterator, Callable, NamedTuple

import uvicorn
from pydantic import Field
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import verispec
from verispec.config import GENERATION_CONFIGS
from verispec.outputs import RequestOutput
from verispec.request import choice_params
from verispec.sampling import SamplingParams
from verispec.server import guard
from verispec.server import protocol as P
from verispec.server import tools
from verispec.server.async_engine import (AsyncEngine, EngineClosed, EngineStartError, QueueFull,
                                          RequestFailed, RequestStream)
from verispec.server.metrics import ServerMetrics
from verispec.server.prompts import PromptTooLong, check_length, longest_token_chars

log = logging.getLogger("verispec.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: rest of context
API_KEY_ENV = "VERISPEC_API_KEY"
HEALTH_PROBE_S = 0.05  # /health waits this long for the core's own answer, then reports what it knows


@dataclass(frozen=True)
class ServerConfig:
    """Server settings (the engine's are separate); built once from flags."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 1 << 20
    served_model_name: str | None = None
    shutdown_timeout_s: float = 10.0
    max_buffered_outputs: int = 1024  # outputs a stream may hold unread before it is aborted
    log_level: str = "info"
    access_log: bool = True
    stall_timeout_s: float = 30.0  # /health fails when work waits this long with no step done
    # Slow clients and descriptor exhaustion (verispec/server/guard.py, docs/serving.md).
    header_timeout_s: float = 10.0     # to complete a request's headers
    body_timeout_s: float = 30.0       # to receive a whole declared body, from its headers
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 1024        # also capped at RLIMIT_NOFILE's soft limit - fd_reserve
    fd_reserve: int = 128              # descriptors left to the process itself and accept bursts
    allowed_hosts: tuple[str, ...] | None = None  # Host names beyond loopback; None: not given
    metrics_prefix: str = "vllm"       # /metrics names: vLLM's ("vllm:*") or "verispec:*"
    allow_unknown_fields: bool = False  # unknown request fields: 400 naming them, or ignored (logged)
    generation_config: str = "auto"    # omitted sampling fields: the model's values, or "vllm": neutral

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_buffered_outputs < 1:
            raise ValueError(f"max_buffered_outputs must be >= 1, got {self.max_buffered_outputs}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout must be > 0, got {self.stall_timeout_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to disable authentication)")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.removesuffix('_s')} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.fd_reserve < 0:
            raise ValueError(f"fd_reserve must be >= 0, got {self.fd_reserve}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}")
        if self.metrics_prefix not in ("vllm", "verispec"):
            raise ValueError(f"metrics_prefix must be 'vllm' or 'verispec', got {self.metrics_prefix!r}")
        # "a,b" or names with ports -> bare lowercase names, so the policy compares like with like
        object.__setattr__(self, "allowed_hosts", guard.parse_allowed_hosts(self.allowed_hosts))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        """Every field from its flag (`--name`; seconds drop the `_s`: `--stall-timeout`), or
        its default when the flag is absent; the API key may come from VERISPEC_API_KEY."""
        values = {f.name: getattr(args, f.name.removesuffix("_s"), f.default) for f in fields(cls)}
        values["api_key"] = values["api_key"] or os.environ.get(API_KEY_ENV) or None
        return cls(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server's flags (not the engine's) to `parser`."""
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set {API_KEY_ENV}; "
                        "the variable keeps the key out of the process list)")
    g.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="requests allowed to wait for the engine; beyond it: HTTP 429")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body accepted; beyond it: HTTP 413")
    g.add_argument("--max-buffered-outputs", type=int, default=d.max_buffered_outputs,
                   help="engine outputs a stream may hold while its client does not read; beyond "
                        "it the request is aborted (bounds the memory a stalled client can pin)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the engine's model name)")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds in-flight requests get to finish on shutdown before they are aborted")
    g.add_argument("--log-level", default=d.log_level,
                   choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=d.access_log)
    g.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="seconds requests may wait with no engine step completed before /health "
                        "answers 503 (raise it for models whose longest step takes longer)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a connection gets to send a request's complete headers, from "
                        "opening or from the end of its previous response (then: closed)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds a request gets to send its whole body after its headers (then: 408)")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout_s,
                   help="seconds an idle kept-alive connection stays open")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections kept (also at most the descriptor limit minus "
                        "--fd-reserve); at the cap a new one evicts the longest idle connection")
    g.add_argument("--fd-reserve", type=int, default=d.fd_reserve,
                   help="file descriptors (of `ulimit -n`) the connection cap leaves to the process")
    g.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names accepted besides loopback and the bind address "
                        "('*': any); without an API key only those are served (DNS-rebinding "
                        "protection), with one the check is off unless this is given")
    g.add_argument("--metrics-prefix", choices=["vllm", "verispec"], default=d.metrics_prefix,
                   help="name /metrics like vLLM ('vllm:*', for vLLM's dashboards) or 'verispec:*'; "
                        "verispec-only metrics are 'verispec:*' either way (docs/serving.md)")
    g.add_argument("--allow-unknown-fields", action="store_true", default=d.allow_unknown_fields,
                   help="ignore request fields this server does not know (logged at debug level) "
                        "instead of answering 400 'Unrecognized request argument supplied'")
    g.add_argument("--generation-config", choices=GENERATION_CONFIGS, default=d.generation_config,
                   help="sampling defaults for fields a request omits (temperature, top_p, top_k, "
                        "min_p, repetition_penalty): 'auto' takes the model's generation_config.json "
                        "values (vLLM's default), 'vllm' OpenAI's neutral ones (1, 1, off, 0, 1)")


def serve(engine_factory: Callable[[], Any], args: argparse.Namespace) -> int:
    """Build the engine in its own process, then serve it until SIGINT/SIGTERM or until
    that process dies; returns the exit status (1 when the engine died: a supervisor should
    restart the server).

    `engine_factory` builds the engine inside the engine-core process, so it must pickle
    (a module-level function or a functools.partial of one).
    """
    config = ServerConfig.from_args(args)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=config.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.api_key is None and not _is_loopback(config.host):
        log.warning("listening on %s without an API key: anyone who can reach it can use it",
                    config.host)
    engine = AsyncEngine.spawn(engine_factory, max_waiting=config.max_waiting,
                               max_buffered_outputs=config.max_buffered_outputs, log_level=config.log_level)
    try:
        engine.launch()
    except EngineStartError as exc:
        raise (ValueError if exc.bad_input else RuntimeError)(str(exc)) from None
    log.info("engine core pid %d, config as run: %s", engine.engine_pid, engine.info.config)
    app = create_app(engine, config)
    # uvicorn's own grace period is only a backstop: the engine drain below ends every stream
    # (normally or with an error event) first, so no client sees a connection cut mid-body.
    plan = guard.plan_connections(config.max_connections, config.fd_reserve)
    guard.log_connection_plan(plan, config.max_connections, config.fd_reserve)
    http = guard.guarded_protocol(guard.ConnectionGuard(plan.cap, config.header_timeout_s))
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, lifespan="on",
        access_log=config.access_log, server_header=False,
        timeout_graceful_shutdown=round(config.shutdown_timeout_s) + 5,
        http=http, ws="none", timeout_keep_alive=config.keep_alive_timeout_s, backlog=plan.backlog)
    server = DrainingServer(uv_config, engine, config.shutdown_timeout_s)

    def on_death(why: str) -> None:
        server.should_exit = True  # requests in flight already ended with the cause
    engine.on_death = on_death
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind or start
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        engine.kill()
    if engine.death is not None:
        log.error("exiting: %s", engine.death)
        return 1
    return 0 if server.started else 1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains the engine while uvicorn waits for connections to close."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain_timeout_s: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.ensure_future(self.async_engine.drain(self.drain_timeout_s))
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)


def create_app(engine, config: ServerConfig = ServerConfig()) -> Starlette:
    """The ASGI app serving `engine`: an AsyncEngine (serve: its core in another process) or
    an engine object, then run on a thread of this process (tests). The core is launched
    here; the app connects to it, and stops it, with the lifespan."""
    if not isinstance(engine, AsyncEngine):
        engine = AsyncEngine(engine, max_waiting=config.max_waiting,
                             max_buffered_outputs=config.max_buffered_outputs)
    engine.launch()
    server = OpenAIServer(engine, config)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        log.info("serving %s (max_model_len=%d, speculation=%s, sampling defaults (--generation-config "
                 "%s): %s)", server.model_name, engine.max_model_len, engine.spec_method,
                 config.generation_config, server.sampling_defaults)
        try:
            yield
        finally:
            # uvicorn already gave in-flight requests the graceful window; abort leftovers.
            await server.async_engine.shutdown(drain_timeout_s=1.0)

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/version", server.version, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_exception})
    app.state.server = server
    hosts = guard.host_policy(config.host, config.api_key, config.allowed_hosts)
    guard.log_host_policy(hosts, config.host, api_key_set=config.api_key is not None)
    app.add_middleware(guard.RequestGuard, hosts=hosts, body_timeout_s=config.body_timeout_s,
                       on_reject=server.metrics.on_rejected)
    return app


def _api(handler):
    """Turn APIError (and any bug) raised by a route into an OpenAI-style error response."""
    async def wrapped(self: "OpenAIServer", request: Request) -> Response:
        try:
            return await handler(self, request)
        except P.APIError as exc:
            if exc.rejected:
                self.metrics.on_rejected(exc.status)
            return JSONResponse(exc.body(), exc.status, headers=exc.headers)
        except ClientDisconnect:  # left while sending its body: nobody to answer, nothing to log
            return Response(status_code=499)
        except Exception:
            log.exception("unhandled error in %s", request.url.path)
            body = P.error_body("internal server error", type="server_error", code="internal_error")
            return JSONResponse(body, 500)
    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


class OpenAIServer:
    """Route handlers over one AsyncEngine."""

    def __init__(self, async_engine: AsyncEngine, config: ServerConfig):
        self.async_engine = async_engine
        self.config = config
        self.tokenizer = async_engine.tokenizer
        self.max_token_chars = longest_token_chars(self.tokenizer)
        # Parsing and tokenizing run here, off the event loop. One thread: they hold the
        # interpreter lock, so a second would add no throughput, only contention.
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="verispec-prepare")
        self._preparing = 0   # requests admitted, not yet handed to the engine
        self.model_name = config.served_model_name or async_engine.model_name
        self.created = P.now()
        self.metrics = ServerMetrics(self.model_name, stats_source=lambda: async_engine.latest_stats,
                                     prefix=config.metrics_prefix, max_model_len=async_engine.max_model_len)
        self.fingerprint = system_fingerprint(async_engine.info)
        model_defaults = getattr(async_engine.info, "sampling_defaults", None) or {}
        self.sampling_defaults = P.resolve_sampling_defaults(
            model_defaults if config.generation_config == "auto" else None)
        async_engine.observer = self.metrics

    # ------------------------------------------------------------------ plain routes
    async def health(self, request: Request) -> Response:
        """Liveness and engine state, answered within HEALTH_PROBE_S: 503 when the engine
        process is gone, when requests have waited stall_timeout_s with no step completed,
        or when the idle KV integrity check failed. Error texts need the API key."""
        ae = self.async_engine
        shown = self._has_key(request)
        body: dict[str, Any] = {"status": "ok", "model": self.model_name, "accepting": ae.accepting,
                                "in_flight": ae.num_in_flight, "engine_pid": ae.engine_pid,
                                "last_step_error": _shown(ae.last_step_error, shown)}
        if not ae.is_alive:
            return JSONResponse({**body, "status": "unavailable", "error": ae.death}, 503)
        stalled = ae.stalled_for()
        if stalled is not None and stalled > self.config.stall_timeout_s:
            return JSONResponse({**body, **_stats_dict(ae.latest_stats), "status": "stalled",
                                 "error": f"no engine step completed for {stalled:.1f} s with "
                                          f"{ae.num_in_flight} request(s) in flight"}, 503)
        try:
            stats, integrity = await ae.health(timeout_s=HEALTH_PROBE_S)
        except (asyncio.TimeoutError, EngineClosed):
            stats, integrity = ae.latest_stats, "skipped: engine busy"
        failed = integrity.startswith("failed")
        body.update(_stats_dict(stats), integrity="failed: " + _shown(integrity[8:], shown)
                    if failed else integrity)
        if failed:
            body["status"] = "degraded"
            return JSONResponse(body, 503)
        return JSONResponse(body)

    async def metrics_endpoint(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, headers={"content-type": content_type})

    @_api
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "verispec", "max_model_len": self.async_engine.max_model_len,
                "sampling_defaults": self.sampling_defaults}
        return JSONResponse({"object": "list", "data": [card]})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": verispec.__version__})

    # ------------------------------------------------------------------ tokenizer routes
    @_api
    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {"prompt": str} or {"messages": [...]} -> the token ids."""
        self._authorize(request)
        ids = await self._prepare(request, self._parse_tokenize, admit=False)
        return JSONResponse({"tokens": ids, "count": len(ids),
                             "max_model_len": self.async_engine.max_model_len})

    @_api
    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {"tokens": [...]} -> {"prompt": text}."""
        self._authorize(request)
        text = await self._prepare(request, self._parse_detokenize, admit=False)
        return JSONResponse({"prompt": text})

    def _parse_tokenize(self, body: bytes) -> list[int]:
        data = _json_object(body)
        model = TokenizeChatRequest if "messages" in data and "prompt" not in data else TokenizeRequest
        req = P.parse_request(model, body, self.config.allow_unknown_fields)
        self._check_model(req.model)
        limit = self.async_engine.max_model_len
        if model is TokenizeRequest:
            text, param = req.prompt, "prompt"
            encode = lambda: list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))  # noqa: E731
        else:
            messages, param = req.message_dicts(), "messages"
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            except Exception as exc:  # the template rejecting a conversation is bad input
                raise P.APIError(400, f"messages: the chat template rejected them: {exc}",
                                 param="messages", code="invalid_value") from None
            encode = lambda: list(self.tokenizer.encode_chat(  # noqa: E731
                messages, add_generation_prompt=req.add_generation_prompt))
        try:  # refuse what cannot fit the context before tokenizing it whole (prompts.py)
            check_length(self.tokenizer, text, limit, self.max_token_chars)
        except PromptTooLong as exc:
            raise P.APIError(400, f"{param}: at least {exc.at_least} tokens; the context is {limit} tokens",
                             param=param, code="context_length_exceeded") from None
        ids = encode()
        if len(ids) > limit:
            raise P.APIError(400, f"{param}: {len(ids)} tokens; the context is {limit} tokens",
                             param=param, code="context_length_exceeded")
        return ids

    def _parse_detokenize(self, body: bytes) -> str:
        req = P.parse_request(DetokenizeRequest, body, self.config.allow_unknown_fields)
        self._check_model(req.model)
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in req.tokens):
            raise P.APIError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens",
                             code="invalid_value")
        return self.tokenizer.decode(req.tokens)

    # ------------------------------------------------------------------ generation routes
    @_api
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        req, prompts = await self._prepare(request, self._parse_completion)
        runs = []
        for i, prompt in enumerate(prompts):
            with _batch_item(i, len(prompts)):
                max_tokens = self._resolve_max_tokens(req.max_tokens, "max_tokens", len(prompt.ids), "prompt",
                                                      DEFAULT_COMPLETION_MAX_TOKENS)
            runs.append((prompt.ids, P.sampling_params(req, max_tokens, self.sampling_defaults)))
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._start(rid, runs, req)
        echo = [prompt.echo for prompt in prompts for _ in range(req.n)] if req.echo else None
        return await self._respond(request, stream, "completion", req, echo)

    @_api
    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        req, prompt_ids = await self._prepare(request, self._parse_chat)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._resolve_max_tokens(req.requested_max_tokens(), param, len(prompt_ids),
                                              "messages", None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        params = P.sampling_params(req, max_tokens, self.sampling_defaults)
        stream = await self._start(rid, [(prompt_ids, params)], req)
        return await self._respond(request, stream, "chat", req)

    async def _respond(self, request: Request, stream: RequestStream | SiblingStreams, kind: str,
                       req, echo: list[str] | None = None) -> Response:
        """The response of one started request: one choice is one RequestStream, several (n > 1,
        a batch of prompts) the SiblingStreams of its choices (docs/serving.md, "logprobs
        and n"). echo: per choice, the prompt text its text starts with (completions' echo)."""
        siblings = stream.streams if isinstance(stream, SiblingStreams) else [stream]
        if req.stream:
            if len(siblings) == 1:
                events = self._choice_events(stream, kind, req, req.stream_usage_mode(),
                                             echo[0] if echo else None)
            else:
                events = self._merged_events(stream, kind, req, echo)
            return SSEResponse(events, stream)
        try:
            outs = await _collect(siblings, request)
        except (RequestFailed, EngineClosed) as exc:
            raise _failure(exc, rejected=False) from None
        if outs is None:  # the client went away; its request is already aborted
            return Response(status_code=499)
        bodies = [self._body(kind, req, stream.request_id, out, stream.method) for out in outs]
        for b, text in zip(bodies, echo or ()):
            b["choices"][0]["text"] = text + b["choices"][0]["text"]
        body = bodies[0]
        if len(bodies) > 1:
            body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
            body["usage"] = P.merge_usage([b["usage"] for b in bodies], stream.n)
            body["spec"] = P.merge_spec([b["spec"] for b in bodies])
        return JSONResponse(body)

    def _body(self, kind: str, req, rid: str, out: RequestOutput, method: str) -> dict:
        """The response body of one finished output (its choice is choices[0])."""
        build = P.completion_response if kind == "completion" else P.chat_response
        body = build(rid, P.now(), self.model_name, out.text, out.finish_reason,
                     _usage(out), P.spec_summary(out.spec, method))
        body["system_fingerprint"] = self.fingerprint
        if out.logprobs is not None:
            body["choices"][0]["logprobs"] = self._logprobs(kind, list(zip(out.token_ids, out.logprobs)))
        if kind == "chat" and req.template_tools():  # <tool_call> blocks -> message.tool_calls
            tools.apply_to_response(body, req.parallel_tool_calls is not False)
        return body

    def _choice_events(self, stream: RequestStream, kind: str, req, usage_mode: str,
                       echo: str | None = None) -> AsyncIterator[bytes]:
        events = self._events(stream, kind, usage_mode, echo)
        if kind == "chat" and req.template_tools():  # <tool_call> blocks -> delta.tool_calls
            events = tools.stream_events(events, req.parallel_tool_calls is not False)
        return events

    async def _merged_events(self, siblings: SiblingStreams, kind: str, req,
                             echo: list[str] | None = None) -> AsyncIterator[bytes]:
        """The SSE events of several choices: each sibling's own events (echo or role chunk,
        content, finish) as they come, relabelled with the request's id and the choice's
        `index`; the siblings' usage chunks summed into one at the end; one [DONE]. A
        sibling's error event ends the stream at once and aborts the others."""
        rid, created, model = siblings.request_id, P.now(), self.model_name
        usage_mode = req.stream_usage_mode()
        count = len(siblings.streams)
        # bounded: a stalled client stalls the pumps, so each sibling's own output buffer
        # limit (--max-buffered-outputs) still applies
        queue: asyncio.Queue = asyncio.Queue(maxsize=count)

        async def pump(i: int, events: AsyncIterator[bytes]) -> None:
            try:
                async for event in events:
                    await queue.put((i, event))
            except Exception as exc:  # a bug: raised again by the merger
                await queue.put((i, exc))
            else:
                await queue.put((i, None))
            finally:
                await events.aclose()

        tasks = [asyncio.ensure_future(pump(i, self._choice_events(s, kind, req, usage_mode,
                                                                   echo[i] if echo else None)))
                 for i, s in enumerate(siblings.streams)]
        usages: list = [None] * count
        specs: list = [None] * count
        live = count
        try:
            while live:
                i, event = await queue.get()
                if event is None:
                    live -= 1
                    continue
                if isinstance(event, BaseException):
                    raise event
                payload = event[len(b"data: "):].strip()
                if payload == b"[DONE]":
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    siblings.abort()
                    yield event
                    break
                if not obj.get("choices"):  # a sibling's usage chunk: summed below
                    usages[i], specs[i] = obj["usage"], obj["spec"]
                    continue
                obj["id"], obj["created"] = rid, created
                obj["choices"][0]["index"] = i
                yield P.sse(obj)
            else:
                if usage_mode != "none":
                    obj_kind = "text_completion" if kind == "completion" else "chat.completion.chunk"
                    yield P.sse({**P.usage_chunk(rid, created, model, obj_kind, P.merge_usage(usages, siblings.n)),
                                 "system_fingerprint": self.fingerprint, "spec": P.merge_spec(specs)})
            yield P.sse("[DONE]")
        finally:
            siblings.abort()  # no-op for those that finished
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _token_text(self, token_id: int) -> str:
        """A token's own text (special tokens included); a token that is part of a UTF-8
        character decodes to U+FFFD, and its `bytes` are those of that text."""
        cache = self.__dict__.setdefault("_token_texts", {})
        text = cache.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except TypeError:  # a tokenizer without the keyword (test doubles)
                text = self.tokenizer.decode([token_id])
            cache[token_id] = text
        return text

    def _logprobs(self, kind: str, tokens: list, offset: int = 0) -> dict:
        if kind == "completion":
            return P.completion_logprobs(tokens, self._token_text, offset)
        return P.chat_logprobs(tokens, self._token_text)

    async def _events(self, stream: RequestStream, kind: str, usage_mode: str,
                      echo: str | None = None) -> AsyncIterator[bytes]:
        """SSE events of one request, one per engine step that added text; `spec` rides on the
        last chunk before [DONE]. usage_mode: "none", "final" (stream_options.include_usage:
        `usage: null` on every chunk, then a usage chunk) or "continuous" (also
        continuous_usage_stats: each chunk carries the usage so far, as vLLM does). echo:
        the prompt text, sent as the first chunk (completions' `echo`)."""
        rid, created, model = stream.request_id, P.now(), self.model_name
        fingerprint = self.fingerprint

        def chunk(text: str | None, finish_reason: str | None, completion_tokens: int,
                  cached: int = 0) -> dict:
            if kind == "completion":
                c = P.completion_chunk(rid, created, model, text or "", finish_reason)
            else:
                delta = {} if text is None else {"content": text}
                c = P.chat_chunk(rid, created, model, delta, finish_reason)
            c["system_fingerprint"] = fingerprint
            if usage_mode != "none":
                c["usage"] = (P.usage(stream.prompt_len, completion_tokens, cached)
                              if usage_mode == "continuous" else None)
            return c

        # logprobs ride with the chunk that carries their tokens' text: tokens whose text is
        # held back (a possible stop string) wait for the chunk that releases it, and any
        # left ride on the last chunk (docs/serving.md, "logprobs and n")
        pending: list = []
        offset = 0

        def with_logprobs(c: dict) -> dict:
            nonlocal pending, offset
            if pending:
                c["choices"][0]["logprobs"] = self._logprobs(kind, pending, offset)
                offset += sum(len(self._token_text(t)) for t, _ in pending)
                pending = []
            return c

        try:
            if echo:
                yield P.sse(chunk(echo, None, 0))
            if kind == "chat":
                yield P.sse({**chunk("", None, 0), "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}]})
            async for out in stream:
                _raise_if_engine_aborted(out)
                if out.new_logprobs:
                    pending.extend(zip(out.new_token_ids, out.new_logprobs))
                if out.new_text and (kind == "chat" or not out.finished):
                    yield P.sse(with_logprobs(chunk(out.new_text, None, len(out.token_ids),
                                                    out.num_cached_tokens)))
                if out.finished:
                    last = with_logprobs(chunk(out.new_text if kind == "completion" else None,
                                               out.finish_reason, len(out.token_ids), out.num_cached_tokens))
                    spec = P.spec_summary(out.spec, stream.method)
                    if usage_mode == "none":
                        last["spec"] = spec
                    yield P.sse(last)
                    if usage_mode != "none":
                        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
                        yield P.sse({**P.usage_chunk(rid, created, model, obj, _usage(out)),
                                     "system_fingerprint": fingerprint, "spec": spec})
        except (RequestFailed, EngineClosed) as exc:
            yield P.sse(_failure(exc, rejected=False).body())
        yield P.sse("[DONE]")

    # ------------------------------------------------------------------ before the engine
    async def _prepare(self, request: Request, parse: Callable[[bytes], Any], admit: bool = True):
        """(request, prompt ids) of a POST: admission first (429/503 before any work), then
        the body, then `parse` (validation, the model check, tokenizing) on the prepare
        thread, so the event loop keeps streaming while a large body is handled.
        admit=False (/tokenize, /detokenize): no engine admission; the body cap and the
        prepare thread still apply."""
        if not admit:
            body = await read_body(request, self.config.max_body_bytes)
            return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, parse, body)
        self._admit()
        self._preparing += 1
        try:
            body = await read_body(request, self.config.max_body_bytes)
            return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, parse, body)
        finally:
            self._preparing -= 1

    def _admit(self, count: int = 1) -> None:
        try:
            self.async_engine.admit(self._preparing, count)
        except QueueFull as exc:
            raise _queue_full(exc) from None
        except EngineClosed as exc:
            raise _failure(exc, rejected=True) from None

    def _parse_completion(self, body: bytes) -> tuple[P.CompletionRequest, list[EncodedPrompt]]:
        """The request and its prompts (a batch: each in turn), tokenized, with the text
        `echo` returns: a string prompt as sent, a token-id prompt decoded."""
        req = P.parse_request(P.CompletionRequest, body, self.config.allow_unknown_fields)
        self._check_model(req.model)
        prompts = []
        for i, prompt in enumerate(req.prompt):
            with _batch_item(i, len(req.prompt)):
                ids = self._encode_prompt(prompt)
            echo = None
            if req.echo:
                echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
            prompts.append(EncodedPrompt(ids, echo))
        return req, prompts

    def _parse_chat(self, body: bytes) -> tuple[P.ChatCompletionRequest, list[int]]:
        req = P.parse_request(P.ChatCompletionRequest, body, self.config.allow_unknown_fields)
        self._check_model(req.model)
        messages = req.message_dicts()
        kw = req.template_kwargs(self.tokenizer)
        try:
            self._check_length(self.tokenizer.apply_chat_template(messages, **kw), "messages")
            return req, list(self.tokenizer.encode_chat(messages, **kw))
        except P.APIError:
            raise
        except Exception as exc:  # the template rejecting a conversation is bad input
            raise P.APIError(400, f"messages: the chat template rejected them: {exc}",
                             param="messages", code="invalid_value") from None

    def _check_length(self, text: str, param: str) -> None:
        """400 for a text that cannot fit the context, decided before tokenizing it whole."""
        context = self.async_engine.max_model_len
        try:
            check_length(self.tokenizer, text, context - 1, self.max_token_chars)
        except PromptTooLong as exc:
            raise P.APIError(400, f"{param}: the prompt is at least {exc.at_least} tokens; the "
                             f"context is {context} tokens and must leave room for at least one "
                             "generated token", param=param, code="context_length_exceeded") from None

    # ------------------------------------------------------------------ helpers
    def _has_key(self, request: Request) -> bool:
        """True when no API key is configured or the request carries it."""
        key = self.config.api_key
        if key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _authorize(self, request: Request) -> None:
        if not self._has_key(request):
            raise P.APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                             type="authentication_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.APIError(400, f"model {model!r} is not served here; use {self.model_name!r}",
                             param="model", code="model_not_found")

    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self._check_length(prompt, "prompt")
            return list(self.tokenizer.encode(prompt))
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in prompt):
            raise P.APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt",
                             code="invalid_value")
        return prompt

    def _resolve_max_tokens(self, requested: int | None, param: str, prompt_len: int,
                            prompt_param: str, default: int | None) -> int:
        """Check the prompt and max_tokens against the context; fill in the default."""
        context = self.async_engine.max_model_len
        room = context - prompt_len
        if prompt_len == 0:
            raise P.APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param,
                             code="invalid_value")
        if room < 1:
            raise P.APIError(400, f"{prompt_param}: the prompt is {prompt_len} tokens; the context is "
                             f"{context} tokens and must leave room for at least one generated token",
                             param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise P.APIError(400, f"{param}: {requested} with a {prompt_len}-token prompt exceeds the "
                             f"context of {context} tokens (at most {room})", param=param,
                             code="context_length_exceeded")
        return requested

    async def _start(self, rid: str, prompts: list[tuple[list[int], SamplingParams]],
                     req) -> RequestStream | SiblingStreams:
        """Hand the request to the engine, mapping refusals to HTTP errors. One prompt with
        n = 1 is one engine request. Otherwise choice j of prompt p is the sibling request
        `<rid>-<k>`, k = p * n + j (its choice index, OpenAI's order); all are admitted
        together or refused (429) together. A prompt's n siblings share its KV through the
        prefix cache; with a seed s, choice j of every prompt is seeded s + j (choice_params),
        so it equals an independent request of that prompt with seed s + j."""
        choices = [(ids, choice_params(params, j)) for ids, params in prompts for j in range(req.n)]
        if len(choices) == 1:
            return await self._start_one(rid, *choices[0], req)
        self._admit(len(choices))
        streams: list[RequestStream] = []
        try:
            for k, (ids, params) in enumerate(choices):
                streams.append(await self._start_one(f"{rid}-{k}", ids, params, req))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return SiblingStreams(rid, streams, req.n)

    async def _start_one(self, rid: str, prompt_ids: list[int], params, req) -> RequestStream:
        try:
            return await self.async_engine.add_request(rid, prompt_ids, params, P.spec_override(req))
        except QueueFull as exc:
            raise _queue_full(exc) from None
        except ValueError as exc:
            raise P.APIError(400, str(exc), param=P.engine_error_param(str(exc)),
                             code="invalid_value") from None
        except (RequestFailed, EngineClosed) as exc:
            raise _failure(exc, rejected=True) from None


class EncodedPrompt(NamedTuple):
    """One prompt of a completions request: its token ids, and the text `echo` returns (None
    without echo)."""

    ids: list[int]
    echo: str | None


@contextmanager
def _batch_item(index: int, size: int):
    """A 400 about one prompt of a batch says which prompt (its `param` is unchanged)."""
    try:
        yield
    except P.APIError as exc:
        if size == 1:
            raise
        raise P.APIError(exc.status, f"{exc.message} (prompt {index} of the batch)", param=exc.param,
                         type=exc.type, code=exc.code, headers=exc.headers, rejected=exc.rejected) from None


class SiblingStreams:
    """The engine requests (`<rid>-0` .. `<rid>-{k-1}`) of a request for several choices, n
    per prompt, prompt-major (stream i is choice i), aborted together."""

    def __init__(self, request_id: str, streams: list[RequestStream], n: int):
        self.request_id = request_id
        self.streams = streams
        self.n = n  # choices per prompt: usage counts each prompt once

    @property
    def method(self) -> str:
        return self.streams[0].method

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


class SSEResponse:
    """A text/event-stream response that aborts its request as soon as the client leaves.

    Starlette's StreamingResponse notices a disconnect only when a write fails, i.e. at the
    next token; this one also listens for http.disconnect while waiting for tokens.
    """

    def __init__(self, events: AsyncIterator[bytes], stream: RequestStream | SiblingStreams):
        self.events = events
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        tasks: list[asyncio.Future] = []
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            tasks = [asyncio.ensure_future(self._send_all(send)),
                     asyncio.ensure_future(_wait_for_disconnect(receive))]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stream.abort()  # no-op when the request already finished
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
        sender = tasks[0]
        if not sender.cancelled() and sender.exception() is not None:
            exc = sender.exception()
            if not isinstance(exc, OSError):  # OSError: the client closed the socket
                log.error("SSE stream %s failed", self.stream.request_id, exc_info=exc)

    async def _send_all(self, send) -> None:
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it grows past `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise P.APIError(400, "invalid Content-Length header", code="invalid_value")
        if int(declared) > limit:
            raise P.APIError(413, f"request body is {declared} bytes; the limit is {limit}",
                             code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.APIError(413, f"request body exceeds the limit of {limit} bytes",
                             code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _collect(streams: list[RequestStream], request: Request) -> list[RequestOutput] | None:
    """The final outputs of a non-streaming request's streams (n of them for n > 1), or None
    if the client disconnected. The first failing stream's error is raised at once, the
    others aborted."""
    async def consume(stream: RequestStream) -> RequestOutput:
        last = None
        async for out in stream:
            _raise_if_engine_aborted(out)
            last = out
        return last

    def failed(task: asyncio.Future) -> bool:
        return task.done() and not task.cancelled() and task.exception() is not None

    consumers = [asyncio.ensure_future(consume(s)) for s in streams]
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        pending = {*consumers, watcher}
        while True:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done() or any(map(failed, consumers)) or all(c.done() for c in consumers):
                break
    finally:
        for stream in streams:
            stream.abort()  # no-op when it finished; frees the KV at once when the client left
        for task in (*consumers, watcher):
            task.cancel()
    for task in consumers:
        if failed(task):
            raise task.exception()
    if all(c.done() and not c.cancelled() for c in consumers):
        return [c.result() for c in consumers]
    return None


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _raise_if_engine_aborted(out: RequestOutput) -> None:
    if out.finished and out.finish_reason not in ("stop", "length"):
        raise RequestFailed(f"the engine ended the request ({out.finish_reason})")


def _queue_full(exc: QueueFull) -> P.APIError:
    return P.APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                      headers={"Retry-After": str(exc.retry_after_s)})


def _shown(text: str | None, shown: bool) -> str | None:
    """An internal error text for /health: only to a caller with the API key."""
    if text is None or shown:
        return text
    return "hidden (send the API key to see it)"


def _failure(exc: Exception, rejected: bool) -> P.APIError:
    if isinstance(exc, EngineClosed):
        return P.APIError(503, str(exc), type="server_error", code="unavailable", rejected=rejected)
    return P.APIError(500, str(exc), type="server_error", code="engine_error", rejected=rejected)


def _usage(out: RequestOutput) -> dict:
    return P.usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)


def system_fingerprint(info) -> str:
    """A stable id of the engine configuration: "fp_" + 10 hex digits of the sha256 of the
    resolved engine config (and model, context, speculation method) as canonical JSON."""
    if info is None:
        return "fp_unknown"
    data = {"model": info.model_name, "max_model_len": info.max_model_len,
            "spec_method": info.spec_method, "config": info.config, "version": verispec.__version__}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return "fp_" + hashlib.sha256(blob.encode()).hexdigest()[:10]


def _json_object(body: bytes) -> dict:
    """The body as a dict when it is one (to pick a model to validate with), else {}:
    P.parse_request then reports what is wrong with it."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


class _TokenizerRouteRequest(P._Strict):
    def check_stream_options(self) -> None:  # P.parse_request's hook: nothing streams here
        pass


class TokenizeRequest(_TokenizerRouteRequest):
    """POST /tokenize with a plain prompt (vLLM's TokenizeCompletionRequest)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizerRouteRequest):
    """POST /tokenize with a conversation (vLLM's TokenizeChatRequest)."""

    model: str | None = None
    messages: list[P.ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True

    def message_dicts(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]


class DetokenizeRequest(_TokenizerRouteRequest):
    """POST /detokenize (vLLM's DetokenizeRequest)."""

    model: str | None = None
    tokens: list[int]


def _stats_dict(stats) -> dict:
    names = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total",
             "prefix_hit_tokens", "prefix_query_tokens")
    return {n: getattr(stats, n, None) for n in names}


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    app_state = getattr(request.app.state, "server", None)
    if app_state is not None:
        app_state.metrics.on_rejected(exc.status_code)
    body = P.error_body(f"{request.method} {request.url.path}: {exc.detail}", code=code)
    return JSONResponse(body, exc.status_code, headers=getattr(exc, "headers", None))


def _is_loopback(host: str) -> bool:
    return guard.is_loopback_host(host)
