"""One HTTP request carried from the front door to a replica's own Starlette app, and its
response carried back, as plain picklable values over a Ray Serve DeploymentHandle.

    front door (ASGI, in Ray's HTTP proxy path)         replica (ReplicaServer)
    HTTPCall(method, path, headers, body, routing_keys)  run_asgi(app, call):
        --- handle.options(stream=True) ----------->       the app sees an ordinary HTTP
    <-- ResponseHead(status, headers), then bytes ---      request: body once, then only
                                                           http.disconnect, sent when the
                                                           call is cancelled (client gone)

The front door reads the body before routing because the router needs the prompt: Ray's
HTTP proxy forwards a body only after a replica is chosen. `routing_keys` are that
prompt's block keys, tokenized as the replica will (the request router's key,
`verispec/ray/router.py`); the replica never reads them.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from verispec.server import protocol as P

ROUTING_TOKENS = 1 << 13   # the router keys no more of a prompt than this


@dataclass(frozen=True)
class HTTPCall:
    """An HTTP request as the front door received it (headers as ASGI gives them)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    routing_keys: tuple[int, ...] = ()   # block keys of the prompt (verispec/cache/events.py)
    routing_block_size: int = 1


@dataclass(frozen=True)
class ResponseHead:
    """The first item a replica yields: status and headers (ASGI's), and who answered."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str


def routing_token_ids(path: str, body: bytes, tokenizer, allow_unknown_fields: bool) -> list[int]:
    """The first ROUTING_TOKENS token ids of a generation request's prompt, encoded as the
    replica's server encodes it (the chat template renders messages and tools); [] for
    other routes and for requests the replica will refuse (it answers those). A batch of
    completion prompts is routed by its first."""
    try:
        if path == "/v1/chat/completions":
            req = P.parse_request(P.ChatCompletionRequest, body, allow_unknown_fields)
            ids = tokenizer.encode_chat(req.message_dicts(), **req.template_kwargs(tokenizer))
        elif path == "/v1/completions":
            prompt = P.parse_request(P.CompletionRequest, body, allow_unknown_fields).prompt[0]
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        else:
            return []
    except Exception:   # noqa: BLE001 - bad input is the replica's to answer
        return []
    return list(ids[:ROUTING_TOKENS])


def asgi_scope(call: HTTPCall) -> dict:
    """The ASGI HTTP scope the replica's app sees for `call`."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
            "root_path": "", "query_string": call.query_string, "headers": list(call.headers),
            "client": call.client, "server": None, "state": {}}


async def run_asgi(app, call: HTTPCall, replica: str) -> AsyncIterator[ResponseHead | bytes]:
    """Run `app` on `call`; yield its ResponseHead, then its body in chunks (the body
    messages waiting at each turn are joined, so a fast stream costs fewer Ray objects).
    Closing or cancelling this generator tells the app the client disconnected."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(asgi_scope(call), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))  # wakes the reader when the app ends
    try:
        async for item in _responses(sent, task, replica):
            yield item
    finally:
        gone.set()
        if not task.done():
            try:   # let the app see the disconnect and abort its engine request
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()


async def _responses(sent: asyncio.Queue, task: asyncio.Future, replica: str):
    """The app's messages as a ResponseHead then body chunks, until the last body part."""
    while True:
        message = await sent.get()
        if message is None:   # the app returned (or raised) without finishing its response
            task.result()      # its exception, if any
            raise RuntimeError("the app ended without completing its response")
        if message["type"] == "http.response.start":
            yield ResponseHead(message["status"], tuple(message.get("headers", ())), replica)
            continue
        chunks, more = [message.get("body", b"")], message.get("more_body", False)
        while more and not sent.empty():
            nxt = sent.get_nowait()
            if nxt is None:
                sent.put_nowait(None)
                break
            chunks.append(nxt.get("body", b""))
            more = nxt.get("more_body", False)
        body = b"".join(chunks)
        if body:
            yield body
        if not more:
            return


async def fetch(app, call: HTTPCall, replica: str) -> tuple[int, bytes]:
    """(status, body) of a whole response: the control routes (/health, /metrics)."""
    status, chunks = 500, []
    async for item in run_asgi(app, call, replica):
        if isinstance(item, ResponseHead):
            status = item.status
        else:
            chunks.append(item)
    return status, b"".join(chunks)
