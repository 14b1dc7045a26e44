"""The engine core: the loop that owns an engine, in a process of its own.

    front end (server/async_engine.py)          engine core (this module)
      Add / Abort / Call / Shutdown   -- zmq -->  applied between two steps
      one asyncio reader              <-- zmq --  one CoreOutputs per loop turn: every event of
                                                  the step for the whole batch, and the stats

Why a process and not a thread beside the HTTP server: the fused decoder stack runs in one
OpenMP parallel region with barriers inside every layer. libgomp spins at a barrier only
while it manages no more threads than there are cores; a second OpenMP team (the one the
process's main thread got while loading the model, plus the engine thread's) tips it into
futex waits, and a 2-core machine then decoded at 70 tok/s instead of 170. Here the engine
runs on the core process's main thread, that process runs nothing else that computes,
and the HTTP side has its own interpreter lock, so neither can stall the other.

`run_core_process` is the process's entry point; `EngineCore.serve` also runs on a thread
(tests drive a fake engine that way, through the same messages). The core ignores SIGINT
and SIGTERM: the front end decides when it stops (Shutdown), so a Ctrl-C or a supervisor's
signal to the process group drains requests instead of cutting them; it exits by itself
when the front end's process is gone.
"""
from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from verispec.engine import messages as M
from verispec.request import SpecOverride

log = logging.getLogger("verispec.engine")

IDLE_POLL_MS = 500       # an idle core wakes this often to see whether its parent is alive
SEND_LINGER_MS = 2000    # how long the last messages may take to leave at exit


@dataclass(frozen=True)
class CoreAddresses:
    """zmq endpoints the core binds: commands in, outputs out."""

    commands: str
    outputs: str


class EngineCore:
    """Applies commands to one engine and reports what each loop turn did."""

    def __init__(self, engine):
        self.engine = engine
        self.live: dict[str, Any] = {}  # accepted, not ended -> its latest RequestOutput (or None)

    def info(self) -> M.EngineInfo:
        config = getattr(self.engine, "config", None)
        return M.EngineInfo(
            model_name=self.engine.model_name, max_model_len=self.engine.max_model_len,
            spec_method=self.engine.spec_method, pid=os.getpid(),
            threads=getattr(config, "threads", None),
            config=config.to_dict() if hasattr(config, "to_dict") else {},
            sampling_defaults=dict(getattr(getattr(getattr(self.engine, "tokenizer", None), "meta", None),
                                           "sampling_defaults", None) or {}))

    # ------------------------------------------------------------------ the loop
    def serve(self, addresses: CoreAddresses, parent_pid: int | None = None,
              on_bound: Callable[[], None] | None = None) -> None:
        """Bind, call on_bound(), then run until Shutdown (or the parent process is gone)."""
        ctx = zmq.Context()
        commands, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        outputs.setsockopt(zmq.LINGER, SEND_LINGER_MS)
        commands.bind(addresses.commands)
        outputs.bind(addresses.outputs)
        encode = M.encoder().encode
        try:
            if on_bound is not None:
                on_bound()
            self._loop(commands, outputs, parent_pid, encode)
        except BaseException as exc:  # a bug in the loop itself: say so, then end every request
            log.exception("engine core loop crashed")
            outputs.send(encode(M.CoreOutputs(events=self._end_all(M.FAILED, None), closed=True,
                                              fatal=f"engine core crashed: {type(exc).__name__}")))
            raise
        finally:
            commands.close(0)
            outputs.close()
            ctx.term()

    def _loop(self, commands: zmq.Socket, outputs: zmq.Socket, parent_pid: int | None, encode) -> None:
        decode = M.command_decoder().decode
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                log.error("the front end's process is gone; the engine core stops")
                return
            busy = self.engine.has_unfinished_requests()
            if not busy and not commands.poll(IDLE_POLL_MS):
                continue
            out = M.CoreOutputs(events=[], calls=[])
            running = True
            while running:
                try:
                    frame = commands.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                running = self.apply(decode(frame), out)
            if running and self.engine.has_unfinished_requests():
                self.step(out)
                if not self.engine.has_unfinished_requests():
                    self.check_integrity(out)  # idle again: the cheapest moment to audit the pool
            out.stats = self.stats()
            out.closed = not running
            outputs.send(encode(out))
            if not running:
                return

    # ------------------------------------------------------------------ commands
    def apply(self, cmd: M.Command, out: M.CoreOutputs) -> bool:
        """Apply one command, adding its events to `out`; False after Shutdown."""
        if isinstance(cmd, M.Add):
            out.events.append(self._add(cmd))
        elif isinstance(cmd, M.Abort):
            if cmd.request_id in self.live:
                out.events.append(self._abort(cmd.request_id, M.ABORTED, None))
        elif isinstance(cmd, M.Call):
            out.calls.append(self._call(cmd))
        else:  # Shutdown
            out.events.extend(self._end_all(M.ABORTED, cmd.reason))
            return False
        return True

    def _add(self, cmd: M.Add) -> M.RequestEvent:
        rid = cmd.request_id
        try:
            self.engine.add_request(rid, cmd.prompt, cmd.params, _spec_override(cmd.spec))
        except ValueError as exc:
            return M.RequestEvent(rid, M.REJECTED, error=str(exc), bad_input=True)
        except Exception as exc:
            log.exception("engine.add_request(%s) raised", rid)
            return M.RequestEvent(rid, M.REJECTED, error=f"the engine could not take the request: "
                                                         f"{type(exc).__name__}")
        self.live[rid] = None
        return M.RequestEvent(rid, M.ACCEPTED)

    def _abort(self, rid: str, kind: int, error: str | None) -> M.RequestEvent:
        latest = self.live.pop(rid)
        try:
            self.engine.abort_request(rid)
        except Exception:
            log.exception("engine.abort_request(%s) raised", rid)
        return M.RequestEvent(rid, kind, error=error, spec=_snapshot(latest))

    def _end_all(self, kind: int, error: str | None) -> list[M.RequestEvent]:
        return [self._abort(rid, kind, error) for rid in list(self.live)]

    def _call(self, cmd: M.Call) -> M.CallResult:
        try:
            value, ok = pickle.loads(cmd.fn)(self.engine), True
        except Exception as exc:
            value, ok = exc, False
        try:
            payload = pickle.dumps(value)
        except Exception as exc:  # an unpicklable result or exception
            payload, ok = pickle.dumps(RuntimeError(f"call result not picklable: {exc}")), False
        return M.CallResult(cmd.call_id, ok, payload)

    # ------------------------------------------------------------------ steps
    def step(self, out: M.CoreOutputs) -> None:
        """One engine step, and its failures in `out.step_error` / `out.step_errors`.

        The engine fails a request that raises alone (LLMEngine.step isolates it; it ends
        with an error event of its own) and counts it in `step_errors`: the count it rose
        by this step is reported with the engine's `last_step_error`. A step that still
        raises out of the engine is the last resort: every request in flight fails (one
        more error counted), and the loop goes on.
        """
        errors_before = getattr(self.engine, "step_errors", 0)
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine.step() raised; failing %d in-flight request(s)", len(self.live))
            out.step_error = f"{type(exc).__name__}: {exc}"
            out.step_errors = 1 + max(0, getattr(self.engine, "step_errors", 0) - errors_before)
            out.events.extend(self._end_all(M.FAILED, None))
            self.check_integrity(out)
            return
        failed = getattr(self.engine, "step_errors", 0) - errors_before
        if failed > 0:
            out.step_error = getattr(self.engine, "last_step_error", None) or "a request failed in the engine"
            out.step_errors = failed
        for o in outputs:
            if o.request_id not in self.live:
                continue
            ends = o.finished or o.error is not None
            out.events.append(M.RequestEvent(
                o.request_id, M.OUTPUT, list(o.new_token_ids), o.new_text, o.finished, o.finish_reason,
                o.error, spec=_snapshot(o) if ends else None,
                num_cached_tokens=getattr(o, "num_cached_tokens", 0) or 0,
                scheduled_at=getattr(o, "scheduled_at", None) or 0.0,
                logprobs=getattr(o, "new_logprobs", None)))
            if ends:
                del self.live[o.request_id]
            else:
                self.live[o.request_id] = o

    def check_integrity(self, out: M.CoreOutputs) -> None:
        out.integrity_checked = True
        try:
            self.engine.check_integrity()
        except AssertionError as exc:
            out.integrity_error = str(exc) or "check_integrity failed"
            log.error("KV integrity check failed: %s", out.integrity_error)
        except Exception:
            log.exception("engine.check_integrity() raised")

    def stats(self) -> M.EngineStats | None:
        try:
            return self.engine.stats()
        except Exception:
            log.exception("engine.stats() raised")
            return None


def health_probe(engine) -> tuple[M.EngineStats | None, str]:
    """(stats, integrity verdict) for /health: the KV integrity check runs only when idle."""
    stats = engine.stats()
    if engine.has_unfinished_requests():
        return stats, "skipped: requests in flight"
    try:
        engine.check_integrity()
    except AssertionError as exc:
        return stats, f"failed: {exc}"
    return stats, "ok"


def build_engine(config):
    """LLMEngine.from_config(config): the factory `verispec serve` hands the core process
    (a module-level function, so it pickles without importing the engine here)."""
    from verispec.engine.engine import LLMEngine
    return LLMEngine.from_config(config)


def drain_cache_events(engine, reset: bool = False):
    """For AsyncEngine.call: the block keys (verispec/cache/events.py) the engine's prefix
    cache stored and evicted since the last call, as a CacheDelta; with `reset`, a snapshot
    of them all (module-level, so the call pickles by reference without importing its
    caller, e.g. Ray, into the core)."""
    return engine.kv.prefix_cache.drain_events(reset)


def run_core_process(factory: Callable[[], Any], addresses: CoreAddresses, ready, parent_pid: int,
                     log_level: str) -> None:
    """The engine-core process: build the engine with factory(), report on `ready` (a Pipe
    end: ("ready", EngineInfo, tokenizer) or ("error", bad_input, message)), then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = factory()
    except Exception as exc:
        bad_input = isinstance(exc, (ValueError, OSError))  # a configuration the user can fix
        ready.send(("error", bad_input, str(exc) if bad_input else f"{type(exc).__name__}: {exc}"))
        raise SystemExit(2) from None
    # Everything built so far (the model, torch, tokenizer) lives as long as the process: move
    # it out of the collector's sight, so a full collection, which pauses the step loop,
    # scans only what serving allocates (docs/architecture.md, "The server").
    gc.collect()
    gc.freeze()
    core = EngineCore(engine)
    core.serve(addresses, parent_pid, on_bound=lambda: ready.send(("ready", core.info(), engine.tokenizer)))


def _spec_override(fields: M.SpecFields | None):
    if fields is None:
        return None
    return SpecOverride(fields.method, fields.num_tokens, fields.adaptive)


def _snapshot(output) -> M.SpecSnapshot | None:
    s = getattr(output, "spec", None)
    if s is None:
        return None
    return M.SpecSnapshot(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                          list(s.accepted_per_position), list(s.drafted_per_position), s.target_forwards,
                          {name: list(counts) for name, counts in s.by_proposer.items()})
