"""Rank 0's target runner: each forward's rows go to every worker, then the same forward
runs here on rank 0's slices and returns the gathered (whole-vocabulary) logits.

The engine drives it as it drives a `ModelRunner`; nothing else in the engine knows there
are ranks. Everything the engine does to the target's KV happens inside forwards (the
pool is written only at the slot mapping of a pass; rollback, prefix sharing and
preemption are bookkeeping over block tables that rank 0 ships with every row), so one
message per forward keeps every rank's KV store the same in structure.
"""
from __future__ import annotations

import time
import weakref
from typing import NamedTuple

import torch

from verispec.config import EngineConfig
from verispec.distributed.layers import Collectives
from verispec.distributed.ranks import RankGroup, TensorParallelError, rank_devices
from verispec.distributed.torchrun import (TorchrunGroup, TorchrunRank, check_world, pin_local_rank, rank_device,
                                           run_worker, torchrun_rank)
from verispec.engine.runner import ModelRunner, RowInput
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel
from verispec.model.tokenizer import Tokenizer


class ForwardStats(NamedTuple):
    """Rank 0's target forwards so far: how many, their seconds, and the part of those
    seconds spent in collectives (waiting for the slowest rank included)."""

    forwards: int
    seconds: float
    collective_seconds: float


class TensorParallelRunner(ModelRunner):
    """A `ModelRunner` over rank 0's slices that sends every forward's rows to the workers
    first. Any exception inside a forward is fatal to the group (`TensorParallelError`):
    the ranks' collectives can no longer be matched up."""

    # No EAGLE-style head: rank 0 holds only its vocabulary run of the embedding, and a
    # lookup is an all-reduce that the workers join only inside a forward.
    returns_hidden = False

    def __init__(self, model: LlamaModel, num_slots: int, block_size: int, vocab_limit: int | None,
                 group: RankGroup, comm: Collectives):
        super().__init__(model, num_slots, block_size, vocab_limit)
        self.group, self.comm = group, comm
        self.forwards, self.seconds = 0, 0.0
        weakref.finalize(self, group.close)  # an engine dropped without shutdown() stops its ranks

    def forward(self, rows: list[RowInput], **options):
        """`ModelRunner.forward` on every rank. `options` (ModelRunner.forward's, e.g. the
        hidden states) apply to rank 0 only: they change what it returns, not the collectives
        (the workers' forwards stay plain)."""
        start = time.perf_counter()
        self.group.check()
        self.group.broadcast(rows)
        try:
            out = super().forward(rows, **options)
        except Exception as exc:  # the ranks' collectives are out of step: the group cannot go on
            raise self.group.lost(f"during a forward ({type(exc).__name__}: {exc})") from exc
        self.forwards += 1
        self.seconds += time.perf_counter() - start
        return out

    def stats(self) -> ForwardStats:
        return ForwardStats(self.forwards, self.seconds, self.comm.seconds)

    def close(self) -> None:
        self.group.close()


class TensorParallelTarget(NamedTuple):
    """What `start` returns: rank 0's model (whole-model config, tokenizer) and how to
    make its runner."""

    model: LlamaModel
    config: ModelConfig     # the whole model's
    tokenizer: Tokenizer
    group: RankGroup
    comm: Collectives

    def runner(self, num_slots: int, block_size: int, vocab_limit: int | None) -> TensorParallelRunner:
        return TensorParallelRunner(self.model, num_slots, block_size, vocab_limit, self.group, self.comm)


def start(config: EngineConfig) -> TensorParallelTarget:
    """Start `config.tensor_parallel_size` ranks of the target: the workers (processes) and
    rank 0 here; under torchrun, join its ranks instead (a rank > 0 serves rank 0's forwards
    and then ends the program: torchrun.py). Bad configurations (heads not divisible, too
    few devices) are a ValueError before any process starts; a worker that fails to load
    stops every rank."""
    from verispec.distributed.loading import load_rank_model
    from verispec.distributed.sharding import check_divisible, check_int4_split
    from verispec.model.loader import load_config_and_tokenizer, resolve_model
    from verispec.model.quant import INT4_FORMATS

    world = config.tensor_parallel_size
    me = torchrun_rank()
    if me is not None:
        check_world(config, me)
    full, _ = load_config_and_tokenizer(resolve_model(config.model))
    check_divisible(full, world)
    if config.weight_format in INT4_FORMATS:
        check_int4_split(full, world)
    if me is not None and me.rank > 0:   # this program's engine is rank 0's: serve it, then end
        raise SystemExit(run_worker(config, me))
    group, device, threads = _rank_zero_group(config, world, me)
    try:
        torch.set_num_threads(threads)
        model, full, tokenizer, comm = load_rank_model(config, 0, world, device)
        group.join(device)
    except BaseException:
        group.close()
        raise
    return TensorParallelTarget(model, full, tokenizer, group, comm)


def _rank_zero_group(config: EngineConfig, world: int, me: TorchrunRank | None):
    """(the group handle, rank 0's device, its threads): the worker ranks started here, or
    torchrun's."""
    threads = config.resolved_for("generate").threads
    if me is not None:
        pin_local_rank(me, threads)
        return TorchrunGroup(me), rank_device(config, me), threads
    devices = rank_devices(config, world)
    return RankGroup(config, world, threads, devices), devices[0], threads


__all__ = ["TensorParallelError", "TensorParallelRunner", "TensorParallelTarget", "ForwardStats", "start"]
