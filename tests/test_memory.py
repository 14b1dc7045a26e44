"""Weights moved into huge-page memory (verispec/model/memory.py): the same tensors, the
same numbers, whatever the OS grants."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tiny import run_all, tiny_engine, tiny_pair
from verispec.config import EngineConfig
from verispec.model import memory
from verispec.sampling import SamplingParams


def _module() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 64))
    m.register_buffer("table", torch.randn(10, 8))
    m.register_buffer("rows", m.table[3:7, 2:5])   # a strided view into another buffer's storage
    m.register_buffer("codes", torch.arange(7, dtype=torch.float16))
    m.register_buffer("absent", None)
    return m


def test_a_moved_module_computes_the_same_from_one_aligned_region():
    m = _module()
    x = torch.randn(5, 64)
    expected = m(x)
    before = {name: t.clone() for name, t in m.state_dict().items()}
    strides = {name: t.stride() for name, t in m.state_dict().items()}
    param = m[0].weight
    nbytes = memory.move_to_huge_pages(m)

    assert m[0].weight is param and isinstance(m[2].bias, nn.Parameter)  # the same Parameter objects
    assert torch.equal(m(x), expected)
    for name, t in m.state_dict().items():
        assert torch.equal(t, before[name]), name
        assert t.dtype == before[name].dtype and t.stride() == strides[name], name
    assert m.absent is None
    storages = {t.untyped_storage().data_ptr() for t in m.state_dict().values()}
    assert len(storages) == 1  # every tensor a view of one region
    starts = sorted(t.data_ptr() for t in m.state_dict().values())
    assert min(starts) % memory.HUGE_PAGE == 0
    assert nbytes >= sum(t.numel() * t.element_size() for name, t in before.items() if name != "rows")


def test_views_that_shared_a_storage_still_share_it():
    m = _module()
    memory.move_to_huge_pages(m)
    m.table[4, 3] = 123.0
    assert m.rows[1, 1] == 123.0  # rows is table[3:7, 2:5]: the same memory, not a copy


def test_tied_parameters_stay_one_parameter():
    emb, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = emb.weight
    m = nn.ModuleDict({"emb": emb, "head": head})
    memory.move_to_huge_pages(m)
    assert m["head"].weight is m["emb"].weight
    with torch.no_grad():
        m["emb"].weight[2, 1] = 7.0
    assert m["head"].weight[2, 1] == 7.0


def test_nothing_on_the_cpu_moves_nothing():
    assert memory.move_to_huge_pages(nn.ReLU()) == 0


def test_engine_outputs_are_identical_with_and_without_huge_pages():
    """Greedy and seeded sampling, with n-gram speculation: token for token the same, and the
    resolved config says whether the weights moved (only where the OS offers huge pages)."""
    target, _ = tiny_pair(vocab=16)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 4, 3, 2, 1]]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.8, max_tokens=12, seed=3)]
    outputs, resolved = {}, {}
    for huge in (False, True):
        engine = tiny_engine(copy.deepcopy(target), k=3, seed=7, huge_pages=huge)
        resolved[huge] = engine.config.huge_pages
        outputs[huge] = [o.token_ids for o in run_all(engine, prompts, params)]
    assert outputs[True] == outputs[False]
    assert resolved == {False: False, True: memory.huge_pages_available()}
    assert EngineConfig().huge_pages is True  # on by default


def test_a_moved_model_still_saves_and_loads_its_runtime_weights(tmp_path):
    """The views share one storage without overlapping: safetensors writes each on its own."""
    from safetensors.torch import load_file, save_file

    target, _ = tiny_pair(vocab=16)
    memory.move_to_huge_pages(target)
    tensors, meta = target.runtime_state()
    save_file(tensors, str(tmp_path / "w.safetensors"), metadata=meta)
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())
