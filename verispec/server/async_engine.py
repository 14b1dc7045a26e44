"""The synchronous engine on one background thread, driven from asyncio.

LLMEngine is not thread-safe, so exactly one thread (the engine thread) ever calls it. The
asyncio side never touches the engine: it queues commands that the engine thread applies
between two steps, and it reads each request's outputs from an asyncio.Queue that the
engine thread feeds through loop.call_soon_threadsafe.

    asyncio side (HTTP handlers)               engine thread
    add_request() ---- command -------------->  engine.add_request -> accepted | ValueError
    RequestStream.__anext__ <---- queue ------  engine.step() outputs (or an error)
    RequestStream.abort() ---- command ------>  engine.abort_request (frees its KV at once)
    call(fn) ---- command ------------------->  fn() between steps (stats, integrity check)

A request's life: add_request() waits until the engine thread has called
engine.add_request (so bad input surfaces as ValueError before any response is sent), then
returns a RequestStream. Iterating it yields RequestOutputs until one is `finished`. Leaving
it early (break + aclose, `async with`, cancellation, a client disconnect) aborts the
request. A request the engine fails raises RequestFailed from the stream; others go on.
If engine.step() itself raises, every in-flight request is failed and aborted (the engine
does not say which rows were affected), the error is logged and counted, and the loop keeps
serving new requests.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from verispec.outputs import RequestOutput
from verispec.sampling import SamplingParams

log = logging.getLogger("verispec.server")


class QueueFull(RuntimeError):
    """Too many requests are already waiting for the engine; retry later (HTTP 429)."""

    def __init__(self, num_waiting: int, max_waiting: int, retry_after_s: int = 1):
        super().__init__(f"{num_waiting} requests are waiting (max_waiting={max_waiting}); "
                         f"retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class EngineClosed(RuntimeError):
    """The engine is shutting down or has stopped: it takes no new work (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The engine failed this one request (RequestOutput.error or a failed step)."""


@dataclass(eq=False)
class RequestRecord:
    """What the engine thread knows about one request; handed to the observer."""

    request_id: str
    prompt_len: int
    method: str                       # speculation method label for metrics
    arrival_time: float               # time.monotonic() when add_request was called
    first_token_time: float | None = None
    last_output: RequestOutput | None = None


class RequestObserver(Protocol):
    """Hooks called on the engine thread (metrics); exceptions in them are logged, not raised."""

    def on_request_started(self, record: RequestRecord) -> None: ...
    def on_first_token(self, record: RequestRecord) -> None: ...
    def on_request_output(self, record: RequestRecord, output: RequestOutput) -> None: ...
    def on_request_finished(self, record: RequestRecord, outcome: str) -> None: ...
    def on_step_error(self, exc: BaseException) -> None: ...


_ACCEPTED = object()  # first item of a queue: the engine took the request


class _Channel:
    """Delivery from the engine thread to one request's asyncio queue."""

    __slots__ = ("record", "loop", "queue")

    def __init__(self, record: RequestRecord, loop: asyncio.AbstractEventLoop):
        self.record = record
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Thread-safe; a no-op when the event loop is already closed (nobody listens)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass


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
            self._engine._submit_abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()


class AsyncEngine:
    """Runs `engine` on one background thread; see the module docstring for the protocol."""

    def __init__(self, engine, *, max_waiting: int = 256, observer: RequestObserver | None = None):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer
        self.last_step_error: str | None = None
        self.integrity_error: str | None = None
        self._cond = threading.Condition()
        self._commands: list[tuple[Callable, tuple]] = []  # guarded by _cond
        self._pending_adds = 0                              # adds queued, not yet in a snapshot
        self._unapplied_adds = 0                            # adds queued, not yet applied
        self._engine_waiting = 0                            # num_waiting of the latest snapshot
        self._accepting = False
        self._stopping = False
        self._channels: dict[str, _Channel] = {}            # engine thread only
        self._latest_stats = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._latest_stats = self._safe_stats()  # no thread yet: calling the engine is safe
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self._thread.start()

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting; give in-flight requests up to timeout_s to finish, then abort the
        rest (their streams raise EngineClosed, so clients get a clean error, not a cut)."""
        with self._cond:
            self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_in_flight and loop.time() < deadline and self.is_alive:
            await asyncio.sleep(0.01)
        if self.num_in_flight and self.is_alive:
            log.warning("aborting %d request(s) still in flight at shutdown", self.num_in_flight)
            with self._cond:
                self._commands.append((self._abort_all, (EngineClosed("the server is shutting down"),)))
                self._cond.notify()

    async def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 60.0) -> None:
        """drain(), then stop the engine thread and join it."""
        await self.drain(drain_timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, join_timeout_s)
            if self._thread.is_alive():
                log.error("engine thread still running %.0f s after shutdown (a step is stuck?)",
                          join_timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def num_in_flight(self) -> int:
        """Requests queued for the engine or running in it (not yet finished or aborted)."""
        return len(self._channels) + self._unapplied_adds

    @property
    def latest_stats(self):
        """The engine's EngineStats as of the end of the last loop iteration (or None)."""
        return self._latest_stats

    # ------------------------------------------------------------------ asyncio API
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          spec=None) -> RequestStream:
        """Hand a request to the engine; returns its stream once the engine accepted it.

        Raises QueueFull (too many waiting), EngineClosed (shutting down), ValueError (the
        engine rejected the input) or RequestFailed (the engine raised something else).
        """
        record = RequestRecord(request_id, len(prompt_token_ids), self._method_label(spec),
                               time.monotonic())
        channel = _Channel(record, asyncio.get_running_loop())
        with self._cond:
            if not self.accepting:
                raise EngineClosed("the engine is not accepting requests (shutting down)")
            waiting = self._engine_waiting + self._pending_adds
            if waiting >= self.max_waiting:
                raise QueueFull(waiting, self.max_waiting)
            self._pending_adds += 1
            self._unapplied_adds += 1
            self._commands.append((self._apply_add, (channel, list(prompt_token_ids), params, spec)))
            self._cond.notify()
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

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       spec=None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; closing or cancelling the generator aborts it."""
        stream = await self.add_request(request_id, prompt_token_ids, params, spec)
        async with stream:
            async for output in stream:
                yield output

    async def call(self, fn: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """Run fn() on the engine thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(ok: bool, value: Any) -> None:  # engine thread
            def settle():
                if not future.done():
                    future.set_result(value) if ok else future.set_exception(value)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                pass

        with self._cond:
            if not self.is_alive or self._stopping:
                raise EngineClosed("the engine thread is not running")
            self._commands.append((self._apply_call, (fn, deliver)))
            self._cond.notify()
        return await asyncio.wait_for(future, timeout_s)

    def _submit_abort(self, request_id: str) -> None:
        with self._cond:
            self._commands.append((self._apply_abort, (request_id, None)))
            self._cond.notify()

    def _method_label(self, spec) -> str:
        method = getattr(spec, "method", None) or self.engine.spec_method
        return "none" if getattr(spec, "num_tokens", None) == 0 else method

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # a bug in this loop itself: fail everything loudly
            log.exception("engine loop crashed; the server can no longer generate")
            self.last_step_error = f"engine loop crashed: {type(exc).__name__}: {exc}"
            self._fail_everything(EngineClosed("the engine loop crashed (see the server log)"))

    def _iterate(self) -> bool:
        """Apply queued commands, run one step if there is work; False once stopping."""
        has_work = self.engine.has_unfinished_requests()
        with self._cond:
            while not self._commands and not has_work and not self._stopping:
                self._cond.wait()
            commands, self._commands = self._commands, []
            stopping = self._stopping
        num_adds = 0
        for fn, args in commands:
            num_adds += fn == self._apply_add
            fn(*args)
        if stopping:
            self._abort_all(EngineClosed("the server is shutting down"))
            return False
        if self.engine.has_unfinished_requests():
            self._step()
            if not self.engine.has_unfinished_requests():
                self._check_integrity()  # idle again: the cheapest moment to audit the KV pool
        stats = self._safe_stats()
        with self._cond:
            self._latest_stats = stats
            self._engine_waiting = getattr(stats, "num_waiting", 0) if stats is not None else 0
            self._pending_adds -= num_adds
        return True

    def _apply_add(self, channel: _Channel, prompt: list[int], params: SamplingParams, spec) -> None:
        rid = channel.record.request_id
        try:
            self.engine.add_request(rid, prompt, params, spec)
        except ValueError as exc:
            outcome = exc
        except Exception as exc:
            log.exception("engine.add_request(%s) raised", rid)
            outcome = RequestFailed(f"the engine could not take the request: {type(exc).__name__}")
        else:
            outcome = _ACCEPTED
            self._channels[rid] = channel
        with self._cond:  # before the caller can see the outcome, so num_in_flight is exact
            self._unapplied_adds -= 1
        if outcome is _ACCEPTED:
            self._notify("on_request_started", channel.record)
        channel.put(outcome)

    def _apply_abort(self, request_id: str, error: BaseException | None) -> None:
        channel = self._channels.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("engine.abort_request(%s) raised", request_id)
        if channel is None:
            return  # unknown or already finished: nothing to report
        if error is not None:
            channel.put(error)
        self._notify("on_request_finished", channel.record, "abort")

    def _apply_call(self, fn: Callable[[], Any], deliver: Callable[[bool, Any], None]) -> None:
        try:
            result = fn()
        except Exception as exc:
            deliver(False, exc)
        else:
            deliver(True, result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._on_step_failure(exc)
            return
        for output in outputs:
            self._dispatch(output)

    def _dispatch(self, output: RequestOutput) -> None:
        channel = self._channels.get(output.request_id)
        if channel is None:
            return  # aborted by its client while this step ran
        record = channel.record
        record.last_output = output
        if output.new_token_ids and record.first_token_time is None:
            record.first_token_time = time.monotonic()
            self._notify("on_first_token", record)
        self._notify("on_request_output", record, output)
        if output.error is not None:
            del self._channels[output.request_id]
            channel.put(RequestFailed(output.error))
            self._notify("on_request_finished", record, "error")
            return
        channel.put(output)
        if output.finished:
            del self._channels[output.request_id]
            reason = output.finish_reason if output.finish_reason in ("stop", "length") else "abort"
            self._notify("on_request_finished", record, reason)

    def _on_step_failure(self, exc: Exception) -> None:
        """step() raised: fail and abort every in-flight request, keep the loop alive."""
        log.exception("engine.step() raised; failing %d in-flight request(s)", len(self._channels))
        self.last_step_error = f"{type(exc).__name__}: {exc}"
        self._notify("on_step_error", exc)
        error = RequestFailed("internal engine error (see the server log)")
        for rid, channel in list(self._channels.items()):
            del self._channels[rid]
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("engine.abort_request(%s) raised after a failed step", rid)
            channel.put(error)
            self._notify("on_request_finished", channel.record, "error")
        self._check_integrity()

    def _abort_all(self, error: BaseException) -> None:
        for rid in list(self._channels):
            self._apply_abort(rid, error)

    def _fail_everything(self, error: BaseException) -> None:
        with self._cond:
            self._accepting = False
            commands, self._commands = self._commands, []
        for fn, args in commands:
            if fn == self._apply_add:
                args[0].put(error)
            elif fn == self._apply_call:
                args[1](False, error)
        for channel in self._channels.values():
            channel.put(error)
        self._channels.clear()

    def _check_integrity(self) -> None:
        try:
            self.engine.check_integrity()
        except AssertionError as exc:
            self.integrity_error = str(exc) or "check_integrity failed"
            log.error("KV integrity check failed: %s", self.integrity_error)
        except Exception:
            log.exception("engine.check_integrity() raised")
        else:
            self.integrity_error = None

    def _safe_stats(self):
        try:
            return self.engine.stats()
        except Exception:
            log.exception("engine.stats() raised")
            return None

    def _notify(self, hook: str, *args) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            log.exception("request observer %s raised", hook)
