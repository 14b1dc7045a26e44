"""Rank 0's side of a tensor-parallel group: start the worker ranks, feed them, notice loss.

    rank 0 (the engine's process)                   rank r >= 1 (worker.py, one process each)
      spawn workers, send each a WorkerStart  ---->   pin CPUs, load its slices, "loaded"
      load its own slices; wait for "loaded"  <----
      init_process_group (store on rank 0)    <--->   init_process_group
      per forward: the step's rows, pickled   ---->   the same forward on its slices
      once, written to every worker's pipe
      collectives inside the forward          <--->   collectives inside the forward
      close(): None to every pipe             ---->   leave the loop, exit

Workers are subprocesses (`python -m verispec.distributed.worker`), not multiprocessing
children: the server's engine core is itself a daemonic process, which may not have any.
Each worker gets two private pipes: its commands (it blocks on them while the engine is
idle, however long; end of file means rank 0 is gone, and it exits) and its replies
("loaded", or a failure's traceback before it exits).

Failure: a rank that dies closes its sockets, and the collective rank 0 is waiting in
fails at once; a rank alive but stuck is caught by the collectives' timeout. Either way
rank 0 names the rank that is gone, stops every rank, and raises `TensorParallelError`.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from verispec.config import EngineConfig, core_cpus, physical_cores

log = logging.getLogger("verispec")

COLLECTIVE_TIMEOUT_S = 60   # a collective that waits longer has a rank stuck: the group fails
START_TIMEOUT_S = 900       # a worker must have loaded its slices by then (a big model's conversion)
LOST_GRACE_S = 2.0          # after a failed collective, how long a dying rank gets to be seen dead
STOP_GRACE_S = 5.0          # close(): how long a worker gets to leave its loop before it is killed


class TensorParallelError(BaseException):
    """A rank of the tensor-parallel group is gone (or the group's collectives failed); every
    rank has been stopped. The engine cannot continue without it.

    A BaseException, like SystemExit: the engine's per-row fault isolation (and the engine
    core's per-step recovery) catch Exception and retry; retrying around a lost rank would
    fail every row one by one and leave an engine that looks alive. This propagates out of
    `LLMEngine.step`, and the server's engine core reports it as fatal."""


@dataclass(frozen=True)
class WorkerStart:
    """The first message to a worker: everything it needs to build its rank."""

    config: EngineConfig
    rank: int
    world: int
    store_port: int
    threads: int
    cpus: list[int] | None      # the CPUs to pin to; None: not pinned (too few cores)
    device: str                 # this rank's torch device


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    commands: Connection
    replies: Connection


def rank_devices(config: EngineConfig, world: int) -> list[torch.device]:
    """Each rank's device: cuda:base + r on a GPU (base: the configured index), else the CPU.
    A ValueError when there are fewer devices (GPUs, or CPU cores) than ranks."""
    from verispec.model.device import resolve_device

    first = resolve_device(config.device)
    if first.type == "cuda":
        available = torch.cuda.device_count() - first.index
        if available < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} CUDA devices from {first}; "
                             f"{available} are visible")
        return [torch.device("cuda", first.index + r) for r in range(world)]
    if physical_cores() < world:
        raise ValueError(f"tensor_parallel_size {world} needs at least {world} CPU cores (one per rank); "
                         f"this process may use {physical_cores()}")
    return [first] * world


def rank_cpus(world: int, threads: int) -> list[list[int]] | None:
    """CPUs for each rank: `threads` whole physical cores each (hyperthread siblings
    together), in CPU order, so ranks on a multi-socket server fill one node before the
    next; None when this process may use fewer than world * threads cores."""
    groups = core_cpus()
    if len(groups) < world * threads:
        return None
    return [[c for g in groups[r * threads: (r + 1) * threads] for c in g] for r in range(world)]


def pin_process(cpus: list[int] | None) -> set[int]:
    """Pin every thread of this process (OpenMP's already started included) to `cpus`;
    returns the CPUs it could use before (to undo it)."""
    before = os.sched_getaffinity(0)
    if cpus is not None:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:  # a thread that ended meanwhile
                pass
    return before


def init_group(rank: int, world: int, store: dist.Store | None, device: torch.device) -> None:
    """Join the group (the default process group): gloo on the CPU, NCCL on CUDA; through
    `store`, or torchrun's rendezvous (env://) when it is None."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    meet = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **meet)


class RankGroup:
    """Rank 0's handle on the worker ranks: start, feed, check, stop."""

    def __init__(self, config: EngineConfig, world: int, threads: int, devices: list[torch.device]):
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process "
                               "(torch.distributed has one default group): shut it down first")
        self.world, self.closed = world, False
        self.failure: str | None = None
        cpus = rank_cpus(world, threads)
        if cpus is None:
            log.warning("tensor parallel: %d ranks x %d threads exceed this process's %d cores; "
                        "ranks are not pinned", world, threads, physical_cores())
        self.store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        self.workers = [self._spawn(WorkerStart(config, r, world, self.store.port, threads,
                                                cpus[r] if cpus else None, str(devices[r])))
                        for r in range(1, world)]
        self._affinity = pin_process(cpus[0] if cpus else None)

    def _spawn(self, start: WorkerStart) -> _Worker:
        cmd_read, cmd_write = os.pipe()
        reply_read, reply_write = os.pipe()
        process = subprocess.Popen([sys.executable, "-m", "verispec.distributed.worker", str(cmd_read),
                                    str(reply_write)], pass_fds=(cmd_read, reply_write))
        os.close(cmd_read)
        os.close(reply_write)
        worker = _Worker(start.rank, process, Connection(cmd_write, readable=False),
                         Connection(reply_read, writable=False))
        worker.commands.send(start)
        return worker

    def join(self, device: torch.device) -> None:
        """Rank 0 joins the group once every worker has loaded its slices."""
        self.wait_loaded()
        init_group(0, self.world, self.store, device)

    def wait_loaded(self) -> None:
        """Block until every worker has loaded its slices; raise naming the first that failed."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in self.workers:
            while not w.replies.poll(0.1):
                if w.process.poll() is not None or time.monotonic() > deadline:
                    raise self.lost(f"while loading its weights ({self._gone(w) or 'too slow'})")
            reply = w.replies.recv()
            if reply[0] != "loaded":
                raise self.lost(f"while loading its weights:\n{reply[1]}", ValueError)

    def broadcast(self, rows) -> None:
        """The step's inputs to every worker (pickled once)."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        payload = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
        for w in self.workers:
            try:
                w.commands.send_bytes(payload)
            except OSError:
                raise self.lost("before a forward") from None

    def lost(self, when: str, kind: type = TensorParallelError) -> BaseException:
        """Stop every rank; the error (of `kind`) that names the rank gone and why."""
        deadline = time.monotonic() + LOST_GRACE_S
        gone: list[str] = []
        for w in self.workers:
            why = self._gone(w, max(0.0, deadline - time.monotonic()))
            if why:
                gone.append(f"rank {w.rank} (pid {w.process.pid}) {why}")
        who = "; ".join(gone) or "no worker rank exited (rank 0's own forward failed, or a collective timed out)"
        self.failure = (f"tensor-parallel group of {self.world} ranks failed {when}: {who}. "
                        "Every rank has been stopped; restart the engine.")
        log.error("%s", self.failure)
        self.close()
        return kind(self.failure)

    @staticmethod
    def _gone(w: _Worker, wait_s: float = 0.0) -> str | None:
        """Why the worker is gone ('exited with ...' and its last reply), or None if alive."""
        try:
            code = w.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            return None
        reason = f"exited with {_exit_text(code)}"
        try:
            if w.replies.poll():
                reason += f":\n{w.replies.recv()[1]}"
        except (EOFError, OSError):
            pass
        return reason

    def check(self) -> None:
        """Raise TensorParallelError if a worker rank has exited (a waitpid per worker)."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if any(w.process.poll() is not None for w in self.workers):
            raise self.lost("before a forward")

    def close(self) -> None:
        """Stop every worker (asked, then killed after STOP_GRACE_S) and leave the group."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            try:
                w.commands.send(None)
            except OSError:
                pass
        if dist.is_initialized():  # a worker still inside a collective sees its peer leave
            dist.destroy_process_group()
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self.workers:
            try:
                w.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()
            w.commands.close()
            w.replies.close()
        self.store = None
        pin_process(sorted(self._affinity))


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
