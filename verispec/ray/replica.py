"""ReplicaServer: one verispec engine replica, the body of the Ray Serve deployment.

It is the single server without uvicorn: the engine core in a process of its own
(`AsyncEngine.spawn`, exactly as `verispec serve` runs it) and the same Starlette app
(`create_app`), driven per request by `bridge.run_asgi`. Every route, check, limit and
metric of docs/serving.md therefore holds per replica; the front door only picks the
replica and relays bytes.

Health: a replica whose engine process dies ends its own process a moment later (its
requests have their error by then); Ray calls `check_health` every `health_check_period_s`,
which also fails once no engine step has completed for `--stall-timeout` seconds with work
waiting. Either way Ray stops routing to the replica and starts a new one (an engine
process outlives no replica: the core watches its parent). Requests in flight on a replica
whose process dies end with an error at the front door (`front_door.py`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os

from ray import serve

from verispec.engine.core import build_engine, drain_cache_events
from verispec.ray.bridge import HTTPCall, fetch, run_asgi
from verispec.ray.prefix_index import CacheReport
from verispec.server.app import ServerConfig, create_app
from verispec.server.async_engine import AsyncEngine, EngineStartError

log = logging.getLogger("verispec.ray")

ENGINE_DEATH_GRACE_S = 1.0   # for the in-flight requests' error events to leave a dying replica
DRAIN_TIMEOUT_S = 5.0        # a routing-stats poll waits this long for the engine core


class ReplicaServer:
    """One engine and its OpenAI app; methods are called by the front door's handle."""

    async def __init__(self, engine_config, server_config: ServerConfig):
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.config = server_config
        engine = AsyncEngine.spawn(functools.partial(build_engine, engine_config),
                                   max_waiting=server_config.max_waiting,
                                   max_buffered_outputs=server_config.max_buffered_outputs,
                                   log_level=server_config.log_level)
        try:
            await asyncio.to_thread(engine.launch)   # builds the engine: seconds to minutes
        except EngineStartError as exc:
            raise (ValueError if exc.bad_input else RuntimeError)(str(exc)) from None
        self.engine = engine
        self.block_size = engine_config.cache.block_size
        self.cache = CacheReport()   # the block keys the engine's prefix cache holds
        engine.on_death = self._exit_soon
        self.app = create_app(engine, server_config)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()            # connects to the core on this event loop
        log.info("replica %s (pid %d): engine core pid %d", self.replica, os.getpid(), engine.engine_pid)

    async def handle(self, call: HTTPCall):
        """Serve one HTTP request: a ResponseHead, then the body in chunks (a generator:
        the front door calls it with stream=True; cancelling it disconnects the client)."""
        async for item in run_asgi(self.app, call, self.replica):
            yield item

    async def fetch(self, path: str) -> tuple[str, int, bytes]:
        """(replica id, status, body) of GET `path` on this replica (/health, /metrics);
        the front door broadcasts it to every replica."""
        call = HTTPCall("GET", path, headers=((b"host", b"127.0.0.1"),))
        status, body = await fetch(self.app, call, self.replica)
        return self.replica, status, body

    def routing_info(self) -> tuple:
        """(tokenizer, KV block size): what the front door needs to compute the block keys
        of a request's prompt exactly as this replica's cache names them."""
        return self.engine.tokenizer, self.block_size

    async def record_routing_stats(self) -> dict:
        """Ray Serve's routing stats, polled by the controller for PrefixAffinityRouter:
        every block key this replica's prefix cache holds, kept up to date from the cache's
        own store and evict events. {} when the engine does not answer (the health check
        deals with that replica)."""
        try:
            delta = await self.engine.call(functools.partial(drain_cache_events, reset=self.cache.resync),
                                           timeout_s=DRAIN_TIMEOUT_S)
        except Exception as exc:   # noqa: BLE001 - a stats poll must not fail the replica
            log.debug("replica %s: no cache events (%s)", self.replica, exc)
            self.cache.lost()
            return {}
        self.cache.apply(delta)
        return self.cache.stats(self.replica)

    def _exit_soon(self, why: str) -> None:
        """The engine process died (its requests already ended with the cause): end this
        replica's process too, so Ray replaces it now rather than at its next health check,
        as `verispec serve` exits 1 for its supervisor."""
        log.error("replica %s: the engine process died (%s); exiting so that Ray replaces it",
                  self.replica, why)
        asyncio.get_running_loop().call_later(ENGINE_DEATH_GRACE_S, os._exit, 1)

    def describe(self) -> dict:
        """Ids, processes and engine config of this replica (tests, benchmarks)."""
        return {"replica": self.replica, "pid": os.getpid(), "engine_pid": self.engine.engine_pid,
                "config": self.engine.info.config}   # the engine config as run ("auto" resolved)

    def check_health(self) -> None:
        """Ray's health check: raising marks this replica unhealthy (then replaced)."""
        if not self.engine.is_alive:
            raise RuntimeError(f"the engine process is gone: {self.engine.death}")
        stalled = self.engine.stalled_for()
        if stalled is not None and stalled > self.config.stall_timeout_s:
            raise RuntimeError(f"no engine step completed for {stalled:.0f} s with work waiting")

    async def __del__(self):
        """Ray's graceful shutdown: drain the engine as `verispec serve` does on SIGTERM."""
        if hasattr(self, "_lifespan"):
            await self.engine.drain(self.config.shutdown_timeout_s)
            await self._lifespan.__aexit__(None, None, None)
