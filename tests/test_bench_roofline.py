"""bench/roofline.py's byte count: what one decode step streams, per weight format; and
bench/experiments/linear_widths.py's sums over the body."""
from __future__ import annotations

import pytest
import torch

from bench_scripts import load
from test_model import tiny_hf_model
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel

roofline = load("roofline", "roofline")


@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
def test_bytes_per_step_counts_every_packed_layer_and_the_head(fmt):
    """Body linears as packed (bf16 blocks, int8 + scales, int4 + fp16 scale and min), the
    refined head's approximate parts (its float32 copy is read a few rows at a time: 0)."""
    hf = tiny_hf_model("qwen2")  # q/k/v bias
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.bfloat16, weight_format=fmt)
    got = roofline.bytes_per_step(model, context_len=10)
    packed = {"w16", "qweight", "scales", "q4", "scale", "min", "bias"}  # every layer kind's buffers
    sizes = {name: t.numel() * t.element_size() for name, t in model.named_buffers()
             if name.rsplit(".", 1)[-1] in packed}
    want_linear = sum(sizes.values())
    want_head = sum(b for name, b in sizes.items() if name.startswith("lm_head.parts."))
    assert want_head > 0 and got["head_bytes_included"] == want_head
    assert got["linear_bytes"] == want_linear
    assert got["kv_bytes"] == 2 * cfg.num_layers * 10 * cfg.num_kv_heads * cfg.head_dim * 2


@pytest.mark.parametrize("huge_pages", [False, True])
def test_memory_bandwidth_reads_its_buffers_in_either_kind_of_page(huge_pages):
    got = roofline.memory_bandwidth(1, mib=4, reps=1, huge_pages=huge_pages)
    assert set(got) == {"read_gbps", "read_best_gbps", "copy_gbps", "copy_best_gbps"}
    assert all(v > 0 for v in got.values())


def test_read_probe_and_paired_fractions():
    """The per-prompt probe reads its buffer; a prompt's fraction is its decode tokens/s over
    the roofline of the bandwidth read just before it (records without a reading skipped)."""
    assert roofline.ReadProbe(1, mib=4, huge_pages=False).gbps(reps=1) > 0
    records = [{"decode_tokens_per_s": 100.0, "probe_read_gbps": 10.0},
               {"decode_tokens_per_s": 100.0, "probe_read_gbps": 20.0},
               {"decode_tokens_per_s": None, "probe_read_gbps": 20.0},
               {"decode_tokens_per_s": 100.0, "probe_read_gbps": None}]
    assert roofline.paired_fractions(records, step_bytes=50_000_000) == [0.5, 0.25]


def test_linear_widths_sums_each_width_over_the_body_by_layer_counts():
    """bench/experiments/linear_widths.py: a width's body time is each shape's timing times its layer
    count, summed (two shapes, 30 and 60 layers), and the ratio is int4 over bf16."""
    widths = load("experiments/linear_widths", "bench_linear_widths")
    rows = [{"width": 1, "count": 30, "int4_s": 1e-4, "torch_bf16_s": 2e-4},
            {"width": 1, "count": 60, "int4_s": 2e-4, "torch_bf16_s": 2e-4},
            {"width": 16, "count": 30, "int4_s": 8e-4, "torch_bf16_s": 2e-4}]
    one, sixteen = widths.body_sums(rows, [1, 16])
    assert one["int4_ms"] == pytest.approx(30 * 0.1 + 60 * 0.2) and one["torch_bf16_ms"] == pytest.approx(90 * 0.2)
    assert one["int4_over_torch_bf16"] == pytest.approx(15 / 18)
    assert sixteen["width"] == 16 and sixteen["int4_over_torch_bf16"] == pytest.approx(4.0)
