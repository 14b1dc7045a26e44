"""Warm starts load the runtime weights cached on the first start, bit for bit."""
import torch

from verispec.config import EngineConfig
from verispec.engine.engine import load_model
from verispec.model.attention import AttentionMetadata


def logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    kv = model.new_kv_store(n + 1)
    meta = AttentionMetadata.build([n], [n], [list(range(n))], [list(range(1, n + 1))], [list(range(1, n + 1))])
    return model(torch.tensor(ids), meta, kv)


def test_second_load_uses_the_runtime_cache_and_gives_identical_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    config = EngineConfig(dtype="bfloat16")
    first, _, tok = load_model(config.model, config)       # converts the GGUF, writes the runtime file
    runtime = list(tmp_path.rglob("runtime/bfloat16-*.safetensors"))
    assert len(runtime) == 1
    stamp = runtime[0].stat().st_mtime_ns
    second, _, _ = load_model(config.model, config)        # must read it, not rebuild it
    assert runtime[0].stat().st_mtime_ns == stamp
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    ids = tok.encode("The capital of France is")
    assert torch.equal(logits(first, ids), logits(second, ids))
