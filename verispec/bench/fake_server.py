"""A small OpenAI-compatible server that misbehaves on request, for testing the harness.

`FakeServer` runs a Starlette app under uvicorn in a background thread on a free loopback port.
Its `behaviour` (a mutable `Behaviour`) picks the failure to inject: missing usage, HTTP 500,
closed connections, streams cut short, divergent outputs, labelled / zero / missing speculation
counters. Outputs are deterministic functions of the messages, so temperature-0 runs repeat.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

_WORDS = ("alpha", "beta", "gamma", "delta", "{", "}", "the", "of", "and", "speculate",
          "verify", "accept", "token", "draft", "model", "cache", "tree", "lossless")


@dataclass
class Behaviour:
    """What the fake server does; tests mutate it between runs."""

    model: str = "fake-model"
    send_usage: bool = True                 # False: the stream never carries usage
    honour_continuous_usage: bool = True    # cumulative usage in every chunk when asked
    chunk_pattern: tuple[int, ...] = (1, 3, 2)  # tokens per chunk, cycled (speculative bursts)
    chunk_delay_s: float = 0.001
    fail_500_substrings: tuple[str, ...] = ()   # prompts containing one get HTTP 500
    close_substrings: tuple[str, ...] = ()      # ... get the connection dropped mid-stream
    truncate_substrings: tuple[str, ...] = ()   # ... end without finish_reason and [DONE]
    diverge_substrings: tuple[str, ...] = ()    # ... produce a different continuation
    stall_substrings: tuple[str, ...] = ()      # ... stall for stall_s before the first token
    stall_s: float = 5.0
    json_substrings: tuple[str, ...] = ()   # prompts containing one get a JSON object back
    broken_json_substrings: tuple[str, ...] = ()  # ... get a JSON object cut short
    metrics_prefix: str | None = "verispec:"  # None: /metrics has no speculation counters
    metrics_status: int = 200
    accept_tokens: bool = True              # False: draft counters grow, accepted stay at 0
    num_spec_positions: int = 3
    received: list[dict] = field(default_factory=list)  # every request body, in arrival order


def _tokens_for(messages: list[dict], max_tokens: int, diverge: bool) -> list[str]:
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    n = 8 + digest[0] % 24
    words = [_WORDS[(digest[i % 32] + i) % len(_WORDS)] for i in range(n)]
    if diverge:
        words[n // 2:] = ["DIVERGED"] * (n - n // 2)
    return [w + " " for w in words[:max_tokens]]


class _Counters:
    """Speculation counters exposed on /metrics, with model and method labels."""

    def __init__(self):
        self.lock = threading.Lock()
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.per_pos: dict[int, int] = {}

    def observe(self, n_tokens: int, behaviour: Behaviour) -> dict:
        k = behaviour.num_spec_positions
        with self.lock:
            rounds = max(1, n_tokens // 2)
            accepted = 0
            for r in range(rounds):
                self.drafts += 1
                self.draft_tokens += k
                if behaviour.accept_tokens:
                    got = 1 + r % k  # some rounds accept more positions than others
                    accepted += got
                    for p in range(got):
                        self.per_pos[p] = self.per_pos.get(p, 0) + 1
            self.accepted += accepted
        return {"num_drafts": rounds, "drafted": rounds * k, "accepted": accepted}

    def exposition(self, b: Behaviour) -> str:
        if b.metrics_prefix is None:
            return "# HELP process_up Up.\n# TYPE process_up gauge\nprocess_up 1.0\n"
        p, labels = b.metrics_prefix, f'model_name="{b.model}",method="draft_model"'
        lines = []
        for name, value in (("spec_decode_num_drafts", self.drafts),
                            ("spec_decode_num_draft_tokens", self.draft_tokens),
                            ("spec_decode_num_accepted_tokens", self.accepted)):
            lines += [f"# HELP {p}{name} {name}.", f"# TYPE {p}{name} counter",
                      f"{p}{name}_total{{{labels}}} {float(value)}"]
        lines += [f"# HELP {p}spec_decode_num_accepted_tokens_per_pos per position.",
                  f"# TYPE {p}spec_decode_num_accepted_tokens_per_pos counter"]
        for pos in range(b.num_spec_positions):
            lines.append(f'{p}spec_decode_num_accepted_tokens_per_pos_total{{{labels},'
                         f'position="{pos}"}} {float(self.per_pos.get(pos, 0))}')
        return "\n".join(lines) + "\n"


def build_app(behaviour: Behaviour) -> Starlette:
    """The Starlette app; exposed separately so tests can wrap it if needed."""
    counters = _Counters()

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": behaviour.model, "object": "model"}]})

    async def metrics(_: Request):
        return PlainTextResponse(counters.exposition(behaviour), status_code=behaviour.metrics_status)

    async def chat(request: Request):
        body = await request.json()
        behaviour.received.append(body)
        text = json.dumps(body["messages"])
        if any(s in text for s in behaviour.fail_500_substrings):
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        return StreamingResponse(_stream(body, text, behaviour, counters),
                                 media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics),
                             Route("/v1/chat/completions", chat, methods=["POST"])])


def _chunk(cid: str, model: str, delta: dict, finish: str | None, usage: dict | None, **extra) -> str:
    obj = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    if usage is not None:
        obj["usage"] = usage
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(body: dict, text: str, b: Behaviour, counters: _Counters):
    opts = body.get("stream_options") or {}
    continuous = b.send_usage and b.honour_continuous_usage and opts.get("continuous_usage_stats")
    diverge = any(s in text for s in b.diverge_substrings)
    tokens = _tokens_for(body["messages"], body["max_tokens"], diverge)
    if any(s in text for s in b.json_substrings):
        tokens = ['{"answer": ', f'"{len(tokens)}"', ', "words": ', '["a", ', '"b"]', "}"]
        if any(s in text for s in b.broken_json_substrings):
            tokens = tokens[:-1]
    prompt_tokens = len(text) // 4 + 1
    finish = "length" if len(tokens) >= body["max_tokens"] else "stop"
    truncate = any(s in text for s in b.truncate_substrings)
    close = any(s in text for s in b.close_substrings)
    if any(s in text for s in b.stall_substrings):
        await asyncio.sleep(b.stall_s)
    i, sent, cid = 0, 0, "chatcmpl-fake"
    yield _chunk(cid, b.model, {"role": "assistant", "content": ""}, None,
                 {"prompt_tokens": prompt_tokens, "completion_tokens": 0} if continuous else None)
    while sent < len(tokens):
        n = b.chunk_pattern[i % len(b.chunk_pattern)]
        piece = tokens[sent:sent + n]
        sent += len(piece)
        i += 1
        await asyncio.sleep(b.chunk_delay_s)
        if close and sent > len(tokens) // 2:
            raise ConnectionResetError("injected: connection dropped mid-stream")
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent} if continuous else None
        last = sent >= len(tokens) and not truncate
        yield _chunk(cid, b.model, {"content": "".join(piece)}, finish if last else None, usage)
    if truncate:
        return  # no finish_reason, no usage chunk, no [DONE]
    spec = counters.observe(len(tokens), b)
    if b.send_usage and opts.get("include_usage"):
        obj = {"id": cid, "object": "chat.completion.chunk", "model": b.model, "choices": [],
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                         "total_tokens": prompt_tokens + len(tokens)}, "spec": spec}
        yield f"data: {json.dumps(obj)}\n\n"
    yield "data: [DONE]\n\n"


class FakeServer:
    """Run `build_app(behaviour)` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, behaviour: Behaviour | None = None):
        self.behaviour = behaviour or Behaviour()
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto says TCP, and without it Nagle + delayed ACKs hold chunks back ~40 ms.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.behaviour), log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("fake server did not start within 10 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
