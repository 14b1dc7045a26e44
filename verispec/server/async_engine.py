"""The front end's handle on the engine core, driven from asyncio.

The engine runs in an engine-core loop (verispec/engine/core.py): in a process of its own
(`AsyncEngine.spawn(factory)`, what `verispec serve` does) or, for tests and embedding, on
a thread of this process (`AsyncEngine(engine)`: much slower for the real engine, see
core.py). Either way the two sides exchange messages over zmq and never share objects:

    asyncio side (HTTP handlers)               engine core
    add_request() ---- Add ------------------>  engine.add_request -> ACCEPTED | REJECTED
    RequestStream.__anext__ <-- CoreOutputs --  one message per step: every request's new
                                                tokens and text, finishes, failures, stats
    RequestStream.abort() ---- Abort -------->  engine.abort_request (frees its KV at once)
    call(fn) ---- Call ---------------------->  fn(engine) between steps (health, tests)

A request's life: add_request() waits until the core has called engine.add_request (so bad
input surfaces as ValueError before any response is sent), then returns a RequestStream.
Iterating it yields RequestOutputs until one is `finished`; `spec` is filled in on the
last one. Leaving it early (break + aclose, `async with`, cancellation, a client
disconnect) aborts the request. A request the engine fails raises RequestFailed from its
stream; the others go on. A consumer that stops reading (a client that never reads its
stream) gets its request aborted once `max_buffered_outputs` outputs wait for it, so the
buffer is bounded. If the core process dies, every open stream raises EngineDied naming the
cause, `is_alive` turns false and `on_death` is called (serve exits non-zero).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import math
import os
import pickle
import random
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

import zmq

from verispec.engine import messages as M
from verispec.engine.core import CoreAddresses, EngineCore, health_probe, run_core_process
from verispec.outputs import RequestOutput, SpecStats
from verispec.sampling import SamplingParams

log = logging.getLogger("verispec.server")


# Retry-After for a 429: the time the queue ahead takes to drain at the measured rate of
# finishes, within these bounds, times a random factor so refused clients do not return
# together (a fixed value brings them back as one wave, to be refused again).
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
RETRY_JITTER = 0.5          # up to +50%
DRAIN_WINDOW = 64           # finishes the rate is measured over


class QueueFull(RuntimeError):
    """Too many requests are already waiting for the engine; retry later (HTTP 429)."""

    def __init__(self, num_waiting: int, max_waiting: int, retry_after_s: int = RETRY_AFTER_MIN_S):
        super().__init__(f"{num_waiting} requests are waiting (max_waiting={max_waiting}); "
                         f"retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class EngineClosed(RuntimeError):
    """The engine is shutting down or has stopped: it takes no new work (HTTP 503)."""


class EngineDied(EngineClosed):
    """The engine-core process ended without being asked to."""


class EngineStartError(RuntimeError):
    """The engine could not be built (bad_input: a configuration error, exit status 2)."""

    def __init__(self, message: str, bad_input: bool):
        super().__init__(message)
        self.bad_input = bad_input


class RequestFailed(RuntimeError):
    """The engine failed this one request (RequestOutput.error or a failed step)."""


@dataclass(eq=False)
class RequestRecord:
    """What the front end knows about one request; handed to the observer."""

    request_id: str
    prompt_len: int
    method: str                       # speculation method label for metrics
    arrival_time: float               # time.monotonic() when add_request was called
    first_token_time: float | None = None
    last_output: RequestOutput | None = None
    # For the latency histograms (time.monotonic(); see verispec/server/metrics.py):
    scheduled_time: float | None = None   # when the engine first scheduled it (its own clock reading)
    last_token_time: float | None = None  # the latest output that carried tokens
    prev_token_time: float | None = None  # the one before it


class RequestObserver(Protocol):
    """Hooks called on the event loop (metrics); exceptions in them are logged, not raised."""

    def on_request_started(self, record: RequestRecord) -> None: ...
    def on_first_token(self, record: RequestRecord) -> None: ...
    def on_request_output(self, record: RequestRecord, output: RequestOutput) -> None: ...
    def on_request_finished(self, record: RequestRecord, outcome: str) -> None: ...
    def on_step_error(self, exc: BaseException, count: int) -> None: ...


_ACCEPTED = object()  # first item of a queue: the engine took the request


class _Channel:
    """One request as the front end sees it: its outputs so far and its consumer's queue."""

    __slots__ = ("record", "prompt", "queue", "token_ids", "text", "spec", "aborting", "cached", "logprobs")

    def __init__(self, record: RequestRecord, prompt: list[int]):
        self.record = record
        self.prompt = prompt
        self.queue: asyncio.Queue = asyncio.Queue()
        self.token_ids: list[int] = []
        self.text = ""
        self.spec = SpecStats()
        self.aborting = False      # an Abort was sent; the core's ABORTED ends the channel
        self.cached = 0            # prompt tokens the prefix cache served (known from the first output)
        self.logprobs: list | None = None  # per token so far, when the request asked for them

    def output(self, ev: M.RequestEvent) -> RequestOutput:
        self.token_ids.extend(ev.new_token_ids)
        self.text += ev.new_text
        if ev.spec is not None:
            self.spec = _spec_stats(ev.spec)
        if ev.num_cached_tokens:
            self.cached = ev.num_cached_tokens
        if ev.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(ev.logprobs)
        return RequestOutput(self.record.request_id, self.prompt, list(self.token_ids),
                             list(ev.new_token_ids), self.text, ev.new_text, ev.finished,
                             ev.finish_reason, self.spec, ev.error, num_cached_tokens=self.cached,
                             logprobs=self.logprobs, new_logprobs=ev.logprobs)


class RequestStream:
    """Async iterator over one request's outputs; leaving it early aborts the request."""

    def __init__(self, engine: "AsyncEngine", channel: _Channel):
        self._engine = engine
        self._channel = channel
        self._done = False

    @property
    def request_id(self) -> str:
        return self._channel.record.request_id

    @property
    def method(self) -> str:
        return self._channel.record.method

    @property
    def prompt_len(self) -> int:
        return self._channel.record.prompt_len

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._channel.queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already ended; safe to call more than once."""
        if not self._done:
            self._done = True
            self._engine._submit_abort(self._channel)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()


class AsyncEngine:
    """Front end of one engine core; see the module docstring for the protocol."""

    def __init__(self, engine=None, *, factory: Callable[[], Any] | None = None, max_waiting: int = 256,
                 observer: RequestObserver | None = None, max_buffered_outputs: int = 1024,
                 startup_timeout_s: float = 900.0, log_level: str = "warning"):
        if (engine is None) == (factory is None):
            raise ValueError("AsyncEngine needs an engine (run on a thread) or a factory (a process)")
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        if not isinstance(max_buffered_outputs, int) or max_buffered_outputs < 1:
            raise ValueError(f"max_buffered_outputs must be an integer >= 1, got {max_buffered_outputs!r}")
        self._engine, self._factory = engine, factory
        self.max_waiting = max_waiting
        self.max_buffered_outputs = max_buffered_outputs
        self.startup_timeout_s = startup_timeout_s
        self.log_level = log_level
        self.observer = observer
        self.on_death: Callable[[str], None] | None = None
        self.info: M.EngineInfo | None = None
        self.tokenizer = None
        self.last_step_error: str | None = None
        self.integrity_error: str | None = None
        self.death: str | None = None       # why the core ended unasked (None while it runs)
        self._worker: threading.Thread | multiprocessing.Process | None = None
        self._dir: str | None = None        # the core's ipc sockets live here
        self._addresses: CoreAddresses | None = None
        self._cmd: zmq.Socket | None = None
        self._out: zmq.Socket | None = None
        self._reading = False
        self._closed: asyncio.Event | None = None   # set once the core's last message was read
        self._encode = M.encoder().encode
        self._decode = M.outputs_decoder().decode
        self._channels: dict[str, _Channel] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._pending_adds = 0          # Adds sent, not yet answered
        self._engine_waiting = 0        # num_waiting of the latest stats
        self._finishes: collections.deque[float] = collections.deque(maxlen=DRAIN_WINDOW)
        self._last_message_at = time.monotonic()  # the core's latest CoreOutputs
        self._step_started_at = 0.0     # ~ when the step behind the message being handled began
        self._busy_since = 0.0          # when the first of the requests in flight was sent
        self._health_call: asyncio.Future | None = None
        self._accepting = False
        self._shutdown_sent = False
        self._latest_stats = None

    @classmethod
    def spawn(cls, factory: Callable[[], Any], **kwargs) -> "AsyncEngine":
        """An AsyncEngine whose engine, factory(), is built and run in a process of its own.
        `factory` must pickle (a module-level function, a classmethod, a functools.partial)."""
        return cls(factory=factory, **kwargs)

    # ------------------------------------------------------------------ lifecycle
    def launch(self) -> None:
        """Start the core and wait until its engine is built (blocking; start() calls it).
        Raises EngineStartError with the engine's own message if it cannot be built."""
        if self._worker is not None:
            return
        self._dir = tempfile.mkdtemp(prefix="verispec-core-")
        addresses = CoreAddresses(f"ipc://{self._dir}/commands", f"ipc://{self._dir}/outputs")
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=False)
        if self._factory is not None:
            self._worker = ctx.Process(target=run_core_process, name="verispec-engine-core", daemon=True,
                                       args=(self._factory, addresses, theirs, os.getpid(), self.log_level))
        else:
            core = EngineCore(self._engine)
            self._worker = threading.Thread(
                target=core.serve, name="verispec-engine-core", daemon=True,
                args=(addresses, None, lambda: theirs.send(("ready", core.info(), None))))
        self._worker.start()
        try:
            self._await_ready(ours)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._addresses = addresses

    def _await_ready(self, conn) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not conn.poll(0.1):
            if not self._worker.is_alive():
                raise EngineStartError(f"the engine process exited during startup "
                                       f"({_exit_text(self._worker)})", bad_input=False)
            if time.monotonic() > deadline:
                self.kill()
                raise EngineStartError(f"the engine was not ready within {self.startup_timeout_s:.0f} s",
                                       bad_input=False)
        message = conn.recv()
        if message[0] == "error":
            self._worker.join(10)
            raise EngineStartError(message[2], bad_input=message[1])
        _, self.info, tokenizer = message
        self.tokenizer = tokenizer if tokenizer is not None else self._engine.tokenizer

    def start(self) -> None:
        """Connect to the core (launching it first if needed); call with the event loop running."""
        if self._reading or self._closed is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self.launch()
        ctx = zmq.Context.instance()
        self._cmd = ctx.socket(zmq.PUSH)
        self._cmd.setsockopt(zmq.LINGER, 0)
        self._cmd.connect(self._addresses.commands)
        self._out = ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.connect(self._addresses.outputs)
        loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        self._reading = True
        loop.add_reader(self._out.getsockopt(zmq.FD), self._read_outputs)
        loop.call_soon(self._read_outputs)  # anything that arrived before the reader was added
        if isinstance(self._worker, multiprocessing.process.BaseProcess):
            loop.add_reader(self._worker.sentinel, self._on_worker_exit)
        self._accepting = True

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting; give in-flight requests up to timeout_s to finish, then abort the
        rest (their streams raise EngineClosed, so clients get a clean error, not a cut)."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_in_flight and loop.time() < deadline and self.is_alive:
            await asyncio.sleep(0.01)
        if self.num_in_flight and self.is_alive:
            log.warning("aborting %d request(s) still in flight at shutdown", self.num_in_flight)
        self._send_shutdown("the server is shutting down")

    async def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 60.0) -> None:
        """drain(), then stop the core and wait for it (a process that does not stop is killed)."""
        if self._closed is None:
            return
        await self.drain(drain_timeout_s)
        if self._reading:  # the core's last message (closed=True) ends the reading
            try:
                await asyncio.wait_for(self._closed.wait(), 5.0 if self.death else join_timeout_s)
            except asyncio.TimeoutError:
                pass
        await asyncio.to_thread(self._worker.join, 5.0 if self.death else join_timeout_s)
        if self._worker.is_alive():
            log.error("engine core still running after shutdown (a step is stuck?)")
            self.kill()
        self._close(EngineClosed("the server is shutting down"))

    def _close(self, error: BaseException) -> None:
        """Release sockets and files; end whatever is still open with `error`."""
        if isinstance(self._worker, multiprocessing.process.BaseProcess):
            try:
                asyncio.get_running_loop().remove_reader(self._worker.sentinel)
            except (RuntimeError, ValueError, OSError):
                pass
        self._stop_reading()
        self._fail_everything(error)
        for sock in (self._cmd, self._out):
            if sock is not None:
                sock.close(0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """Kill the core process if it still runs (a last resort at exit)."""
        if isinstance(self._worker, multiprocessing.process.BaseProcess) and self._worker.is_alive():
            self._worker.kill()
            self._worker.join(5)

    @property
    def is_alive(self) -> bool:
        return self._worker is not None and self._worker.is_alive() and self.death is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def num_in_flight(self) -> int:
        """Requests sent to the engine and not yet finished, failed or confirmed aborted."""
        return len(self._channels)

    @property
    def latest_stats(self):
        """The engine's stats after its latest loop turn (or None)."""
        return self._latest_stats

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def spec_method(self) -> str:
        return self.info.spec_method

    @property
    def engine_pid(self) -> int | None:
        return self.info.pid if self.info is not None else None

    # ------------------------------------------------------------------ asyncio API
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          spec=None) -> RequestStream:
        """Hand a request to the engine; returns its stream once the engine accepted it.

        Raises QueueFull (too many waiting), EngineClosed (shutting down or dead), ValueError
        (the engine rejected the input) or RequestFailed (the engine raised something else).
        """
        self.admit()
        if request_id in self._channels:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not self._channels:
            self._busy_since = time.monotonic()
        prompt = list(prompt_token_ids)
        record = RequestRecord(request_id, len(prompt), self._method_label(spec), time.monotonic())
        channel = _Channel(record, prompt)
        self._send(M.Add(request_id, prompt, params, _spec_fields(spec)))
        self._channels[request_id] = channel
        self._pending_adds += 1
        stream = RequestStream(self, channel)
        try:
            first = await channel.queue.get()
        except BaseException:
            stream.abort()
            raise
        if first is not _ACCEPTED:
            stream._done = True
            raise first
        return stream

    def admit(self, preparing: int = 0, count: int = 1) -> None:
        """Raise EngineClosed or QueueFull unless `count` more requests may queue (n sibling
        requests of one n > 1 request). Cheap: the server calls it before reading or
        tokenizing a body, counting the `preparing` ones."""
        if not self.accepting:
            raise EngineClosed(self.death or "the engine is not accepting requests (shutting down)")
        waiting = self._engine_waiting + self._pending_adds + preparing
        if waiting + count > self.max_waiting:
            raise QueueFull(waiting, self.max_waiting, self.retry_after_s(waiting))

    def retry_after_s(self, waiting: int) -> int:
        """Seconds a refused client should wait: `waiting` requests at the measured drain
        rate (finishes per second), clamped, with up to RETRY_JITTER added at random."""
        times = self._finishes
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        base = waiting * span / (len(times) - 1) if span > 0 else RETRY_AFTER_MIN_S
        base = min(max(base, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
        return math.ceil(base * (1 + RETRY_JITTER * random.random()))

    def stalled_for(self) -> float | None:
        """Seconds since the engine last reported progress while requests wait on it (None
        when nothing is in flight): a wedged step shows here, not as a slow /health."""
        if not self._channels:
            return None
        return time.monotonic() - max(self._last_message_at, self._busy_since)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       spec=None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; closing or cancelling the generator aborts it."""
        stream = await self.add_request(request_id, prompt_token_ids, params, spec)
        async with stream:
            async for output in stream:
                yield output

    async def call(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> Any:
        """fn(engine) run by the core between two steps; fn and its result must pickle."""
        if not self.is_alive or self._shutdown_sent:
            raise EngineClosed(self.death or "the engine core is not running")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(M.Call(call_id, pickle.dumps(fn)))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    async def health(self, timeout_s: float) -> tuple[Any, str]:
        """(stats, integrity verdict) from the core; the KV check runs only when it is idle.
        At most one probe is outstanding: callers share it, so a busy or wedged core does
        not collect a probe per /health request. asyncio.TimeoutError after timeout_s."""
        if self._health_call is None or self._health_call.done():
            self._health_call = asyncio.ensure_future(self.call(health_probe))
            self._health_call.add_done_callback(_consume_exception)
        return await asyncio.wait_for(asyncio.shield(self._health_call), timeout_s)

    def _submit_abort(self, channel: _Channel) -> None:
        rid = channel.record.request_id
        if self._channels.get(rid) is not channel or channel.aborting:
            return
        channel.aborting = True
        try:
            self._send(M.Abort(rid))
        except EngineClosed:
            pass  # nothing runs it any more; the channel ends with the core

    def _send(self, command: M.Command) -> None:
        try:
            self._cmd.send(self._encode(command), zmq.NOBLOCK)
        except (zmq.ZMQError, AttributeError) as exc:
            raise EngineClosed(f"the engine core is not taking commands ({exc})") from None

    def _send_shutdown(self, reason: str) -> None:
        if not self._shutdown_sent and self.is_alive:
            self._shutdown_sent = True
            try:
                self._send(M.Shutdown(reason))
            except EngineClosed:
                pass

    def _method_label(self, spec) -> str:
        method = getattr(spec, "method", None) or self.spec_method
        return "none" if getattr(spec, "num_tokens", None) == 0 else method

    # ------------------------------------------------------------------ core -> front end
    def _read_outputs(self) -> None:
        """Drain the output socket (an add_reader callback: zmq's descriptor signals edges, so
        read until nothing is left). A plain socket on the loop's selector costs a tenth of
        zmq.asyncio's futures per message, and this runs once per engine step."""
        while self._out.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            message = self._decode(self._out.recv(zmq.NOBLOCK))
            try:
                self._handle(message)
            except Exception:
                log.exception("handling the engine core's outputs failed")
            if message.closed:
                self._stop_reading()
                if message.fatal:
                    self._on_core_lost(message.fatal)
                return

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._closed.set()
            try:
                asyncio.get_running_loop().remove_reader(self._out.getsockopt(zmq.FD))
            except (RuntimeError, ValueError, OSError):
                pass

    def _handle(self, message: M.CoreOutputs) -> None:
        # The core starts a step right after sending its previous message: that message's
        # arrival stands for this step's start (the request's "first scheduled" time).
        self._step_started_at, self._last_message_at = self._last_message_at, time.monotonic()
        if message.stats is not None:
            self._latest_stats = message.stats
            self._engine_waiting = message.stats.num_waiting
        if message.step_error is not None:
            self.last_step_error = message.step_error
            self._notify("on_step_error", RuntimeError(message.step_error), max(1, message.step_errors))
        if message.integrity_checked:
            self.integrity_error = message.integrity_error
        for ev in message.events:
            self._dispatch(ev)
        for result in message.calls:
            future = self._calls.get(result.call_id)
            if future is not None and not future.done():
                value = pickle.loads(result.value)
                future.set_result(value) if result.ok else future.set_exception(value)

    def _dispatch(self, ev: M.RequestEvent) -> None:
        channel = self._channels.get(ev.request_id)
        if channel is None:
            return
        kind = ev.kind
        if kind in (M.ACCEPTED, M.REJECTED):
            self._pending_adds -= 1
            if kind == M.ACCEPTED:
                self._notify("on_request_started", channel.record)
                channel.queue.put_nowait(_ACCEPTED)
            else:
                del self._channels[ev.request_id]
                channel.queue.put_nowait(ValueError(ev.error) if ev.bad_input else RequestFailed(ev.error))
            return
        if kind == M.OUTPUT:
            self._on_output(channel, ev)
            return
        del self._channels[ev.request_id]  # ABORTED or FAILED: the request has ended
        if ev.spec is not None:
            channel.record.last_output = channel.output(ev)
        if kind == M.FAILED:
            channel.queue.put_nowait(RequestFailed("internal engine error (see the server log)"))
            self._ended(channel.record, "error")
            return
        if ev.error is not None:
            channel.queue.put_nowait(EngineClosed(ev.error))
        self._ended(channel.record, "abort")

    def _on_output(self, channel: _Channel, ev: M.RequestEvent) -> None:
        record = channel.record
        output = channel.output(ev)
        record.last_output = output
        if output.new_token_ids:
            now = self._last_message_at
            record.prev_token_time, record.last_token_time = record.last_token_time, now
            if record.first_token_time is None:
                record.first_token_time = now
                # the engine's own time of first scheduling; else the start of this step
                scheduled = ev.scheduled_at or max(record.arrival_time, self._step_started_at)
                record.scheduled_time = min(now, max(record.arrival_time, scheduled))
                self._notify("on_first_token", record)
        self._notify("on_request_output", record, output)
        if output.error is not None:
            del self._channels[ev.request_id]
            channel.queue.put_nowait(RequestFailed(output.error))
            self._ended(record, "error")
            return
        if output.finished:
            del self._channels[ev.request_id]
            channel.queue.put_nowait(output)
            reason = output.finish_reason if output.finish_reason in ("stop", "length") else "abort"
            self._ended(record, reason)
            return
        if channel.aborting:
            return  # its consumer has left
        if channel.queue.qsize() >= self.max_buffered_outputs:
            log.warning("request %s: %d outputs unread; aborting it", ev.request_id, channel.queue.qsize())
            channel.queue.put_nowait(RequestFailed(
                f"the client did not read its stream ({self.max_buffered_outputs} outputs waiting); "
                "the request was aborted"))
            self._submit_abort(channel)
            return
        channel.queue.put_nowait(output)

    def _on_worker_exit(self) -> None:
        """The core process ended (its sentinel became readable)."""
        asyncio.get_running_loop().remove_reader(self._worker.sentinel)
        self._worker.join(1.0)  # the sentinel closes as it exits, a moment before it can be reaped
        if not self._shutdown_sent:
            self._on_core_lost(f"the engine process exited unexpectedly ({_exit_text(self._worker)})")

    def _on_core_lost(self, why: str) -> None:
        if self.death is not None:
            return
        log.error("%s; failing %d request(s) in flight", why, len(self._channels))
        self.death = self.last_step_error = why
        self._accepting = False
        self._stop_reading()
        self._fail_everything(EngineDied(why))
        if self.on_death is not None:
            self.on_death(why)

    def _fail_everything(self, error: BaseException) -> None:
        for channel in self._channels.values():
            channel.queue.put_nowait(error)
            self._ended(channel.record, "error")
        self._channels.clear()
        self._pending_adds = 0
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)

    def _ended(self, record: RequestRecord, outcome: str) -> None:
        """A request left the engine: one more finish for the drain rate, and the observer."""
        self._finishes.append(time.monotonic())
        self._notify("on_request_finished", record, outcome)

    def _notify(self, hook: str, *args) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            log.exception("request observer %s raised", hook)


def _consume_exception(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed probe is reported by its waiters, not logged


def _spec_fields(spec) -> M.SpecFields | None:
    if spec is None:
        return None
    return M.SpecFields(getattr(spec, "method", None), getattr(spec, "num_tokens", None),
                        getattr(spec, "adaptive", None))


def _spec_stats(s: M.SpecSnapshot) -> SpecStats:
    return SpecStats(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                     list(s.accepted_per_position), list(s.drafted_per_position), s.target_forwards,
                     {name: list(counts) for name, counts in s.by_proposer.items()})


def _exit_text(worker) -> str:
    code = getattr(worker, "exitcode", None)
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
