"""Warm starts load the runtime weights cached on the first start, bit for bit."""
import pytest
import torch

from verispec.config import EngineConfig
from verispec.engine.engine import load_model
from verispec.model import kernels
from verispec.model.attention import AttentionMetadata
from verispec.model.quant import Int4Linear, RefinedHead


def logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    kv = model.new_kv_store(n + 1)
    meta = AttentionMetadata.build([n], [n], [list(range(n))], [list(range(1, n + 1))], [list(range(1, n + 1))])
    return model(torch.tensor(ids), meta, kv)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One cache for the module: the GGUF is converted once, each format writes its own file."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("weight_format", ["dense", "auto", "int8", "int4a8"])
def test_second_load_uses_the_runtime_cache_and_gives_identical_weights(cache_dir, monkeypatch, weight_format):
    monkeypatch.setenv("VERISPEC_CACHE", str(cache_dir))
    config = EngineConfig(dtype="bfloat16", weight_format=weight_format)
    first, _, tok = load_model(config.model, config)       # converts the GGUF, writes the runtime file
    runtime = list(cache_dir.rglob(f"runtime/bfloat16-{weight_format}-*.safetensors"))
    assert len(runtime) == 1
    stamp = runtime[0].stat().st_mtime_ns
    second, _, _ = load_model(config.model, config)        # must read it, not rebuild it
    assert runtime[0].stat().st_mtime_ns == stamp
    assert second.weight_format == first.weight_format == {"auto": "int4"}.get(weight_format, weight_format)
    # the same module types, holding identical tensors and attributes
    assert [type(m) for m in first.modules()] == [type(m) for m in second.modules()]
    if weight_format != "dense":
        assert type(second.lm_head) is RefinedHead and second.lm_head.norm_coef == first.lm_head.norm_coef
    if weight_format in ("auto", "int4a8"):
        assert isinstance(second.layers[0].self_attn.qkv_proj, Int4Linear)
        assert second.layers[0].self_attn.qkv_proj.act_bits == {"auto": 16, "int4a8": 8}[weight_format]
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    ids = tok.encode("The capital of France is")
    if weight_format == "int4a8":  # only verispec's kernels compute it
        first.kernels = second.kernels = kernels.load(required=True)
    assert torch.equal(logits(first, ids), logits(second, ids))
