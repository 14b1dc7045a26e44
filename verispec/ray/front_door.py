"""FrontDoor: the application's ingress deployment, behind Ray Serve's HTTP proxy.

Ray's proxy hands a request to an ingress replica before anything has read its body, so a
router at the proxy cannot see the prompt. The front door reads the body (bounded by
--max-body-bytes), computes the prompt's block keys for the router (tokenized as a replica
will) and sends the request through a DeploymentHandle to a ReplicaServer; Ray Serve's request router (PrefixAffinityRouter,
or Ray's default) picks the replica. Ray Serve LLM is built the same way (an OpenAI
ingress deployment over LLM server deployments).

    GET /health             every replica's /health; 200 while at least one replica is ok
    GET /metrics            every replica's /metrics, each sample labelled `replica`
    GET /metrics/aggregate  the sum over replicas in the single server's format
    anything else           relayed to one replica's app (docs/serving.md holds there)

Host/Origin/Content-Type checks (verispec/server/guard.py) apply here as on one server.
A replica that dies with a request in flight: a request whose response has not begun gets
503 `replica_unavailable`; a stream already running gets that error as its last SSE event,
then `[DONE]`. Either way the message names the failure; other requests are untouched.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import ray
from ray import serve
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from verispec.ray import metrics as ray_metrics
from verispec.cache.events import block_keys
from verispec.ray.bridge import HTTPCall, ResponseHead, routing_token_ids
from verispec.server import guard
from verispec.server import protocol as P
from verispec.server.app import ServerConfig, read_body

log = logging.getLogger("verispec.ray")

CONTROL_TIMEOUT_S = 5.0   # /health and /metrics wait this long for the replicas
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
CONTROL_ROUTES = {"/health": "health", "/metrics": "metrics", "/metrics/aggregate": "metrics"}  # GET only
# A replica's process or actor is gone, or Ray has no replica to offer.
UNAVAILABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
               serve.exceptions.DeploymentUnavailableError)


@serve.ingress()
class FrontDoor:
    """The ingress deployment: holds the handle on the replicas, builds the ASGI app."""

    def __init__(self, replicas, server_config: ServerConfig, route_by_prefix: bool = True):
        self.replicas = replicas
        self.server_config = server_config
        self.route_by_prefix = route_by_prefix

    def __serve_build_asgi_app__(self):
        return guard.RequestGuard(
            FrontDoorApp(self.replicas, self.server_config, self.route_by_prefix),
            hosts=guard.host_policy(self.server_config.host, self.server_config.api_key,
                                    self.server_config.allowed_hosts),
            body_timeout_s=self.server_config.body_timeout_s)


@dataclass
class _Relay:
    started: bool = False
    sse: bool = False


class FrontDoorApp:
    """Pure ASGI: the control routes answered here, every other request relayed."""

    def __init__(self, replicas, config: ServerConfig, route_by_prefix: bool = True):
        self.replicas = replicas
        self.streaming = replicas.options(method_name="handle", stream=True)
        self.config = config
        self.route_by_prefix = route_by_prefix   # False: Ray's router ignores routing keys
        self._routing_info = None                # (tokenizer, block size), from a replica
        self._routing_info_lock = asyncio.Lock()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            control = CONTROL_ROUTES.get(scope["path"]) if scope["method"] == "GET" else None
            if control is None:
                await self.forward(scope, receive, send)
            else:
                response = await getattr(self, control)(scope["path"])
                await response(scope, receive, send)

    async def forward(self, scope, receive, send) -> None:
        try:
            body = await read_body(Request(scope, receive), self.config.max_body_bytes)
        except P.APIError as exc:
            await JSONResponse(exc.body(), exc.status, headers=exc.headers)(scope, receive, send)
            return
        except ClientDisconnect:
            return
        keys, block_size = await self._routing_keys(scope["path"], body)
        call = HTTPCall(scope["method"], scope["path"], scope.get("query_string", b""),
                        tuple(scope["headers"]), body, scope.get("client"), keys, block_size)
        response = self.streaming.remote(call)
        relay = _Relay()
        pump = asyncio.ensure_future(_pump(response, send, relay))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait([pump, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not pump.done():   # the client left: cancelling reaches the replica's app
                response.cancel()
                pump.cancel()
            watcher.cancel()
            await asyncio.gather(pump, watcher, return_exceptions=True)

    async def _routing_keys(self, path: str, body: bytes) -> tuple[tuple[int, ...], int]:
        """(block keys, block size) of the request's prompt for PrefixAffinityRouter; no
        keys when routing ignores them or no replica has told the tokenizer yet."""
        if not self.route_by_prefix or path not in GENERATION_ROUTES:
            return (), 1
        async with self._routing_info_lock:   # the first requests ask one replica, once
            if self._routing_info is None:
                try:
                    self._routing_info = await self.replicas.routing_info.remote()
                except Exception as exc:   # noqa: BLE001 - no replica up yet: route by load
                    log.warning("no routing info from the replicas yet: %s", exc)
                    return (), 1
        tokenizer, block_size = self._routing_info
        ids = await asyncio.to_thread(routing_token_ids, path, body, tokenizer, self.config.allow_unknown_fields)
        return tuple(block_keys(ids, block_size)), block_size

    async def _broadcast(self, path: str) -> tuple[dict[str, tuple[int, bytes]], list[str]]:
        """{replica: (status, body)} of GET `path` on every replica, and the failures."""
        try:
            results = await self.replicas.broadcast("fetch", path).results_async(
                timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True)
        except (TimeoutError, *UNAVAILABLE) as exc:   # no replica running yet, or none answers
            results = [exc]
        answers, failures = {}, []
        for r in results:
            if isinstance(r, BaseException):
                failures.append(f"{type(r).__name__}: {str(r).splitlines()[0] if str(r) else ''}")
            else:
                answers[r[0]] = (r[1], r[2])
        return answers, failures

    async def health(self, path: str) -> Response:
        answers, failures = await self._broadcast(path)
        replicas = {rid: json.loads(body) for rid, (_, body) in answers.items()}
        ok = sum(status == 200 for status, _ in answers.values())
        body = {"status": "ok" if ok else "unavailable", "replicas_ok": ok,
                "replicas": replicas, "unreachable": failures}
        return JSONResponse(body, 200 if ok else 503)

    async def metrics(self, path: str) -> Response:
        answers, failures = await self._broadcast("/metrics")
        if failures:
            log.warning("/metrics: %d replica(s) did not answer: %s", len(failures), failures)
        texts = {rid: body.decode() for rid, (status, body) in answers.items() if status == 200}
        merge = ray_metrics.aggregate if path.endswith("/aggregate") else ray_metrics.per_replica
        return Response(merge(texts), headers={"content-type": CONTENT_TYPE_LATEST})


async def _pump(response, send, relay: _Relay) -> None:
    """Relay a replica's ResponseHead and body; a replica failure becomes an error the
    client can read (a 503 body, or a last SSE event once a stream has begun). A failing
    `send` (the client left) propagates: there is nobody to tell."""
    while True:
        try:
            item = await response.__anext__()
        except StopAsyncIteration:
            break
        except Exception as exc:   # noqa: BLE001 - every replica failure reaches the client
            await _send_failure(send, relay, _replica_failure(exc))
            return
        if isinstance(item, ResponseHead):
            headers = [*item.headers, (b"x-verispec-replica", item.replica.encode())]
            await send({"type": "http.response.start", "status": item.status, "headers": headers})
            relay.started = True
            relay.sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                            for k, v in item.headers)
        else:
            await send({"type": "http.response.body", "body": item, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_failure(send, relay: _Relay, error: P.APIError) -> None:
    if not relay.started:
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(error.body()).encode()})
        return
    tail = P.sse(error.body()) + P.sse("[DONE]") if relay.sse else b""  # a JSON body cut short: nothing fits
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _replica_failure(exc: Exception) -> P.APIError:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, UNAVAILABLE):
        log.warning("a replica failed with a request in flight: %s: %s", type(exc).__name__, first_line)
        return P.APIError(503, f"the replica serving this request failed ({type(exc).__name__}: "
                          f"{first_line}); retry: the other replicas are serving",
                          type="server_error", code="replica_unavailable", rejected=False)
    log.error("relaying a response failed", exc_info=exc)
    return P.APIError(500, f"internal error while relaying the response ({type(exc).__name__})",
                      type="server_error", code="internal_error", rejected=False)


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive, send) -> None:
    """Nothing to start or stop: acknowledge ASGI lifespan events."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
