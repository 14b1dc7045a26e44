"""Guards of the HTTP server against slow clients, descriptor exhaustion and browsers.

Two layers, because uvicorn has neither a header nor a body timeout, nor a connection cap
that spares requests in progress:

- `guarded_protocol(ConnectionGuard(...))`: uvicorn's HTTP protocol class with
  - a header timeout: a connection must complete a request's headers within
    `header_timeout_s` of opening, or of the end of its previous response (kept alive);
    one that sent nothing is simply closed, one that sent part of a request gets a 408;
  - a connection cap (`plan_connections`: below the RLIMIT_NOFILE soft limit, so accept()
    never fails for want of a descriptor): a connection arriving at the cap evicts the
    connection idle longest (headers incomplete, or between requests); with none idle it
    is refused with a 503. A request in progress (a long SSE stream included) is never
    evicted.
- `RequestGuard`, a pure ASGI middleware run before routing:
  - Host / Origin: with a `HostPolicy`, a Host header that is not an allowed name gets 421
    and an Origin header that is not one gets 403 (a key-less server on loopback would
    otherwise obey any web page, through DNS rebinding or a cross-site POST);
  - POST bodies must be JSON: a Content-Type other than application/json gets 415, which
    also rules out the text/plain "simple requests" a page may send cross-site;
  - a body timeout: a declared body must arrive within `body_timeout_s` of the headers,
    else 408 (or, if a response had already started, the connection is closed). The app
    still reads the body itself, so it may refuse a request before reading it.
Every refusal is an OpenAI-style error body and closes the connection.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from verispec.server import protocol as P

try:
    import resource
except ImportError:  # not a Unix: no descriptor limit to plan around
    resource = None  # type: ignore[assignment]

log = logging.getLogger("verispec.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
JSON_TYPE = "application/json"
WARN_INTERVAL_S = 10.0  # at most one warning per kind of refusal in this interval


# ---------------------------------------------------------------------------- shared helpers
class RateLimitedWarning:
    """Logs a warning at most once per `interval_s`, counting what happened in between."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S):
        self.interval_s = interval_s
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return
        more = f" (and {self._suppressed} more since the last warning)" if self._suppressed else ""
        log.warning(message + more, *args)
        self._last, self._suppressed = now, 0


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an IP literal, IPv6 with or without brackets) is loopback."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host part of a Host header value or an --allowed-hosts entry: port dropped,
    lowercased, IPv6 without brackets ("[::1]:8000" -> "::1")."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:  # name:port; more colons: a bare IPv6 literal
        return value.split(":", 1)[0]
    return value


def parse_allowed_hosts(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...] | None:
    """--allowed-hosts: comma-separated names (ports ignored) or "*", or a sequence of them
    (already parsed); None when not given."""
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(host_name(n) for n in parts if n.strip())
    if not names or not all(names):
        raise ValueError(f"--allowed-hosts: expected comma-separated host names or '*', got {value!r}")
    return names


# ---------------------------------------------------------------------------- Host / Origin policy
@dataclass(frozen=True)
class HostPolicy:
    """The Host names a request may name (any port); also those its Origin may name."""

    allowed: frozenset[str]

    def allows_host(self, value: str) -> bool:
        return host_name(value) in self.allowed

    def allows_origin(self, value: str) -> bool:
        """An Origin header ("scheme://host[:port]"; "null" for opaque origins) is allowed
        when its host is an allowed name."""
        try:
            hostname = urlsplit(value.strip()).hostname
        except ValueError:
            return False
        return hostname is not None and hostname in self.allowed

    def describe(self) -> str:
        """The allowed names for messages: loopback first, IPv6 in brackets."""
        names = [h for h in LOOPBACK_HOSTS if h in self.allowed]
        names += sorted(self.allowed - set(LOOPBACK_HOSTS))
        return ", ".join(f"[{h}]" if ":" in h else h for h in names)


def host_policy(bind_host: str, api_key: str | None, allowed_hosts: tuple[str, ...] | None
                ) -> HostPolicy | None:
    """The Host/Origin policy of a server, or None for no check.

    Without an API key: loopback names, the bind address and `allowed_hosts`. With a key,
    which already stops cross-site use, only when `allowed_hosts` is given. "*" turns the
    check off.
    """
    if allowed_hosts is None and api_key is not None:
        return None
    if allowed_hosts is not None and "*" in allowed_hosts:
        return None
    return HostPolicy(frozenset(LOOPBACK_HOSTS + (host_name(bind_host),) + (allowed_hosts or ())))


def log_host_policy(policy: HostPolicy | None, bind_host: str, api_key_set: bool) -> None:
    """Say at startup which Host names are served (operators behind a proxy need to know)."""
    if policy is None:
        why = "an API key is set" if api_key_set else "--allowed-hosts '*'"
        log.info("Host/Origin check off (%s)", why)
        return
    log.info("accepting requests for Host: %s (any port; add names with --allowed-hosts)",
             policy.describe())
    if host_name(bind_host) in ("0.0.0.0", "::"):
        log.warning("bound to %s without an API key: clients must use one of those Host names; "
                    "list the names they use with --allowed-hosts", bind_host)


# ---------------------------------------------------------------------------- the ASGI middleware
LATE_READ_GRACE_S = 0.05  # a body already received is never refused because the app read it late


class BodyTimeout(P.APIError):
    """Raised from receive() when the body is late. An APIError, so the routes answer it
    themselves (408, connection closed); RequestGuard answers it if one does not."""

    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
                         code="request_timeout", headers={"Connection": "close"})


class RequestGuard:
    """Pure ASGI middleware: Host/Origin policy, JSON-only POST bodies, body timeout (see the
    module doc). `on_reject(status)` is told of every refusal it answers (metrics)."""

    def __init__(self, app, *, hosts: HostPolicy | None, body_timeout_s: float,
                 on_reject: Callable[[int], None] | None = None):
        self.app = app
        self.hosts = hosts
        self.body_timeout_s = body_timeout_s
        self.on_reject = on_reject
        self._warn_host = RateLimitedWarning()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self._refusal(scope["method"], headers)
        if refusal is not None:
            await self._reject(send, refusal)
        elif _declares_body(headers):
            await self._call_with_deadline(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _call_with_deadline(self, scope, receive, send) -> None:
        """Run the app with a receive() that raises BodyTimeout once the body is late. The
        deadline starts now, when the headers are complete; the app still reads the body
        itself, so it may refuse a request (429, 413) before the body arrives."""
        started = False

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, _with_deadline(receive, self.body_timeout_s), watched_send)
        except BodyTimeout as exc:
            if started:
                raise  # too late for a 408: uvicorn closes the connection
            await self._reject(send, exc)

    def _refusal(self, method: str, headers: dict[str, list[str]]) -> P.APIError | None:
        """The error a request gets from its headers alone, or None."""
        if self.hosts is not None:
            for host in headers.get("host", ()):
                if not self.hosts.allows_host(host):
                    self._warn_host("refused a request for Host %r; allowed: %s (see --allowed-hosts)",
                                    host, self.hosts.describe())
                    return P.APIError(421, f"Host header {host!r} is not allowed; allowed hosts (any "
                                      f"port): {self.hosts.describe()}. Start the server with "
                                      "--allowed-hosts to add names.", code="host_not_allowed")
            for origin in headers.get("origin", ()):
                if not self.hosts.allows_origin(origin):
                    return P.APIError(403, f"Origin header {origin!r} is not allowed; allowed hosts: "
                                      f"{self.hosts.describe()} (see --allowed-hosts)",
                                      type="permission_error", code="origin_not_allowed")
        if method == "POST":
            for value in headers.get("content-type", ()):
                if value.split(";", 1)[0].strip().lower() != JSON_TYPE:
                    return P.APIError(415, f"Content-Type header {value!r} is not supported; send "
                                      f"'Content-Type: {JSON_TYPE}'", code="unsupported_media_type")
        return None

    async def _reject(self, send, error: P.APIError) -> None:
        if self.on_reject is not None:
            self.on_reject(error.status)
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _with_deadline(receive, timeout_s: float):
    """`receive` that raises BodyTimeout when the body's last message is not in by
    `timeout_s` from now; once the body is complete it passes through (disconnects)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    body_done = False

    async def receive_body():
        nonlocal body_done
        if body_done:
            return await receive()
        pending = asyncio.ensure_future(receive())
        try:
            await asyncio.wait({pending}, timeout=max(deadline - loop.time(), LATE_READ_GRACE_S))
        finally:  # also when the app itself is cancelled: no orphan receive() may eat a message
            late = not pending.done()
            if late:
                pending.cancel()
        if late:
            raise BodyTimeout(timeout_s)
        message = pending.result()
        body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return message
    return receive_body


def _headers(scope) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, value in scope.get("headers", ()):
        out.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
    return out


def _declares_body(headers: dict[str, list[str]]) -> bool:
    """HTTP/1.1 framing: a request has a body iff it sends Transfer-Encoding or a non-zero
    Content-Length."""
    return "transfer-encoding" in headers or headers.get("content-length", ["0"])[0].strip() not in ("", "0")


# ---------------------------------------------------------------------------- the connection cap
@dataclass(frozen=True)
class ConnectionPlan:
    """How many connections to keep, and the listen backlog, under the descriptor limit."""

    cap: int
    backlog: int
    fd_limit: int | None   # RLIMIT_NOFILE soft limit; None: unlimited or unknown
    open_fds: int | None   # descriptors the process held when planned; None: unknown


def plan_connections(max_connections: int, fd_reserve: int) -> ConnectionPlan:
    """cap = min(max_connections, soft RLIMIT_NOFILE - fd_reserve).

    The listen backlog is half the descriptors left over beyond the cap and those already
    open (16 to 2048): the event loop accepts a whole backlog before the protocol sees any
    of it, so a burst must fit in the spare descriptors or accept() fails and the loop
    drops connections, a legitimate one among them.
    """
    open_fds = _open_fd_count()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource is not None else -1
    if soft < 0 or soft == getattr(resource, "RLIM_INFINITY", -1):
        return ConnectionPlan(max_connections, 2048, None, open_fds)
    cap = max(1, min(max_connections, soft - fd_reserve))
    spare = soft - cap - (open_fds if open_fds is not None else 32)
    return ConnectionPlan(cap, min(2048, max(16, spare // 2)), soft, open_fds)


def log_connection_plan(plan: ConnectionPlan, max_connections: int, fd_reserve: int) -> None:
    log.info("connections: at most %d (--max-connections %d, RLIMIT_NOFILE soft limit %s, "
             "--fd-reserve %d), listen backlog %d", plan.cap, max_connections, plan.fd_limit,
             fd_reserve, plan.backlog)
    if plan.open_fds is not None and plan.open_fds > fd_reserve // 2:
        log.warning("the process holds %d descriptors before serving; --fd-reserve %d leaves little room "
                    "for its own files and sockets", plan.open_fds, fd_reserve)


def _open_fd_count() -> int | None:
    for path in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(path))
        except OSError:
            continue
    return None


class ConnectionGuard:
    """Book-keeping shared by the connections of one server: who is idle since when, the
    header timers, eviction at the cap.

    A connection is idle while no request is in progress on it: from opening, or from the
    end of a response, until a request's headers are complete. `idle` keeps the idle ones
    in the order they became idle, so the first is the one idle longest.
    """

    def __init__(self, cap: int, header_timeout_s: float):
        self.cap = cap
        self.header_timeout_s = header_timeout_s
        self.open: set = set()
        self.idle: dict = {}  # connection -> its header TimerHandle, oldest first
        self._warn_evict = RateLimitedWarning()
        self._warn_refuse = RateLimitedWarning()

    def admit(self, conn) -> bool:
        """Count a new connection in, evicting the longest idle one at the cap; False (the
        caller refuses it) when the cap is reached and none is idle."""
        if len(self.open) >= self.cap:
            victim = next(iter(self.idle), None)
            if victim is None:
                self._warn_refuse("connection cap (%d) reached with every connection busy: refusing "
                                  "new ones (raise --max-connections or ulimit -n)", self.cap)
                return False
            self._warn_evict("connection cap (%d) reached: closing the connection idle longest "
                             "(raise --max-connections or ulimit -n if these are real clients)", self.cap)
            self.release(victim)
            _close(victim.transport)
        self.open.add(conn)
        self._go_idle(conn)
        return True

    def release(self, conn) -> None:
        """Forget a connection (closed, or about to be); idempotent."""
        self.open.discard(conn)
        timer = self.idle.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def update(self, conn) -> None:
        """Track a connection after uvicorn handled its input or finished a response."""
        if conn not in self.open:
            return
        if conn.transport.is_closing():
            self.release(conn)
            return
        busy = conn.cycle is not None and not conn.cycle.response_complete
        if busy and conn in self.idle:
            self.idle.pop(conn).cancel()
        elif not busy and conn not in self.idle:
            self._go_idle(conn)

    def _go_idle(self, conn) -> None:
        conn.guard_bytes_while_idle = 0
        loop = asyncio.get_running_loop()
        self.idle[conn] = loop.call_later(self.header_timeout_s, self._expire, conn)

    def _expire(self, conn) -> None:
        """Header timeout: a partial request gets a 408; an empty one is just closed."""
        if conn not in self.idle:
            return
        self.release(conn)
        transport = conn.transport
        if conn.guard_bytes_while_idle and not transport.get_write_buffer_size():
            transport.write(_raw_response(408, "request headers did not arrive within "
                                          f"{self.header_timeout_s:g} s (--header-timeout)",
                                          "request_timeout"))
        _close(transport)


def _close(transport) -> None:
    """Close now: a client that does not read its responses must not hold the descriptor."""
    if transport.get_write_buffer_size():
        transport.abort()
    else:
        transport.close()


def _raw_response(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, for use outside the app."""
    body = json.dumps(P.error_body(message, code=code)).encode()
    reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _GuardedConnection:
    """Mixin over a uvicorn HTTP protocol class; `guard` is set by `guarded_protocol`.

    It hooks only what both uvicorn protocols (httptools and h11) share: connection_made,
    connection_lost, data_received and on_response_complete; whether a request is in
    progress is read from `cycle`, which both set when a request's headers are complete.
    """

    guard: ConnectionGuard
    guard_bytes_while_idle = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if not self.guard.admit(self):
            transport.write(_raw_response(503, "the server is at its connection limit; retry "
                                          "shortly", "too_many_connections"))
            _close(transport)

    def connection_lost(self, exc) -> None:
        self.guard.release(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        self.guard_bytes_while_idle += len(data)
        super().data_received(data)  # type: ignore[misc]
        self.guard.update(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self.guard.update(self)


def guarded_protocol(guard: ConnectionGuard, base: type | None = None) -> type:
    """The HTTP protocol class for `uvicorn.Config(http=...)`: `base` (default: the one
    uvicorn would pick, httptools or else h11) under `guard`. Pass `ws="none"` too: a
    WebSocket upgrade would hand the connection to a protocol the guard does not track."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol
        base = AutoHTTPProtocol
    return type(f"Guarded{base.__name__}", (_GuardedConnection, base), {"guard": guard})
