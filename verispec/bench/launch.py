"""Launch a local `verispec serve` for the length of a benchmark run.

`verispec bench --launch "--spec ngram --dtype float32" ...` benchmarks verispec's own
engine without a separately started server: the server runs in its own process (so the
client never competes with the engine for the GIL) on a free loopback port, and the run
goes through exactly the same HTTP evidence path (usage, streamed chunks, /metrics) as
against any other endpoint.
"""
from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import sys
import time

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
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise LaunchError(f"`verispec serve {engine_args}` exited with {proc.returncode}: "
                                  f"{(proc.stderr.read() or '').strip().splitlines()[-1:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"`verispec serve {engine_args}` not ready within {ready_timeout_s:.0f} s")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
