"""The server under hostile or broken conditions, over real HTTP (issue: harden the server).

Each test reproduces a probe that once failed:
- four clients sending 1 MB over-long prompts stalled every other stream (the prompts were
  tokenized whole, holding the interpreter lock) and /health took seconds;
- a wedged engine step left /health answering 200 "ok";
- /health showed internal error texts to anyone;
- a fault raised by one request's row ended every stream of its batch, with the
  exception's text in each (the real engine, poisoned by tests/faulty_server.py).

The server runs tests/fake_engine.py (a step costs `--step-delay` of sleep, so a stream's
rate is set by the server alone, not by how busy the two cores are) with the real
tokenizer's cost (`--costly-tokenizer`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import statistics
import sys
import time

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_http import API_KEY, ServerProcess, _fake_backend, _real_backend  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))

STEP_S = 0.01
HEADERS = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}


@pytest.fixture
def server_factory():
    servers: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        servers.append(ServerProcess(_fake_backend(), ("--step-delay", str(STEP_S), *flags)))
        return servers[-1]
    yield start
    for srv in servers:
        _kill_engine(srv)
        srv.proc.kill()
        srv.proc.wait()
        srv.log.close()


def _kill_engine(srv: ServerProcess) -> None:
    try:
        pid = httpx.get(f"{srv.url}/health", timeout=2).json().get("engine_pid")
        if pid:
            os.kill(pid, signal.SIGKILL)
    except (httpx.HTTPError, ProcessLookupError, ValueError):
        pass


async def _stream_rate(client: httpx.AsyncClient, tokens: int) -> tuple[float, float]:
    """(events per second, longest gap between two events in seconds) of one greedy stream
    (one token per engine step). The engine steps in another process whatever the front
    end does, so a stalled front end shows as gaps (events delivered in bursts) first."""
    body = {"prompt": "steady stream", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "speculative": {"num_tokens": 0}}
    times = []
    async with client.stream("POST", "/v1/completions", json=body, headers=HEADERS) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return len(gaps) / (times[-1] - times[0]), max(gaps)


async def _flood(client: httpx.AsyncClient, body: bytes, stop: asyncio.Event, statuses: list[int]):
    while not stop.is_set():
        r = await client.post("/v1/completions", content=body, headers=HEADERS)
        statuses.append(r.status_code)


async def _probe_health(client: httpx.AsyncClient, stop: asyncio.Event, latencies: list[float]):
    while not stop.is_set():
        t0 = time.monotonic()
        await client.get("/health")
        latencies.append(time.monotonic() - t0)
        await asyncio.sleep(0.05)


def test_over_long_prompts_do_not_stall_a_concurrent_stream(server_factory):
    """Four clients keep 1 MB prompts in flight (each refused: over the context); a stream
    beside them keeps >= 80% of its rate alone with no gap over 0.25 s (20 steps), and
    /health answers within 100 ms."""
    srv = server_factory("--costly-tokenizer", "--max-body-bytes", str(2 << 20))
    huge = b'{"prompt": "' + b"lorem ipsum dolor sit amet " * 40_000 + b'", "max_tokens": 4}'
    assert len(huge) > 1_000_000

    async def scenario():
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=limits) as client:
            alone = await _stream_rate(client, 150)
            stop, statuses, latencies = asyncio.Event(), [], []
            attackers = [asyncio.ensure_future(_flood(client, huge, stop, statuses)) for _ in range(4)]
            prober = asyncio.ensure_future(_probe_health(client, stop, latencies))
            await asyncio.sleep(0.5)
            attacked = await _stream_rate(client, 150)
            stop.set()
            await asyncio.gather(*attackers, prober)
            return alone, attacked, statuses, latencies

    (alone, _), (attacked, gap), statuses, latencies = asyncio.run(scenario())
    print(f"stream alone {alone:.0f}/s, beside {len(statuses)} refused 1 MB prompts {attacked:.0f}/s "
          f"(longest gap {gap * 1000:.0f} ms); /health median {statistics.median(latencies) * 1000:.0f} ms")
    assert statuses and set(statuses) == {400}, statuses[:10]
    assert attacked >= 0.8 * alone and gap < 0.25, (alone, attacked, gap, len(statuses))
    assert statistics.median(latencies) < 0.1, sorted(latencies)[-5:]


def test_a_wedged_engine_turns_health_503_within_the_stall_timeout(server_factory):
    """An engine step that hangs for 20 s: /health answers at once and turns 503 'stalled'
    once no step has completed for --stall-timeout seconds."""
    srv = server_factory("--stall-timeout", "1.5", "--hang-seconds", "20")

    async def scenario():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            assert (await client.get("/health")).status_code == 200
            body = {"prompt": "HANG_STEP", "max_tokens": 8, "stream": True}
            hung = asyncio.ensure_future(client.post("/v1/completions", json=body, headers=HEADERS))
            t0, seen = time.monotonic(), []
            while time.monotonic() - t0 < 6:
                t = time.monotonic()
                r = await client.get("/health")
                seen.append((round(t - t0, 2), r.status_code, time.monotonic() - t))
                if r.status_code == 503:
                    break
                await asyncio.sleep(0.1)
            hung.cancel()
            return seen, r.json()

    seen, last = asyncio.run(scenario())
    assert seen[-1][1] == 503 and last["status"] == "stalled", seen
    assert 1.5 <= seen[-1][0] <= 3.0, seen          # turned within the configured time
    assert max(latency for *_, latency in seen) < 0.5, seen  # never waited on the core
    assert "no engine step completed" in last["error"]


def test_health_shows_error_texts_only_with_the_api_key(server_factory):
    srv = server_factory()
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "FAIL_STEP", "max_tokens": 4},
                   headers=HEADERS, timeout=30)
    assert r.status_code == 500 and "injected" not in r.text
    anonymous = httpx.get(f"{srv.url}/health", timeout=5).json()
    keyed = httpx.get(f"{srv.url}/health", headers=HEADERS, timeout=5).json()
    assert "injected step failure" in keyed["last_step_error"]
    assert anonymous["last_step_error"].startswith("hidden"), anonymous


def _faulty_backend():
    real = _real_backend()

    def command(port: int, extra: list[str]) -> list[str]:
        return [sys.executable, os.path.join(TESTS, "faulty_server.py"), *real.command(port, extra)[4:]]
    return dataclasses.replace(real, name="faulty", command=command)


def test_a_poisoned_request_fails_alone_and_the_others_match_their_solo_runs():
    """The real engine, its forward raising whenever the POISON request's row is in the
    batch: the four requests beside it end with exactly their solo greedy text, the poisoned
    one with an error of its own (no exception text), and the step errors count it once."""
    srv = ServerProcess(_faulty_backend(), ("--spec", "ngram"))
    prompts = [f"Repeat after me: {w} {w} {w} {w} {w}" for w in ("apple", "river", "stone", "cloud")]

    async def complete(client, prompt, stream):
        body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": stream, "ignore_eos": True}
        if not stream:
            r = await client.post("/v1/completions", json=body, headers=HEADERS)
            return r.status_code, r.json()
        parts = []
        async with client.stream("POST", "/v1/completions", json=body, headers=HEADERS) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    parts.append(json.loads(line[6:]))
        return r.status_code, parts

    def text(parts) -> str:
        return "".join(c["choices"][0]["text"] for c in parts if c.get("choices"))

    async def scenario():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            solo = [text((await complete(client, p, True))[1]) for p in prompts]
            innocents = [asyncio.ensure_future(complete(client, p, True)) for p in prompts]
            await asyncio.sleep(0.3)  # they decode when the poisoned one arrives
            poisoned = await complete(client, "POISON " + prompts[0], False)
            return solo, [text(parts) for _, parts in await asyncio.gather(*innocents)], poisoned

    try:
        solo, together, (status, body) = asyncio.run(scenario())
        metrics = srv.metrics()
        health = httpx.get(f"{srv.url}/health", headers=HEADERS, timeout=10).json()
    finally:
        srv.stop()
        srv.log.close()
    assert together == solo and all(solo)
    assert status == 500 and body["error"]["code"] == "engine_error", body
    assert "internal error while generating this request" in body["error"]["message"]
    assert "injected" not in body["error"]["message"]
    assert metrics[("verispec:engine_step_errors_total", (("model_name", "smollm2-135m-instruct"),))] == 1
    assert "injected fault" in health["last_step_error"]
