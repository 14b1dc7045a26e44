"""The server over real HTTP: a subprocess on a free loopback port, driven by the official
`openai` client.

- chat and completions, streaming and not, with usage exact against the tokenizer;
- /metrics parsed with prometheus_client: speculation counter deltas over a run equal the
  sums of the per-response `spec` blocks;
- a bounded load test (64 requests, 16 at a time, 10% cancelled mid-stream, 10% invalid):
  every valid request returns exactly what it returns alone (greedy), nothing is a 5xx,
  and after the drain the KV integrity check holds with no block in use;
- SIGTERM shuts the server down cleanly with a stream in flight.

The server runs the real engine on the embedded default model (float32, greedy) by default;
VERISPEC_SERVER_TEST_BACKEND=fake runs the same tests against tests/fake_engine.py, which
is quicker when working on the HTTP layer alone.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))

API_KEY = "test-key-not-secret"


@dataclass(frozen=True)
class Backend:
    """How to start the server under test, and the tokenizer to check its usage against."""

    name: str
    command: Callable[[int, list[str]], list[str]]   # (port, extra flags) -> argv
    tokenizer: Callable[[], object]
    model: str
    startup_timeout_s: float
    request_timeout_s: float
    load_max_tokens: int                  # per valid load-test request (cancelled ones: x4)


def _fake_backend() -> Backend:
    def command(port: int, extra: list[str]) -> list[str]:
        return [sys.executable, str(TESTS / "fake_engine.py"), "--port", str(port),
                "--step-delay", "0.002", "--max-num-seqs", "8", "--no-access-log",
                "--log-level", "warning", "--shutdown-timeout", "3", "--max-body-bytes", "65536", *extra]

    def tokenizer():
        from fake_engine import ByteTokenizer
        return ByteTokenizer()
    return Backend("fake", command, tokenizer, "fake-model", 30, 60, 24)


def _real_backend(model: str = "smollm2-135m-instruct") -> Backend:
    def command(port: int, extra: list[str]) -> list[str]:
        return [sys.executable, "-c", "import sys; from verispec.cli import main; sys.exit(main())",
                "serve", "--model", model, "--dtype", "float32", "--port", str(port),
                "--no-access-log", "--log-level", "warning", "--shutdown-timeout", "3",
                "--max-body-bytes", "65536", *extra]

    def tokenizer():
        from verispec.model.loader import load_config_and_tokenizer, resolve_model
        return load_config_and_tokenizer(resolve_model(model))[1]
    return Backend("real", command, tokenizer, model, 300, 600, 8)


BACKEND = _fake_backend() if os.environ.get("VERISPEC_SERVER_TEST_BACKEND") == "fake" else _real_backend()


# ---------------------------------------------------------------------------- the server process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """The server as a subprocess; its log goes to a temp file (shown when a test fails)."""

    def __init__(self, backend: Backend, extra_flags: tuple[str, ...] = ()):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="verispec-server-", suffix=".log")
        env = {**os.environ, "VERISPEC_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(backend.command(self.port, list(extra_flags)), cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(backend.startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"server not ready after {timeout_s} s:\n{self.log_text()}")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=30).json()

    def metrics(self) -> dict[tuple, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def wait_idle(self, timeout_s: float = 30) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if h["in_flight"] == 0 and h["num_running"] == 0 and h["num_waiting"] == 0:
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"server did not drain: {h}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server ignored SIGTERM for {timeout_s} s:\n{self.log_text()}")
        return self.proc.returncode

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()


@contextlib.contextmanager
def clean_server(backend: Backend, extra_flags: tuple[str, ...] = ()):
    """A server that must shut down cleanly: exit status 0 (or SIGTERM), no traceback logged."""
    srv = ServerProcess(backend, extra_flags)
    try:
        yield srv
        rc = srv.stop()
        assert rc in (0, -signal.SIGTERM), f"exit status {rc}:\n{srv.log_text()}"
        assert "Traceback" not in srv.log_text(), srv.log_text()
    finally:
        srv.stop()
        srv.log.close()


@pytest.fixture(scope="module")
def server():
    with clean_server(BACKEND) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer():
    return BACKEND.tokenizer()


def client(server: ServerProcess, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=BACKEND.request_timeout_s, **kw)


def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                              timeout=BACKEND.request_timeout_s)


def spec_of(obj) -> dict | None:
    return (obj.model_extra or {}).get("spec")


def same_spec_shape(a: dict, b: dict) -> bool:
    """Two runs of one request report the same speculation fields, each self-consistent.

    Not the same values: adaptive k is chosen from measured pass times, so two identical
    requests may draft differently (their text is the same, which the callers check)."""
    def consistent(s: dict) -> bool:
        by_proposer = s["proposers"].values()
        return (s["method"] == "auto" and 0 <= s["accepted"] <= s["drafted"]  # the default method
                and sum(s["drafted_per_position"]) == s["drafted"] == sum(p["drafted"] for p in by_proposer)
                and sum(s["accepted_per_position"]) == s["accepted"] == sum(p["accepted"] for p in by_proposer))
    return a.keys() == b.keys() and a["method"] == b["method"] and consistent(a) and consistent(b)


# ---------------------------------------------------------------------------- API behaviour
def test_completions_and_chat_over_http_with_exact_usage(server, tokenizer):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [BACKEND.model]
    prompt = "The quick brown fox"
    r = c.completions.create(model=BACKEND.model, prompt=prompt, max_tokens=6, temperature=0,
                             extra_body={"ignore_eos": True})
    n_prompt = len(tokenizer.encode(prompt))
    usage = (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)
    assert usage == (n_prompt, 6, n_prompt + 6)
    assert r.choices[0].finish_reason == "length"
    # Prompt lookup at a fixed k drafts on a prompt that repeats itself; speculation off
    # drafts nothing. Both are counted in the response's spec block.
    def spec_for(method: str) -> dict:
        return spec_of(c.completions.create(
            model=BACKEND.model, prompt=", ".join(["1, 2, 3"] * 6) + ",", max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "speculative": {"method": method, "num_tokens": 4, "adaptive": False}}))
    spec = spec_for("ngram")
    assert spec["method"] == "ngram" and spec["num_drafts"] > 0 and spec["drafted"] > 0, spec
    spec = spec_for("none")
    assert spec["method"] == "none" and spec["num_drafts"] == spec["drafted"] == 0, spec

    chunks = list(c.completions.create(model=BACKEND.model, prompt=prompt, max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(r.usage)
    assert (chunks[-1].usage.prompt_tokens_details.cached_tokens  # the same prompt again
            >= r.usage.prompt_tokens_details.cached_tokens)
    assert same_spec_shape(spec_of(chunks[-1]), spec_of(r))

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there!"}]
    r = c.chat.completions.create(model=BACKEND.model, messages=messages, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    n_chat = len(tokenizer.encode_chat(messages))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_chat, 5, n_chat + 5)
    assert r.choices[0].message.role == "assistant"

    chunks = list(c.chat.completions.create(model=BACKEND.model, messages=messages, max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert _counts(chunks[-1].usage) == _counts(r.usage) and same_spec_shape(spec_of(chunks[-1]), spec_of(r))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens_details.cached_tokens

    ids = tokenizer.encode("token ids in")
    r = c.completions.create(model=BACKEND.model, prompt=ids, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(ids)


def test_errors_over_http(server):
    c = client(server)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=BACKEND.model, prompt="x", top_p=0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model"
    r = httpx.post(f"{server.url}/v1/completions", content=b"{oops",
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (96 << 10),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 413


def test_sampling_values_that_underflow_float32_give_the_greedy_answer(server):
    """temperature 1e-45 and top_p 1e-46 (0 in float32) once returned empty text with
    finish_reason "stop"; they are the T -> 0 / top_p -> 0 limits: the greedy answer."""
    c = client(server)

    def text(**sampling) -> tuple[str, str]:
        r = c.completions.create(model=BACKEND.model, prompt="The capital of France is",
                                 max_tokens=8, **sampling)
        return r.choices[0].text, r.choices[0].finish_reason
    greedy = text(temperature=0)
    assert greedy[0]
    assert text(temperature=1e-45) == greedy
    if BACKEND.name == "real":  # the fake engine has no top-p to underflow
        assert text(temperature=1.0, top_p=1e-46, seed=3) == greedy


def test_penalties_logit_bias_and_stop_token_ids_over_http(server, tokenizer):
    """Each sampling field of the vLLM/OpenAI surface goes through to the engine."""
    if BACKEND.name != "real":
        pytest.skip("the fake engine has no logits")
    c = client(server)
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    forced = tokenizer.encode(" the")[-1]

    def complete(max_tokens=12, **extra):
        r = c.completions.create(model=BACKEND.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                 extra_body={"ignore_eos": True, **extra})
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    plain = complete()
    assert complete(top_k=-1) == plain
    assert complete(repetition_penalty=2.0)[0] != plain[0]
    assert complete(frequency_penalty=2.0, presence_penalty=2.0)[0] != plain[0]
    bias = {str(forced): 100}
    assert complete(max_tokens=3, logit_bias=bias) == (tokenizer.decode([forced] * 3), "length", 3)
    assert complete(logit_bias=bias, stop_token_ids=[forced])[1:] == ("stop", 1)
    assert complete(logit_bias=bias, stop_token_ids=[forced], min_tokens=3)[1:] == ("stop", 4)
    for field, value in (("logit_bias", {"999999999": 1}), ("stop_token_ids", [999999999]),
                         ("presence_penalty", 3), ("min_tokens", 20)):
        with pytest.raises(openai.BadRequestError) as e:
            complete(**{field: value})
        assert e.value.body["param"] == field, e.value.body


def _sum_specs(specs: list[dict]) -> dict:
    out = {"num_drafts": 0, "drafted": 0, "accepted": 0, "per_pos": {}}
    for s in specs:
        for k in ("num_drafts", "drafted", "accepted"):
            out[k] += s[k]
        for pos, n in enumerate(s["accepted_per_position"]):
            out["per_pos"][pos] = out["per_pos"].get(pos, 0) + n
    return out


def _metric(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == val for k, val in labels.items()))


def test_spec_counter_deltas_equal_the_sum_of_response_stats(server):
    c = client(server)
    before = server.metrics()
    specs, usages = [], []
    for i in range(6):
        body = dict(model=BACKEND.model, prompt=f"repeat after me: {i} {i} {i} {i}", max_tokens=8 + i,
                    temperature=0, extra_body={"speculative": {"num_tokens": 1 + i % 3}})
        if i % 2:
            chunks = list(c.completions.create(**body, stream=True, stream_options={"include_usage": True}))
            specs.append(spec_of(chunks[-1]))
            usages.append(chunks[-1].usage)
        else:
            r = c.completions.create(**body)
            specs.append(spec_of(r))
            usages.append(r.usage)
    server.wait_idle()
    after = server.metrics()
    sums = _sum_specs(specs)
    method = specs[0]["method"]
    assert all(s["method"] == method for s in specs)

    def delta(name, **labels):
        return _metric(after, name, **labels) - _metric(before, name, **labels)
    labels = {"model_name": BACKEND.model, "method": method}
    assert delta("vllm:spec_decode_num_drafts_total", **labels) == sums["num_drafts"]
    assert delta("vllm:spec_decode_num_draft_tokens_total", **labels) == sums["drafted"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total", **labels) == sums["accepted"]
    for pos, n in sums["per_pos"].items():
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(pos), **labels) == n
    proposers = {name for s in specs for name in s["proposers"]}
    assert proposers == {"ngram"}  # the default "auto" without a head: the lookup alone
    for name in proposers:
        for field, metric in (("drafted", "verispec:spec_proposer_draft_tokens_total"),
                              ("accepted", "verispec:spec_proposer_accepted_tokens_total")):
            assert delta(metric, model_name=BACKEND.model, proposer=name) == \
                sum(s["proposers"].get(name, {}).get(field, 0) for s in specs) > 0
    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("vllm:request_success_total") == len(specs)


def test_cached_tokens_for_a_repeated_long_prompt(server):
    """The second run of a long prompt is served from the radix prefix cache: its usage says
    how many prompt tokens (> 0, whole blocks, fewer than the prompt); a cold one says 0."""
    c = client(server)
    prompt = f"{time.time_ns()} " + "the quick brown fox jumps over the lazy dog " * 8
    before = server.metrics()
    cold = c.completions.create(model=BACKEND.model, prompt=prompt, max_tokens=2, temperature=0)
    warm = c.completions.create(model=BACKEND.model, prompt=prompt, max_tokens=2, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < warm.usage.prompt_tokens, (cached, warm.usage)
    assert warm.system_fingerprint == cold.system_fingerprint and cold.system_fingerprint.startswith("fp_")
    server.wait_idle()
    after = server.metrics()
    assert _metric(after, "vllm:prefix_cache_hits_total") - _metric(before, "vllm:prefix_cache_hits_total") >= cached


# ---------------------------------------------------------------------------- load
NUM_REQUESTS = 64
CONCURRENCY = 16

PROMPTS = ["Once upon a time", "def fibonacci(n):", "The three primary colours are",
           "Translate to French: good morning", "List: apples, pears,", "In 1969, the first",
           "Q: What is 2 + 2?\nA:", "import numpy as np\n"]
INVALID = [dict(temperature=-1.0), dict(top_p=0.0), dict(n=17), dict(max_tokens=0),
           dict(model="no-such-model"), dict(extra_body={"speculative": {"method": "medusa"}})]


def _template(i: int) -> dict:
    """A valid greedy request: chat or completion, varied speculation (outputs must not care)."""
    spec = [None, {"method": "none"}, {"num_tokens": 2}, {"num_tokens": 4}][i % 4]
    extra = {"speculative": spec} if spec else {}
    prompt = PROMPTS[i % len(PROMPTS)]
    if i % 2:
        return dict(kind="chat", messages=[{"role": "user", "content": prompt}],
                    max_tokens=BACKEND.load_max_tokens, temperature=0, extra_body=extra)
    return dict(kind="completion", prompt=prompt, max_tokens=BACKEND.load_max_tokens, temperature=0,
                extra_body=extra)


async def _run_one(c: openai.AsyncOpenAI, req: dict, stream: bool, cancel_after: int | None = None):
    """(text, finish_reason, usage) of one request; cancel_after closes the stream early."""
    req = dict(req)
    kind = req.pop("kind")
    create = c.chat.completions.create if kind == "chat" else c.completions.create
    req.setdefault("model", BACKEND.model)
    if not stream:
        r = await create(**req)
        text = r.choices[0].message.content if kind == "chat" else r.choices[0].text
        return text, r.choices[0].finish_reason, _counts(r.usage)
    s = await create(**req, stream=True, stream_options={"include_usage": True})
    parts, finish, usage, n = [], None, None, 0
    async for ch in s:
        n += 1
        if cancel_after is not None and n >= cancel_after:
            await s.close()  # the client goes away mid-stream
            return None
        usage = ch.usage or usage
        for choice in ch.choices:
            parts.append((choice.delta.content or "") if kind == "chat" else choice.text)
            finish = choice.finish_reason or finish
    return "".join(parts), finish, _counts(usage)


def _counts(usage) -> tuple | None:
    """The token counts of a usage (cached_tokens depends on what ran before: not compared)."""
    return None if usage is None else (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def test_load_cancellations_and_invalid_requests_leave_a_clean_engine(server):
    async def scenario():
        c = aclient(server)
        templates = [_template(i) for i in range(2 * len(PROMPTS))]
        alone = [await _run_one(c, t, stream=False) for t in templates]  # each request by itself

        before = server.metrics()
        rng = random.Random(1234)
        plan = ["cancel"] * (NUM_REQUESTS // 10) + ["invalid"] * (NUM_REQUESTS // 10)
        plan += ["valid"] * (NUM_REQUESTS - len(plan))
        rng.shuffle(plan)
        gate = asyncio.Semaphore(CONCURRENCY)
        failures: list[str] = []
        counts = {"valid": 0, "cancel": 0, "invalid": 0}

        async def one(i: int, what: str):
            t = i % len(templates)
            async with gate:
                try:
                    if what == "invalid":
                        bad = {**templates[t], **INVALID[i % len(INVALID)]}
                        try:
                            await _run_one(c, bad, stream=bool(i % 2))
                            failures.append(f"#{i} invalid request {INVALID[i % len(INVALID)]} succeeded")
                        except openai.BadRequestError:
                            counts["invalid"] += 1
                    elif what == "cancel":
                        long = {**templates[t], "max_tokens": 4 * BACKEND.load_max_tokens,
                                "extra_body": {**templates[t]["extra_body"], "ignore_eos": True}}
                        await _run_one(c, long, stream=True, cancel_after=2)
                        counts["cancel"] += 1
                    else:
                        got = await _run_one(c, templates[t], stream=bool(i % 3))
                        if got != alone[t]:
                            failures.append(f"#{i} template {t}: {got!r} != alone {alone[t]!r}")
                        counts["valid"] += 1
                except openai.APIError as exc:
                    failures.append(f"#{i} {what}: {type(exc).__name__}: {exc}")

        t0 = time.monotonic()
        await asyncio.gather(*(one(i, what) for i, what in enumerate(plan)))
        elapsed = time.monotonic() - t0
        await c.close()
        return failures, counts, before, elapsed

    failures, counts, before, elapsed = asyncio.run(scenario())
    assert not failures, "\n".join(failures[:20])
    tenth = NUM_REQUESTS // 10
    assert counts == {"valid": NUM_REQUESTS - 2 * tenth, "cancel": tenth, "invalid": tenth}, counts
    health = server.wait_idle()
    assert health["kv_blocks_used"] == 0, health
    assert health["integrity"] == "ok", health
    after = server.metrics()
    name = "verispec:request_aborted_total"
    aborted = _metric(after, name) - _metric(before, name)
    assert 0 < aborted <= tenth
    assert _metric(after, "verispec:request_error_total") == 0
    print(f"load test: {NUM_REQUESTS} requests in {elapsed:.1f} s")


def test_sigterm_with_a_stream_in_flight_ends_it_cleanly_and_exits():
    """On SIGTERM an unfinished stream gets an error event and [DONE], not a cut connection."""
    srv = ServerProcess(BACKEND, ("--shutdown-timeout", "0"))
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "long story", "max_tokens": 400, "ignore_eos": True,
                                "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(signal.SIGTERM)
            data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert "shutting down" in data[-2]
        rc = srv.proc.wait(15)
        assert rc in (0, -signal.SIGTERM), srv.log_text()
        assert "Traceback" not in srv.log_text(), srv.log_text()
    finally:
        srv.stop()
        srv.log.close()


def test_engine_runs_in_its_own_process_apart_from_the_http_front_end(server):
    """The design's invariant (engine/core.py): the engine computes on the main thread of a
    process of its own, never on a thread beside the event loop, where a second OpenMP team
    turned every barrier into a futex wait and halved decoding. A server that ran the engine
    in its own process (the old thread design) reports its own pid and fails this."""
    health = server.health()
    assert health["engine_pid"] not in (None, server.proc.pid)
    parent = Path(f"/proc/{health['engine_pid']}/stat").read_text().rsplit(")", 1)[1].split()[1]
    assert int(parent) == server.proc.pid  # the server's own child, not a stray process


def test_killing_the_engine_process_ends_every_open_request_and_the_server():
    """SIGKILL to the engine core mid-stream: open streams end with an error event naming the
    cause and non-streaming requests with a 503 within 5 s, /health stops saying ok, and the
    server exits non-zero (a supervisor restarts it); nothing hangs."""
    srv = ServerProcess(BACKEND)
    try:
        engine_pid = srv.health()["engine_pid"]
        c = aclient(srv)
        long = dict(max_tokens=450, extra_body={"ignore_eos": True})  # seconds on either backend

        async def streamed() -> str:
            stream = await c.completions.create(model=BACKEND.model, prompt="a long tale", stream=True, **long)
            try:
                async for _ in stream:
                    pass
            except openai.APIError as exc:
                return str(exc)
            return "ended without an error"

        async def plain() -> int:
            try:
                await c.completions.create(model=BACKEND.model, prompt="another tale", **long)
            except openai.APIStatusError as exc:
                return exc.status_code
            return 200

        async def scenario():
            tasks = [asyncio.create_task(streamed()), asyncio.create_task(plain())]
            # both accepted and running (in_flight also counts requests not yet accepted,
            # whose create() would raise the 503 instead of their stream)
            while (h := srv.health())["in_flight"] < 2 or (h.get("num_running") or 0) < 2:
                await asyncio.sleep(0.01)
            os.kill(engine_pid, signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
            return results, time.monotonic() - t0

        (stream_error, status), elapsed = asyncio.run(scenario())
        assert "engine process exited unexpectedly (killed by SIGKILL)" in stream_error
        assert status == 503 and elapsed < 5
        try:
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone: also not ok
        assert srv.proc.wait(15) == 1, srv.log_text()
    finally:
        srv.stop()
        srv.log.close()


def test_continuous_usage_stats_count_every_chunk(server):
    """stream_options.continuous_usage_stats: each chunk carries the usage so far, so a client
    (verispec bench) knows the tokens of every chunk; they add up to the final usage."""
    chunks = list(client(server).chat.completions.create(
        model=BACKEND.model, messages=[{"role": "user", "content": "count with me"}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted[0] == 0 and counted == sorted(counted)  # the role chunk, then growing
    assert counted[-1] == chunks[-1].usage.completion_tokens == 12
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_a_seeded_request_returns_the_same_text_whatever_else_is_in_flight(server):
    """Seeded sampling is keyed by (seed, output position): the same seeded request at
    T = 0.8 gives one text alone, beside other requests, and without speculation."""
    async def scenario():
        c = aclient(server)
        req = dict(model=BACKEND.model, prompt="Rewrite politely: send me the report now.",
                   max_tokens=24, temperature=0.8, top_p=0.95, seed=77)

        async def once(**extra) -> str:
            return (await c.completions.create(**req, **extra)).choices[0].text
        alone = await once()
        others = [c.completions.create(model=BACKEND.model, prompt=p, max_tokens=24, temperature=0.8)
                  for p in PROMPTS[:4]]
        busy, *_ = await asyncio.gather(once(), *others)
        plain = await once(extra_body={"speculative": {"method": "none"}})
        other_seed = await c.completions.create(**{**req, "seed": 78})
        await c.close()
        return alone, busy, plain, other_seed.choices[0].text
    alone, busy, plain, other_seed = asyncio.run(scenario())
    assert alone and alone == busy == plain
    if BACKEND.name == "real":  # the fake engine's seeded draws are its own
        assert other_seed != alone


# ---------------------------------------------------------------------------- logprobs
needs_engine = pytest.mark.skipif(BACKEND.name == "fake", reason="the fake engine computes no logprobs")


@needs_engine
def test_completion_logprobs_streamed_and_not_parse_and_agree(server):
    c = client(server)
    req = dict(model=BACKEND.model, prompt="The capital of France is", max_tokens=8, temperature=0,
               logprobs=2, extra_body={"ignore_eos": True})
    r = c.completions.create(**req)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[tok] == value <= 0
        assert value == max(top.values())  # greedy: the sampled token is the most likely
    chunks = list(c.completions.create(**req, stream=True))
    streamed = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs
                                              if ch.choices and ch.choices[0].logprobs else [])]
    assert len(streamed) == 8 and all(abs(a - b) < 1e-4 for a, b in zip(streamed, lp.token_logprobs))
    offsets = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


@needs_engine
def test_chat_logprobs_and_top_logprobs_streamed_and_not(server):
    c = client(server)
    req = dict(model=BACKEND.model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
               temperature=0.7, seed=3, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**req)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and len(content[0].top_logprobs) == 3
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.bytes == list(e.token.encode()) and -9999.0 <= e.logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    chunks = list(c.chat.completions.create(**req, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    plain = c.chat.completions.create(**{k: v for k, v in req.items() if k not in ("logprobs", "top_logprobs")})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_bad_logprobs_values_are_400s_naming_the_field(server):
    c = client(server)
    msgs = [{"role": "user", "content": "x"}]
    for call, param in ((lambda: c.completions.create(model=BACKEND.model, prompt="x", logprobs=21), "logprobs"),
                        (lambda: c.chat.completions.create(model=BACKEND.model, messages=msgs, top_logprobs=2),
                         "top_logprobs"),
                        (lambda: c.chat.completions.create(model=BACKEND.model, messages=msgs, logprobs=True,
                                                           top_logprobs=21), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.body["param"] == param


# ---------------------------------------------------------------------------- n > 1
def _choice_texts(kind: str, r, n: int) -> list[str]:
    assert [c.index for c in r.choices] == list(range(n))
    return [c.message.content if kind == "chat" else c.text for c in r.choices]


def _streamed_choices(kind: str, chunks: list, n: int) -> tuple[list[str], list, object]:
    """(text per index, finish_reason per index, the usage) of an n-choice stream."""
    texts, finishes, roles, usage = [""] * n, [None] * n, [0] * n, None
    for ch in chunks:
        usage = ch.usage or usage
        for c in ch.choices:
            if kind == "chat":
                roles[c.index] += c.delta.role == "assistant"
                texts[c.index] += c.delta.content or ""
            else:
                texts[c.index] += c.text
            if c.finish_reason is not None:
                assert finishes[c.index] is None  # one finishing chunk per choice
                finishes[c.index] = c.finish_reason
    if kind == "chat":
        assert roles == [1] * n  # the role chunk once per index
    return texts, finishes, usage


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_n_seeded_choices_equal_independent_requests_seeded_s_plus_i(server, kind):
    """n=3 with seed 5 at T=0.8 gives the texts of three requests seeded 5, 6 and 7 (sibling i
    is seeded s + i), streamed or not; usage counts the prompt once and sums the completions."""
    c = client(server)
    if kind == "chat":
        create = c.chat.completions.create
        req = dict(model=BACKEND.model, messages=[{"role": "user", "content": "Tell me about cats."}])
    else:
        create = c.completions.create
        req = dict(model=BACKEND.model, prompt="Rewrite politely: send me the report now.")
    req.update(max_tokens=16, temperature=0.8, top_p=0.95)
    singles = [create(**req, seed=5 + i) for i in range(3)]
    expected = [_choice_texts(kind, r, 1)[0] for r in singles]
    r = create(**req, seed=5, n=3)
    assert _choice_texts(kind, r, 3) == expected
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in singles)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert [ch.finish_reason for ch in r.choices] == [x.choices[0].finish_reason for x in singles]
    chunks = list(create(**req, seed=5, n=3, stream=True, stream_options={"include_usage": True}))
    texts, finishes, usage = _streamed_choices(kind, chunks, 3)
    assert texts == expected and finishes == [ch.finish_reason for ch in r.choices]
    assert chunks[-1].choices == [] and usage == chunks[-1].usage
    assert _counts(usage) == _counts(r.usage)
    assert len({ch.id for ch in chunks}) == 1
    if BACKEND.name == "real":
        assert len(set(expected)) > 1  # different seeds, different samples
    server.wait_idle()


def test_n_greedy_gives_identical_choices_with_their_own_logprobs(server):
    c = client(server)
    r = c.completions.create(model=BACKEND.model, prompt="The capital of France is", max_tokens=8,
                             temperature=0, n=2, best_of=2,
                             logprobs=1 if BACKEND.name == "real" else None)
    a, b = _choice_texts("completion", r, 2)
    assert a and a == b
    if BACKEND.name == "real":
        assert r.choices[0].logprobs.tokens == r.choices[1].logprobs.tokens
        assert "".join(r.choices[1].logprobs.tokens) == b
    req = dict(model=BACKEND.model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8,
               temperature=0)
    one = c.chat.completions.create(**req)
    chat = c.chat.completions.create(**req, n=2)
    x, y = _choice_texts("chat", chat, 2)
    assert x == y == one.choices[0].message.content
    assert chat.usage.prompt_tokens == one.usage.prompt_tokens
    assert chat.usage.completion_tokens == 2 * one.usage.completion_tokens  # both choices counted


def test_n_stream_closed_early_aborts_every_sibling(server):
    async def scenario():
        c = aclient(server)
        s = await c.completions.create(model=BACKEND.model, prompt="Once upon a time", max_tokens=400,
                                       temperature=0.8, n=3, stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in s:
            seen += 1
            if seen >= 6:
                await s.close()  # the client goes away mid-stream
                break
        await c.close()
    asyncio.run(scenario())
    health = server.wait_idle()
    assert health["in_flight"] == 0 and health["kv_blocks_used"] == 0, health
    assert health["integrity"] == "ok", health



# ---------------------------------------------------------------------------- batched prompts, echo
def test_a_batch_of_prompts_answers_what_each_prompt_answers_alone(server, tokenizer):
    """Greedy: choice i of prompt = [p0, p1, p2] is the completion of p_i sent alone, streamed
    or not, text or token ids; echo puts each prompt (a token-id prompt decoded) first."""
    c = client(server)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3,"]
    req = dict(model=BACKEND.model, max_tokens=6, temperature=0)
    singles = [c.completions.create(prompt=p, **req) for p in prompts]
    expected = [s.choices[0].text for s in singles]
    r = c.completions.create(prompt=prompts, **req)
    assert _choice_texts("completion", r, 3) == expected
    assert _counts(r.usage) == tuple(map(sum, zip(*(_counts(s.usage) for s in singles))))
    ids = [tokenizer.encode(p) for p in prompts]
    assert _choice_texts("completion", c.completions.create(prompt=ids, **req), 3) == expected
    chunks = list(c.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **req))
    texts, finishes, usage = _streamed_choices("completion", chunks, 3)
    assert texts == expected and finishes == [ch.finish_reason for ch in r.choices]
    assert _counts(usage) == _counts(r.usage)
    echoed = c.completions.create(prompt=[prompts[0], ids[1]], echo=True, **req)
    assert _choice_texts("completion", echoed, 2) == [prompts[0] + expected[0],
                                                       tokenizer.decode(ids[1]) + expected[1]]
    server.wait_idle()


def test_queue_time_ends_when_the_engine_first_schedules_the_request():
    """A prompt prefilled in many chunks (--max-num-batched-tokens 32) waits in no queue:
    the engine admits it at once, so its queue time is a sliver of its prefill time. Taking
    the first token's step as "first scheduled" would count every earlier chunk as queue."""
    with clean_server(BACKEND, ("--max-num-batched-tokens", "32", "--spec", "none")) as srv:
        before = srv.metrics()
        prompt = " ".join(f"word{i}" for i in range(120))
        client(srv).completions.create(model=BACKEND.model, prompt=prompt, max_tokens=4, temperature=0)
        srv.wait_idle()
        after = srv.metrics()

        def delta(name):
            return _metric(after, name) - _metric(before, name)
        queue, prefill = delta("vllm:request_queue_time_seconds_sum"), delta("vllm:request_prefill_time_seconds_sum")
        assert delta("vllm:request_queue_time_seconds_count") == 1
        assert queue < 0.2 * prefill, (queue, prefill)
