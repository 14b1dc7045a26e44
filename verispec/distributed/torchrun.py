"""Ranks started by `torchrun` instead of by the engine.

    torchrun --nproc-per-node 2 -m verispec.cli generate --tensor-parallel-size 2 ...
    torchrun --nproc-per-node 2 -m verispec.cli serve --tensor-parallel-size 2 ...
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT script.py  # LLM(...)

With --tensor-parallel-size 1 (the default) a script's or `generate`'s processes under
torchrun are independent engines (this module is not involved; `serve` refuses, as its
ranks would share one port). With N > 1, torchrun must start exactly N processes, and
every rank runs the same program. Rank 0 runs it as usual: its engine is the one the
program talks to (the server's, the CLI's, the script's `LLM`). Every other rank becomes a
worker where the engine would be built (`verispec serve` before it binds a port; `generate`
and `LLM(...)` inside the engine's construction): it loads its slices, joins the group and
runs rank 0's forwards until rank 0's engine shuts down, then the program ends there with
the worker's exit status (0 after a clean shutdown).

The ranks meet through torchrun's rendezvous (`env://`: MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE); the step's rows go from rank 0 to the others as one broadcast over a gloo
group of their own (on GPUs too, where the default group is NCCL). torchrun watches the
processes: a rank that exits with an error makes it stop every other rank, and a forward
that was waiting on the lost rank fails on rank 0 with `TensorParallelError`. Each rank
takes its device from LOCAL_RANK (cuda:LOCAL_RANK, or the CPU) and, on the CPU, pins its
threads to its share of the node's cores (LOCAL_WORLD_SIZE shares).
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verispec.config import EngineConfig
from verispec.distributed.ranks import TensorParallelError, init_group, pin_process, rank_cpus
from verispec.distributed.worker import build_runner, serve_forwards

log = logging.getLogger("verispec")

IDLE_TIMEOUT = datetime.timedelta(days=365)   # workers wait for rank 0's next step however long it idles


@dataclass(frozen=True)
class TorchrunRank:
    """This process's place in a torchrun job."""

    rank: int
    world: int
    local_rank: int
    local_world: int


def torchrun_rank() -> TorchrunRank | None:
    """The torchrun job this process belongs to (torchrun sets TORCHELASTIC_RUN_ID and the
    rank variables), or None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return TorchrunRank(rank, world, int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", world)))


def check_world(config: EngineConfig, me: TorchrunRank) -> None:
    """A ValueError unless torchrun started exactly one process per tensor-parallel rank."""
    if config.tensor_parallel_size != me.world:
        raise ValueError(f"torchrun started {me.world} processes but tensor_parallel_size is "
                         f"{config.tensor_parallel_size}: they must be equal (one process per rank; "
                         f"pass --tensor-parallel-size {me.world})")


def rank_device(config: EngineConfig, me: TorchrunRank) -> torch.device:
    """cuda:LOCAL_RANK when the engine runs on CUDA, else the CPU."""
    from verispec.model.device import resolve_device
    if resolve_device(config.device).type == "cuda":
        if me.local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {me.local_rank} has no CUDA device ({torch.cuda.device_count()} visible)")
        return torch.device("cuda", me.local_rank)
    return torch.device("cpu")


def pin_local_rank(me: TorchrunRank, threads: int) -> None:
    """Pin this process to its share of the node's cores (not pinned when they are too few)."""
    cpus = rank_cpus(me.local_world, threads)
    pin_process(cpus[me.local_rank] if cpus else None)


class StepChannel:
    """Rank 0's step inputs to every other rank: one broadcast per forward over a gloo group
    with no practical timeout (an idle engine sends nothing). None means: stop."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, rows) -> None:
        dist.broadcast_object_list([rows], src=0, group=self.group)

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class TorchrunGroup:
    """Rank 0's handle on a torchrun job's other ranks (the interface of ranks.RankGroup):
    nothing to spawn or wait for; a lost rank shows as a failed collective."""

    def __init__(self, me: TorchrunRank):
        self.world, self.closed, self.failure = me.world, False, None
        self.channel: StepChannel | None = None

    def join(self, device: torch.device) -> None:
        """Rank 0 joins through torchrun's rendezvous (env://), which waits for every rank
        (each loads its slices first), then opens the step channel."""
        init_group(0, self.world, None, device)
        self.channel = StepChannel()

    def broadcast(self, rows) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            self.channel.send(rows)
        except RuntimeError as exc:
            raise self.lost(f"before a forward ({exc})") from None

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def lost(self, when: str) -> BaseException:
        self.failure = (f"tensor-parallel group of {self.world} torchrun ranks failed {when}; torchrun "
                        "stops the other ranks. Restart the job.")
        log.error("%s", self.failure)
        self.closed = True   # no stop message: the ranks are out of step
        return TensorParallelError(self.failure)

    def close(self) -> None:
        """Tell every rank to stop (their programs then end), and leave the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.channel is not None:
                self.channel.send(None)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def run_worker(config: EngineConfig, me: TorchrunRank) -> int:
    """Rank me.rank >= 1: load this rank's slices, join, run rank 0's forwards until it
    stops; the exit status (0 after rank 0's clean shutdown)."""
    check_world(config, me)
    threads = config.resolved_for("generate").threads
    pin_local_rank(me, threads)
    device = rank_device(config, me)
    runner = build_runner(config, me.rank, me.world, threads, str(device))
    init_group(me.rank, me.world, None, device)
    channel = StepChannel()
    return serve_forwards(channel.receive, runner, lambda trace: log.error("rank %d failed:\n%s", me.rank, trace))
