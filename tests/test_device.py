"""The engine's device: where it resolves to, and at most one device-to-host read per step.

On a GPU every host read of a tensor the model computed waits for the device. The CPU has
no such cost to measure, so the logits are marked instead: `OnDevice` is a tensor subclass
that every torch op propagates to its results, and counts each host read of a marked
tensor (tolist, item, int, bool, numpy). Tensors the engine builds from host lists stay
unmarked. A value that reaches a plain tensor through an in-place write escapes the mark
(an undercount); scripts/gpu_check.py counts the same reads on CUDA with
`torch.cuda.set_sync_debug_mode`.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tiny import TEST_DEVICE, tiny_engine, tiny_pair
from verispec.config import EngineConfig
from verispec.engine import engine as engine_module
from verispec.model.device import resolve_device
from verispec.sampling import SamplingParams

pytestmark = pytest.mark.gpu

_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__,
               torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}


class OnDevice(torch.Tensor):
    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            OnDevice.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _mark_logits(engine) -> None:
    """Mark the logits of the target and of the draft model, if any. The CPU kernels are
    turned off: they are not torch ops, so their results would escape the mark (and a GPU
    runs without them)."""
    for runner in (engine.target, engine.draft_runner):
        if runner is not None:
            runner.model.kernels = None
            runner.forward = _marked(runner.forward)


def _marked(forward):
    return lambda rows: [logits.as_subclass(OnDevice) for logits in forward(rows)]


def _reads_per_step(engine, prompts, params) -> tuple[list[int], int]:
    """(host reads of each step, draft tokens verified)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    reads, drafted = [], 0
    while engine.has_unfinished_requests():
        OnDevice.reads = 0
        outputs = engine.step()
        reads.append(OnDevice.reads)
        drafted += sum(out.spec.num_draft_tokens for out in outputs if out.finished)
    return reads, drafted


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(noise=0.3)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=24),
                                    SamplingParams(temperature=0.8, max_tokens=24)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_one_host_read_per_step(pair, method, params):
    """A step reads the device once: sampled first tokens and every row's verdict in one
    transfer (`Readback`), prefill and decode rows together. A draft model adds one read
    per drafted position (each draft token is the next draft pass's input, built on the
    host)."""
    target, draft = pair
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=3,
                         max_batched_tokens=12)  # prompts of 9 and 14: chunked, prefill beside decode
    _mark_logits(engine)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [4, 5, 6, 7] * 3 + [4, 5]]
    reads, drafted = _reads_per_step(engine, prompts, params)
    assert max(reads) == (1 + 3 if method == "draft" else 1), reads
    assert drafted > 0 or method == "none"


def test_separate_reads_are_caught(pair, monkeypatch):
    """The counter catches a step that reads its verdict tensors one by one."""
    def fetch_each(self):
        self._host = [t.reshape(-1).tolist() for t in self._tensors]
    monkeypatch.setattr(engine_module.Readback, "fetch", fetch_each)
    engine = tiny_engine(pair[0], method="ngram", k=3)
    _mark_logits(engine)
    reads, _ = _reads_per_step(engine, [[1, 2, 3, 1, 2, 3, 1, 2]], SamplingParams(temperature=0.8, max_tokens=16))
    assert max(reads) == 3  # tokens, accepted lengths, output counts


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="needs VERISPEC_TEST_DEVICE=cuda and a GPU "
                    "(scripts/gpu_check.py runs it)")
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_cuda_syncs_per_step(pair, method):
    """What CUDA itself counts: every synchronizing call (host reads, and host-to-device
    copies that wait for the stream) warns in sync-debug mode; a decode step makes one."""
    engine = tiny_engine(pair[0], method=method, k=3)
    for i, prompt in enumerate([[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6]]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.8, max_tokens=16))
    engine.step()  # the prefill (first pass: lazy initialisation may sync)
    syncs = []
    while engine.has_unfinished_requests():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    assert max(syncs) == 1, syncs


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="device 'cuda' was asked for"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(device="tpu")


def test_config_as_run_names_the_device(pair):
    engine = tiny_engine(pair[0])
    assert engine.config.device == "cpu"
    assert engine._shared_generator.device == torch.device("cpu")
