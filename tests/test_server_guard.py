"""The server's guards over real HTTP (verispec/server/guard.py): each test replays an
attacker's probe against a fake-engine server subprocess.

- slowloris: 300 silent connections and 20 sending a header byte a second, against a
  server whose descriptor limit is 256, must not lock out a legitimate client; the same
  probe against a server without the connection cap does (the test bites);
- at the cap, requests in progress are kept and a new connection gets a 503;
- header and body timeouts close slow clients (408 where a request had begun);
- Host / Origin: a key-less server serves only loopback names (DNS rebinding, CSRF) unless
  --allowed-hosts says otherwise, and does not check once an API key is set;
- POST bodies must be declared JSON (a text/plain "simple request" gets 415).
"""
from __future__ import annotations

import errno
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from test_server_http import API_KEY, REPO, ServerProcess, _fake_backend, _free_port  # noqa: E402

FAKE = _fake_backend()
COMPLETION = {"prompt": "hello", "max_tokens": 2}


class GuardServer(ServerProcess):
    """ServerProcess on the fake engine with a chosen API key (None: no key) and, if given,
    a soft RLIMIT_NOFILE for the server process."""

    def __init__(self, *flags: str, api_key: str | None = None, nofile: int | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="verispec-guard-", suffix=".log")
        env = {k: v for k, v in os.environ.items() if k != "VERISPEC_API_KEY"}
        env.update({"PYTHONUNBUFFERED": "1", **({"VERISPEC_API_KEY": api_key} if api_key else {})})

        def limit_descriptors():
            if nofile is not None:
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
        self.proc = subprocess.Popen(FAKE.command(self.port, ["--log-level", "info", *flags]), cwd=REPO,
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=limit_descriptors)
        self._wait_ready(FAKE.startup_timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        self.log.close()


@pytest.fixture(scope="module")
def keyless():
    """No API key; 1 s header and body timeouts."""
    with GuardServer("--header-timeout", "1", "--body-timeout", "1") as srv:
        yield srv


# ---------------------------------------------------------------------------- raw sockets
def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(5)
    return s


def _read_until_closed(s: socket.socket, limit_s: float = 5) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed
    (seconds from the call)."""
    start, data = time.monotonic(), b""
    s.settimeout(limit_s)
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def _read_response(s: socket.socket) -> bytes:
    """One complete response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


# ---------------------------------------------------------------------------- slowloris
SLOW_PREFIX = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 100_000


class Attacker:
    """Holds `idle` silent connections and `slow` ones sending one header byte a second,
    reopening every connection the server closes (a persistent attacker)."""

    def __init__(self, port: int, idle: int = 300, slow: int = 20):
        self.addr = ("127.0.0.1", port)
        self.idle = [self._open(pace_s=0.002) for _ in range(idle)]
        self.slow = [self._open(pace_s=0.002) for _ in range(slow)]
        self.sent = [0] * slow
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self, pace_s: float = 0.0) -> socket.socket:
        """A connection, without waiting for it to be established (a full accept queue must
        not stall the attacker); `pace_s` spaces them out so that the queue rarely is full."""
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(self.addr)
        time.sleep(pace_s)
        return s

    @staticmethod
    def _closed_by_server(s: socket.socket) -> bool:
        try:
            s.recv(1, socket.MSG_PEEK)
            return True  # b"": closed; data: an error response, then a close
        except BlockingIOError:
            return False
        except OSError as exc:
            return exc.errno != errno.ENOTCONN  # ENOTCONN: still connecting

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(0.25):
            ticks += 1
            for group in (self.idle, self.slow):
                for i, s in enumerate(group):
                    if self._closed_by_server(s):
                        s.close()
                        group[i] = self._open()
                        self.reopened += 1
                        if group is self.slow:
                            self.sent[i] = 0
            if ticks % 4 == 0:
                for i, s in enumerate(self.slow):
                    try:
                        self.sent[i] += s.send(SLOW_PREFIX[self.sent[i]:self.sent[i] + 1])
                    except OSError:
                        pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.idle + self.slow:
            s.close()


def _legitimate_requests(url: str, within_s: float) -> str | None:
    """None if a GET and a completion both succeed within `within_s`; else what failed."""
    start = time.monotonic()
    try:
        with httpx.Client(base_url=url, timeout=within_s) as client:
            health = client.get("/health")
            done = client.post("/v1/completions", json=COMPLETION,
                               headers={"Authorization": f"Bearer {API_KEY}"})
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    if health.status_code != 200 or done.status_code != 200:
        return f"statuses {health.status_code}, {done.status_code}"
    if elapsed > within_s:
        return f"took {elapsed:.1f} s"
    return None


def _slowloris_probe(srv: GuardServer) -> str | None:
    """Attack, then try a legitimate client; returns its failure (None: it was served)."""
    attacker = Attacker(srv.port)
    try:
        time.sleep(1.5)  # the server has accepted what it will of the attack
        return _legitimate_requests(srv.url, within_s=5)
    finally:
        attacker.stop()


@pytest.fixture(scope="module", autouse=True)
def _room_for_the_attacker():
    """The attacker needs ~400 descriptors of its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024 and (hard == resource.RLIM_INFINITY or hard >= 1024):
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1024:
        pytest.skip("needs RLIMIT_NOFILE >= 1024 for the attacker's sockets")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_connections_under_the_descriptor_limit_cannot_lock_out_a_client():
    # The default cap (256 - --fd-reserve 128) keeps descriptors free, and the attacker's
    # connections, idle all, are evicted oldest first as new ones arrive.
    with GuardServer(api_key=API_KEY, nofile=256) as srv:
        assert _slowloris_probe(srv) is None, srv.log_text()
        assert "connection cap (128) reached" in srv.log_text()
        assert srv.health()["status"] == "ok"

    # Without the cap the same probe exhausts the descriptors and the client is refused;
    # the server comes back only once the attacker lets go.
    with GuardServer("--max-connections", "100000", "--fd-reserve", "0", api_key=API_KEY, nofile=256) as srv:
        failure = _slowloris_probe(srv)
        assert failure is not None, "the probe does not bite: the server coped without its cap"
        assert not failure.startswith("statuses"), failure  # the client was cut off, not answered
        assert _legitimate_requests(srv.url, within_s=5) is None, srv.log_text()


def test_at_the_cap_requests_in_progress_are_kept_and_a_new_connection_is_refused():
    with GuardServer("--max-connections", "2") as srv:
        body = json.dumps(COMPLETION).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        busy = [_connect(srv.port) for _ in range(2)]
        for s in busy:
            s.sendall(head + body[:5])  # headers complete: a request in progress
        time.sleep(0.3)
        data, _ = _read_until_closed(_connect(srv.port))
        assert data.startswith(b"HTTP/1.1 503"), data
        for s in busy:
            s.sendall(body[5:])
            assert _read_response(s).startswith(b"HTTP/1.1 200")


# ---------------------------------------------------------------------------- timeouts
def test_header_timeout_closes_silent_and_slow_connections(keyless):
    silent = _connect(keyless.port)
    partial = _connect(keyless.port)
    partial.sendall(b"GET /health HTTP/1.1\r\nHo")
    kept = _connect(keyless.port)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert _read_response(kept).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /heal")  # the clock runs from the end of the previous response

    data, closed_after = _read_until_closed(silent)
    assert data == b"" and 0.5 < closed_after < 2.5
    data, _ = _read_until_closed(partial)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b"--header-timeout" in data
    data, closed_after = _read_until_closed(kept)
    assert data.startswith(b"HTTP/1.1 408") and closed_after < 2.5, (data, closed_after)


def test_body_timeout_answers_408(keyless):
    s = _connect(keyless.port)
    start = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
    data, _ = _read_until_closed(s)
    elapsed = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408"), data
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert 0.5 < elapsed < 2.5, elapsed
    # a body that arrives in time is served
    r = httpx.post(f"{keyless.url}/v1/completions", json=COMPLETION, timeout=10)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- Host / Origin / type
def test_keyless_server_serves_only_loopback_hosts_and_origins(keyless):
    r = httpx.get(f"{keyless.url}/health", headers={"Host": "evil.example"})
    assert r.status_code == 421
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert all(word in err["message"] for word in ("Host", "evil.example", "localhost", "--allowed-hosts"))
    for host in (f"localhost:{keyless.port}", f"[::1]:{keyless.port}", "127.0.0.1"):
        assert httpx.get(f"{keyless.url}/health", headers={"Host": host}).status_code == 200, host

    r = httpx.post(f"{keyless.url}/v1/completions", json=COMPLETION,
                   headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "Origin" in r.json()["error"]["message"]
    assert httpx.get(f"{keyless.url}/health", headers={"Origin": "null"}).status_code == 403
    r = httpx.post(f"{keyless.url}/v1/completions", json=COMPLETION,
                   headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200, r.text


def test_post_bodies_must_be_declared_json(keyless):
    body = json.dumps(COMPLETION)
    r = httpx.post(f"{keyless.url}/v1/completions", content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    message = r.json()["error"]["message"]
    assert "Content-Type" in message and "application/json" in message
    r = httpx.post(f"{keyless.url}/v1/completions", content=body,
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_allowed_hosts_and_api_key_relax_the_host_check():
    with GuardServer("--allowed-hosts", "evil.example,api.internal:8080") as srv:
        assert httpx.get(f"{srv.url}/health", headers={"Host": "evil.example"}).status_code == 200
        assert httpx.get(f"{srv.url}/health", headers={"Host": "api.internal"}).status_code == 200
        assert httpx.get(f"{srv.url}/health", headers={"Host": "other.example"}).status_code == 421
    with GuardServer(api_key=API_KEY) as srv:  # a key already stops cross-site use
        r = httpx.get(f"{srv.url}/v1/models", headers={
            "Host": "evil.example", "Origin": "http://evil.example", "Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
