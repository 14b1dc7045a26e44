"""Launch a local server for the length of a benchmark run: verispec's or llama.cpp's.

`verispec bench --launch "--spec ngram --dtype float32" ...` benchmarks verispec's own
engine without a separately started server: the server runs in its own process (so the
client never competes with the engine for the GIL) on a free loopback port, and the run
goes through exactly the same HTTP evidence path (usage, streamed chunks, /metrics) as
against any other endpoint.

`verispec bench --launch-llama-server "--spec-type ngram-mod" ...` does the same for
llama.cpp's `llama-server` (a peer to measure against, built in a benchmark-only
environment: docs/benchmarks.md; never a dependency): same GGUF, loopback port, threads
and the model's own chat template (--jinja). Its n-gram modes learn from every request
they serve, so `FreshServerBackend` starts a new server for each request: a later prompt
never drafts from an earlier one's output.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import httpx


class LaunchError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(engine_args: str, ready_timeout_s: float = 300.0):
    """Yield the base URL (…/v1) of a `verispec serve` started with `engine_args`."""
    port = _free_port()
    cmd = [sys.executable, "-m", "verispec.cli", "serve", *shlex.split(engine_args),
           "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning"]
    with _running(cmd, port, f"verispec serve {engine_args}", ready_timeout_s):
        yield f"http://127.0.0.1:{port}/v1"


@dataclass(frozen=True)
class LlamaServer:
    """How to start llama.cpp's llama-server as a benchmark contender."""

    binary: str          # path to llama-server
    gguf: str            # the model file (the same one verispec serves)
    threads: int         # -t and -tb
    parallel: int = 1    # -np: sequences decoded together (the run's concurrency)
    extra_args: str = ""  # e.g. "--spec-type ngram-mod"
    context_per_slot: int = 8192

    def command(self, port: int) -> list[str]:
        return [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(port),
                "-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.parallel),
                "-c", str(self.context_per_slot * self.parallel), "--jinja", "--no-webui",
                *shlex.split(self.extra_args)]


def find_llama_server(binary: str | None) -> str:
    """The llama-server to run: `binary`, else $LLAMA_SERVER, else one on PATH."""
    found = binary or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not found or not os.access(found, os.X_OK):
        raise LaunchError("no llama-server found: pass --llama-server-bin PATH or set LLAMA_SERVER "
                          "(build it as docs/benchmarks.md, 'Serving', describes)")
    return found


def llama_server_spec(extra_args: str, binary: str | None, model: str | None, threads: int | None,
                      parallel: int) -> LlamaServer:
    """A LlamaServer for `verispec bench`: the GGUF of `model` (a .gguf path or a registry
    name, default verispec's default model) and the threads `verispec serve` would use."""
    from verispec.config import EngineConfig, auto_threads
    from verispec.model.loader import resolve_model
    source = resolve_model(model or EngineConfig().model)
    if source.kind != "gguf":
        raise LaunchError(f"llama-server needs a GGUF file; {model!r} resolves to a {source.kind} model")
    return LlamaServer(find_llama_server(binary), str(source.path), threads or auto_threads("serve"),
                       max(1, parallel), extra_args)


@contextlib.contextmanager
def launched_llama_server(spec: LlamaServer, ready_timeout_s: float = 120.0):
    """Yield the base URL (…/v1) of a llama-server started from `spec`."""
    port = _free_port()
    with _running(spec.command(port), port, f"llama-server {spec.extra_args}".strip(), ready_timeout_s):
        yield f"http://127.0.0.1:{port}/v1"


@contextlib.contextmanager
def _running(cmd: list[str], port: int, name: str, ready_timeout_s: float):
    """Run `cmd` until the block ends; wait first until its /health answers 200. Its output
    goes to a temporary file (a pipe nobody reads would block a chatty server)."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise LaunchError(f"`{name}` exited with {proc.returncode}: "
                                  f"{log.read().strip().splitlines()[-1:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"`{name}` not ready within {ready_timeout_s:.0f} s")
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class FreshServerBackend:
    """A ChatBackend that starts a new llama-server for every request (n-gram modes keep
    what they learnt across requests); start-up and a one-token warm-up request are outside
    the request's timings."""

    def __init__(self, spec: LlamaServer, api_key: str | None = None, timeout_s: float = 600.0,
                 continuous_usage: bool = True):
        self.spec, self.api_key, self.timeout_s, self.continuous_usage = spec, api_key, timeout_s, continuous_usage

    def _backend(self, base_url: str):
        from verispec.bench.client import OpenAIHTTPBackend
        return OpenAIHTTPBackend(base_url, self.api_key, self.timeout_s, self.continuous_usage, keepalive=False)

    async def list_models(self) -> list[str]:
        with launched_llama_server(self.spec) as url:
            backend = self._backend(url)
            try:
                return await backend.list_models()
            finally:
                await backend.aclose()

    async def chat(self, request):
        with launched_llama_server(self.spec) as url:
            backend = self._backend(url)
            try:
                # untimed: a new process's first request pages the weights in and sizes its
                # buffers; one token on an unrelated prompt leaves its n-gram state ~empty
                await backend.chat(replace(request, messages=({"role": "user", "content": "Hi"},),
                                           max_tokens=1))
                return await backend.chat(request)
            finally:
                await backend.aclose()

    async def aclose(self) -> None:
        pass
