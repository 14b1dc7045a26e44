"""A worker rank (r >= 1) of a tensor-parallel target: `python -m verispec.distributed.worker
COMMANDS_FD REPLIES_FD`, started by rank 0 (ranks.RankGroup); under torchrun, the same loop
over a broadcast channel instead of the pipes (torchrun.run_worker).

It runs the target's forward only: for each message of rows, the same `ModelRunner.forward`
as rank 0 on its own slices and KV store, whose collectives meet rank 0's. It samples
nothing and keeps no request state. It exits on None (shutdown), at the end of its
command pipe (rank 0 is gone), or after reporting a failure on its reply pipe.
"""
from __future__ import annotations

import logging
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

log = logging.getLogger("verispec")


def main(argv: list[str]) -> int:
    commands = Connection(int(argv[1]), writable=False)
    replies = Connection(int(argv[2]), readable=False)
    start = commands.recv()
    from verispec.distributed.ranks import pin_process
    pin_process(start.cpus)  # before torch starts its OpenMP threads: they inherit it
    try:
        runner = build_runner(start.config, start.rank, start.world, start.threads, start.device)
    except Exception:
        replies.send(("failed", traceback.format_exc()))
        return 1
    replies.send(("loaded",))
    from verispec.distributed.ranks import init_group
    init_group(start.rank, start.world, _store(start), runner.device)
    return serve_forwards(lambda: pickle.loads(commands.recv_bytes()), runner,
                          lambda trace: _report(replies, trace))


def build_runner(config, rank: int, world: int, threads: int, device: str):
    """Rank `rank`'s runner: its slices loaded and placed as `LLMEngine` places the target
    (loader.place_models), with a KV store the size of rank 0's."""
    import torch

    from verispec.distributed.loading import load_rank_model
    from verispec.engine.runner import ModelRunner
    from verispec.model.loader import place_models

    torch.set_num_threads(threads)
    model, _, _, _ = load_rank_model(config, rank, world, torch.device(device))
    place_models([model], config.kernels, config.huge_pages)
    cache = config.cache
    return ModelRunner(model, cache.num_blocks * cache.block_size, cache.block_size)


def _store(start):
    import datetime

    import torch.distributed as dist

    from verispec.distributed.ranks import START_TIMEOUT_S
    return dist.TCPStore("127.0.0.1", start.store_port, start.world, False,
                         timeout=datetime.timedelta(seconds=START_TIMEOUT_S))


def serve_forwards(receive, runner, report) -> int:
    """Run the forward of every batch of rows `receive()` returns until it returns None (rank
    0 shut down: 0) or fails (rank 0 is gone: 1); a failing forward is `report`ed (its
    traceback), and ends the rank (1)."""
    import torch.distributed as dist

    while True:
        try:
            rows = receive()
        except (EOFError, OSError, RuntimeError) as exc:
            log.error("tensor-parallel worker: rank 0 is gone (%s); exiting", type(exc).__name__)
            return 1
        if rows is None:
            dist.destroy_process_group()
            return 0
        try:
            runner.forward(rows)
        except Exception:
            report(traceback.format_exc())
            return 1


def _report(replies: Connection, trace: str) -> None:
    try:
        replies.send(("failed", trace))
    except OSError:  # rank 0 is gone too
        pass


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv))
