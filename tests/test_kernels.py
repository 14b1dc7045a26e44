"""The fused C++ kernels (verispec.model.kernels) compute what the PyTorch ops they replace do.

Each kernel is compared with its PyTorch counterpart in float32 and bfloat16 (bfloat16:
identical except where float32 summation order moves a value across a rounding boundary,
at most one unit in the last place), and the comparison is shown to fail on a broken call
(dropping a key, swapping cos and sin, a missing residual add). The model with kernels
matches the model without them, prefill and decode rows mixed in one pass.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tiny import TinyTokenizer, tiny_config
from verispec.config import EngineConfig
from verispec.engine.engine import LLMEngine
from verispec.model import kernels
from verispec.model.attention import KERNEL_QUERY_LIMIT, AttentionMetadata
from verispec.model.fused import build_stack, decoder_stack
from verispec.model.llama import LlamaModel, _pack_bf16_linears, apply_rotary
from verispec.model.quant import (Bf16Linear, Q8Linear, make_int4_linear, pack_bf16, pack_q8, quantize_int4, unpack_bf16,
                                  unpack_int4, unpack_q8)

OPS = kernels.load(required=True)
DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float32: equal to 1e-5 relative; bfloat16: within one ulp, >= 98% identical."""
    assert a.shape == b.shape and a.dtype == b.dtype
    bf16 = a.dtype is torch.bfloat16
    a, b = a.float(), b.float()
    err = (a - b).abs() <= b.abs().clamp_min(1e-3) * (2 ** -7 if bf16 else 1e-5) + 1e-6
    return bool(err.all()) and (not bf16 or float((a == b).float().mean()) >= 0.98)


@pytest.fixture(params=DTYPES, ids=["f32", "bf16"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("broken", [False, True])
def test_add_rms_norm(dtype, broken):
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(5, 576, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    x0 = x.clone()
    s, h = OPS.add_rms_norm(x, x * 0 if broken else delta, w, 1e-5)
    ref = x + delta
    assert torch.equal(s, ref) != broken
    assert close(h, F.rms_norm(ref, (576,), w, 1e-5)) != broken
    assert torch.equal(x, x0)  # the input is not written


@pytest.mark.parametrize("broken", [False, True])
def test_rms_norm(dtype, broken):
    """rms_norm(x [+ delta]) * w in w's dtype: float32 out for a float32 w (the final norm
    before the float32 head), x's dtype for its own; the add rounded to x's dtype first,
    x itself never written. Broken: the delta left out."""
    g = torch.Generator().manual_seed(2)
    x, delta = (torch.randn(5, 576, generator=g).to(dtype) for _ in range(2))
    w = 1 + 0.1 * torch.randn(576, generator=g)
    x0 = x.clone()
    for weight in (w, w.to(dtype)):
        got = OPS.rms_norm(x, weight, 1e-5, None if broken else delta)
        ref = F.rms_norm((x + delta).to(weight.dtype), (576,), weight, 1e-5)
        assert got.dtype == weight.dtype
        assert close(got, ref) != broken
        assert close(OPS.rms_norm(x, weight, 1e-5), F.rms_norm(x.to(weight.dtype), (576,), weight, 1e-5))
    assert torch.equal(x, x0)
    if dtype is torch.bfloat16:  # the stack's layer norms: the same numbers as add_rms_norm
        assert torch.equal(OPS.rms_norm(x, w.to(dtype), 1e-5, delta), OPS.add_rms_norm(x, delta, w.to(dtype), 1e-5)[1])
    with pytest.raises(RuntimeError, match="weight must be x's dtype or float32"):
        OPS.rms_norm(x, w.half() if dtype is not torch.float16 else w.double(), 1e-5)


def _last_argmax(logits: torch.Tensor) -> torch.Tensor:
    """A broken argmax: the last of equal largest values."""
    flipped = logits.flip(-1).argmax(-1)
    return logits.shape[-1] - 1 - flipped


@pytest.mark.parametrize("broken", [False, True])
def test_argmax_rows_is_torch_argmax(broken):
    """Each row's first largest value (ties to the lowest index), a NaN's where a row has
    one, over any length (the vector path's tail) and row stride; the engine takes greedy
    tokens from it. Broken: an argmax that breaks ties to the highest index."""
    argmax = _last_argmax if broken else OPS.argmax_rows
    g = torch.Generator().manual_seed(3)
    same = True
    for vocab in (1, 7, 16, 17, 40, 49152, 49159):
        x = torch.randn(5, vocab + 3, generator=g)[:, :vocab]  # rows strided
        x[1, vocab // 3] = x[1, (2 * vocab) // 3] = x[1].max() + 1  # a tie (one index when vocab is small)
        x[2, :] = 0.25  # all equal
        x[3, vocab - 1] = float("nan")
        if vocab > 5:
            x[3, 5] = float("nan")
            x[4, 2] = float("inf")
        same &= torch.equal(argmax(x), x.argmax(-1))
    assert same != broken
    with pytest.raises(RuntimeError, match="float32"):
        OPS.argmax_rows(torch.zeros(2, 5, dtype=torch.float64))
    # the engine's and the draft's helper: the kernel where it applies, torch.argmax otherwise
    for logits in (x, x.double(), x.bfloat16(), x.t()):
        for ops in (OPS, None):
            assert kernels.greedy_tokens(logits, ops) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("broken", [False, True])
def test_rotary(dtype, broken):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 6, 64, generator=g).to(dtype)  # (T, heads, D): rotate the first 4 heads
    model = LlamaModel(tiny_config(hidden=256, max_len=512))
    cos, sin = model.rotary.cos_sin(torch.tensor([0, 3, 9, 100, 101, 102, 400]), dtype=dtype)
    ref = apply_rotary(qkv[:, :4], cos, sin)
    got = qkv.clone()
    OPS.rotary_(got[:, :4], sin if broken else cos, cos if broken else sin)  # a strided view, in place
    assert close(got[:, :4], ref) != broken
    assert torch.equal(got[:, 4:], qkv[:, 4:])  # the other heads untouched


@pytest.mark.parametrize("broken", [False, True])
def test_rotary_store_rotates_and_writes_the_pools(dtype, broken):
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(3, 8, 64, generator=g).to(dtype)  # 4 q heads, 2 k heads, 2 v heads
    model = LlamaModel(tiny_config(hidden=256, max_len=512))
    cos, sin = model.rotary.cos_sin(torch.tensor([4, 5, 6]), dtype=dtype)
    k_pool, v_pool = torch.zeros(10, 2, 64, dtype=dtype), torch.zeros(10, 2, 64, dtype=dtype)
    slots = torch.tensor([7, 2, 9])
    qk, v = qkv[:, :6], qkv[:, 6:]
    ref = apply_rotary(qk, cos, sin)
    OPS.rotary_store_(qk, v, cos, sin, k_pool, v_pool, slots.flip(0) if broken else slots)
    ok = close(qkv[:, :6], ref) and torch.equal(k_pool[slots], qkv[:, 4:6]) and torch.equal(v_pool[slots], v)
    assert ok != broken
    with pytest.raises(RuntimeError, match="slot out of range"):
        OPS.rotary_store_(qk, v, cos, sin, k_pool, v_pool, torch.tensor([1, 2, 10]))


@pytest.mark.parametrize("broken", [False, True])
def test_silu_mul(dtype, broken):
    g = torch.Generator().manual_seed(7)
    gate_up = (3 * torch.randn(4, 2 * 1536, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = OPS.silu_mul(gate_up.flip(1) if broken else gate_up)  # broken: gate and up swapped
    assert close(got, F.silu(gate) * up) != broken


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("d", [32, 64, 128], ids=["d32", "d64 (bf16: vector path)", "d128 (bf16: vector path)"])
def test_decode_attention_reads_exactly_each_rows_context(dtype, broken, d):
    g = torch.Generator().manual_seed(2)
    slots, heads, kv_heads = 64, 6, 2
    k_pool, v_pool = (torch.randn(slots, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([1, 17, 40])
    ctx = torch.zeros(3, 40, dtype=torch.long)
    for b, n in enumerate(lens.tolist()):
        ctx[b, :n] = torch.randperm(slots - 1, generator=g)[:n] + 1
    poisoned_k, poisoned_v = k_pool.clone(), v_pool.clone()
    unused = torch.ones(slots, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        unused[ctx[b, :n]] = False
    poisoned_k[unused] = float("nan")  # a slot past a row's length must never be read
    poisoned_v[unused] = float("nan")
    q = torch.randn(3, heads, d, generator=g).to(dtype)
    short = lens - torch.tensor([0, 1, 1])  # broken: the last key of rows 1 and 2 dropped
    rows = torch.arange(3)
    got = OPS.decode_attention(q, poisoned_k, poisoned_v, ctx, rows, short if broken else lens, d ** -0.5)
    for b, n in enumerate(lens.tolist()):
        keys = k_pool[ctx[b, :n]].transpose(0, 1).unsqueeze(0)    # (1, Hkv, n, D)
        values = v_pool[ctx[b, :n]].transpose(0, 1).unsqueeze(0)
        # The exact result (float64), rounded once: SDPA in bfloat16 rounds intermediates too.
        ref = F.scaled_dot_product_attention(q[b:b + 1, :, None].double(), keys.double(), values.double(),
                                             enable_gqa=True)[0, :, 0].to(dtype)
        assert close(got[b], ref) != (broken and b > 0)


@pytest.mark.parametrize("broken", [False, True], ids=["grouped", "broken: two heads of a group swapped"])
@pytest.mark.parametrize("d,heads,kv_heads", [(64, 6, 2), (64, 14, 2), (128, 12, 2), (64, 4, 4)])
def test_decode_attention_grouped_heads_equal_each_head_alone(broken, d, heads, kv_heads):
    """With enough work items (8 queries at 2 threads) the vector kernel runs the heads that
    share a KV head as one item (shared key and value loads); one query at 2 threads runs
    each head alone. Every head's result must be the same bit for bit (a token's attention
    may not depend on the batch it is in), for groups of 3, of 7 (values in 3 + 3 + 1 heads),
    of 6 at 128 dimensions, and no grouping (as many KV heads as heads). Broken: two heads'
    queries swapped in the batched call only (a group's heads mixed up)."""
    g = torch.Generator().manual_seed(11)
    rows, slots, n = 8, 4096, 300
    k_pool, v_pool = (torch.randn(slots, kv_heads, d, generator=g).bfloat16() for _ in range(2))
    ctx = torch.stack([torch.randperm(slots, generator=g)[:n] for _ in range(rows)])
    lens = torch.tensor([n - 7 * r for r in range(rows)])
    q = torch.randn(rows, heads, d, generator=g).bfloat16()
    batched = q.clone()
    if broken:
        batched[:, [0, 1]] = batched[:, [1, 0]]
    torch.set_num_threads(2)
    try:
        got = OPS.decode_attention(batched, k_pool, v_pool, ctx, torch.arange(rows), lens, d ** -0.5)
        alone = [OPS.decode_attention(q[r:r + 1], k_pool, v_pool, ctx[r:r + 1], torch.tensor([0]), lens[r:r + 1],
                                      d ** -0.5)[0] for r in range(rows)]
    finally:
        torch.set_num_threads(1)
    assert torch.equal(got, torch.stack(alone)) != broken


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("d,threads", [(64, 1), (64, 2), (128, 3)])
def test_decode_attention_verify_rows_equal_their_queries_alone(broken, d, threads):
    """Verify rows: runs of consecutive queries over one context, each seeing its own prefix
    (lens = position + 1), as a verify pass sends them (a 40-query run and a row in two runs
    included). Each query's result must equal the query attended alone, bit for bit (a
    verify pass computes what plain steps would), and the float64 reference, at 1-3
    threads. Broken: every query of a run sees the run's longest context (a causal mask lost)."""
    g = torch.Generator().manual_seed(9)
    heads, kv_heads, slots = 6, 2, 2048
    k_pool, v_pool = (torch.randn(slots, kv_heads, d, generator=g).bfloat16() for _ in range(2))
    starts = {0: 300, 1: 17, 2: 0, 3: 150}           # row -> its first query's position
    runs = [(0, 5), (1, 1), (2, 3), (3, 40), (0, 2)]  # (row, queries); row 0 again, after its first 5
    ctx = torch.stack([torch.randperm(slots, generator=g)[:400] for _ in range(4)])
    row_of, lens, seen = [], [], {}
    for r, n in runs:
        for _ in range(n):
            row_of.append(r)
            lens.append(starts[r] + seen.get(r, 0) + 1)
            seen[r] = seen.get(r, 0) + 1
    run_lens, at = list(lens), 0
    for _, n in runs:  # the broken kernel's view: each query sees its run's last position
        run_lens[at: at + n] = [lens[at + n - 1]] * n
        at += n
    q = torch.randn(len(row_of), heads, d, generator=g).bfloat16()
    torch.set_num_threads(threads)
    try:
        got = OPS.decode_attention(q, k_pool, v_pool, ctx, torch.tensor(row_of),
                                   torch.tensor(run_lens if broken else lens), d ** -0.5)
    finally:
        torch.set_num_threads(1)
    same = True
    for i, (r, n) in enumerate(zip(row_of, lens)):
        alone = OPS.decode_attention(q[i:i + 1], k_pool, v_pool, ctx[r:r + 1], torch.tensor([0]), torch.tensor([n]),
                                     d ** -0.5)[0]
        same &= torch.equal(got[i], alone)
        keys, values = (pool[ctx[r, :n]].transpose(0, 1).unsqueeze(0).double() for pool in (k_pool, v_pool))
        ref = F.scaled_dot_product_attention(q[i:i + 1, :, None].double(), keys, values,
                                             enable_gqa=True)[0, :, 0].bfloat16()
        assert close(alone, ref)
    assert same != broken


def test_decode_attention_refuses_bad_input():
    q, pool = torch.zeros(1, 2, 8), torch.zeros(4, 1, 8)
    row = torch.tensor([0])
    with pytest.raises(RuntimeError, match="slot out of range"):
        OPS.decode_attention(q, pool, pool, torch.tensor([[5]]), row, torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="1..C context slots"):
        OPS.decode_attention(q, pool, pool, torch.tensor([[1]]), row, torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="row_of out of range"):
        OPS.decode_attention(q, pool, pool, torch.tensor([[1]]), torch.tensor([1]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="dtypes must match"):
        OPS.decode_attention(q.bfloat16(), pool, pool, torch.tensor([[1]]), row, torch.tensor([1]), 1.0)


def _int4_layer(n: int = 40, k: int = 96, bias: bool = True, seed: int = 0, act_bits: int = 16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    return make_int4_linear(quantize_int4(w), torch.randn(n, generator=g) if bias else None, torch.bfloat16,
                            act_bits)


def _activation_grid_error(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The bound on |x @ w.T - (x rounded as the int4 and Q8_0 kernels round it) @ w.T|: per group of
    32, |x - m p| <= p / 2 with p = 2^(e - 14), e the exponent of the group's largest |x|."""
    xg = x.double().view(x.shape[0], -1, 32)
    e = torch.frexp(xg.abs().amax(-1))[1]                       # largest |x| < 2^e
    half_step = torch.ldexp(torch.full(e.shape, 0.5, dtype=torch.float64), e - 14)
    wg = w.double().abs().view(w.shape[0], -1, 32).sum(-1)      # (N, groups): sum |w| per group
    return half_step @ wg.t()                                   # (T, N)


@pytest.mark.skipif(not OPS.int4_vector, reason="no AVX-512 or AVX2 here: layers use PyTorch's int4 kernel")
@pytest.mark.parametrize("broken", [False, True], ids=["ok", "nibbles swapped"])
@pytest.mark.parametrize("bias", [True, False])
def test_int4_linear_computes_the_stored_weights(bias, broken):
    """x @ W.T + b against float64 on the weights the layer stores (40 rows: the last block
    of 16 padded), within the kernel's own bound: its rounding of the activations onto a
    16-bit grid per group of 32, float32 accumulation and the one bf16 rounding of the
    output; a layout bug is caught. Large-magnitude groups next to tiny ones make the
    activation rounding matter (and it is not zero: the check bites on it too)."""
    layer = _int4_layer(bias=bias)
    w = unpack_int4(layer.q4, layer.scale, layer.min, 40).dequantize().double()
    q4 = (layer.q4 >> 4) | (layer.q4 << 4) if broken else layer.q4
    x = torch.randn(13, 96)
    x[:, 0] *= 300  # an outlier channel: the other 31 values of its group sit on a coarse grid
    x = x.bfloat16()
    want = x.double() @ w.t() + (layer.bias.double() if bias else 0)
    got = OPS.int4_linear(x, q4, layer.scale, layer.min, 40, layer.bias)
    assert got.shape == (13, 40) and got.dtype == torch.bfloat16
    act = _activation_grid_error(x, w)
    accumulate = (x.double().abs() @ w.abs().t() + want.abs()) * 2 ** -22
    err = (got.double() - want).abs()
    assert bool((err <= want.abs() * 2 ** -8 + act + accumulate).all()) != broken
    if not broken:  # the activations really are rounded: without that term the bound fails
        assert not bool((err <= want.abs() * 2 ** -9 + accumulate).all())


@pytest.mark.parametrize("broken", [False, True], ids=["ok", "nibbles swapped"])
def test_int4_linear_on_the_8_bit_grid_computes_the_stored_weights(broken):
    """act_bits 8 (weight format int4a8): x @ W.T + b against float64 within
    the 8-bit grid's bound (per group of 32, |x - m p| <= p / 2 = max|x| / 254), float32
    accumulation and the output's bf16 rounding; a layout bug (the lane's two nibbles
    swapped) is caught, and the 16-bit grid's bound fails: the activations really are on
    the coarser grid."""
    layer = _int4_layer(act_bits=8)
    w = unpack_int4(layer.q4, layer.scale, layer.min, 40).dequantize().double()
    q4 = (layer.q4 >> 4) | (layer.q4 << 4) if broken else layer.q4
    x = torch.randn(13, 96)
    x[:, 0] *= 300
    x = x.bfloat16()
    want = x.double() @ w.t() + layer.bias.double()
    for portable in (False, True):
        got = OPS.int4_linear(x, q4, layer.scale, layer.min, 40, layer.bias, portable=portable, act_bits=8)
        half_step = x.double().view(13, -1, 32).abs().amax(-1) / 254 * (1 + 2 ** -20)
        act = half_step @ w.abs().view(40, -1, 32).sum(-1).t()
        accumulate = (x.double().abs() @ w.abs().t() + want.abs()) * 2 ** -22
        err = (got.double() - want).abs()
        assert bool((err <= want.abs() * 2 ** -8 + act + accumulate).all()) != broken
        if not broken:
            assert not bool((err <= want.abs() * 2 ** -8 + _activation_grid_error(x, w) + accumulate).all())


def test_int4_linear_on_the_8_bit_grid_rows_do_not_depend_on_the_pass():
    """act_bits 8: each token's output bit for bit the same alone, in any pass width (tiles of
    1..4 on AVX2, 1..8 on AVX-512; this grid has no AMX path), and on the portable loop."""
    layer = _int4_layer(n=72, k=160, seed=1, act_bits=8)
    x = torch.randn(40, 160).bfloat16()
    full = OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 72, layer.bias, act_bits=8)
    assert torch.equal(full, OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 72, layer.bias, portable=True,
                                             act_bits=8))
    for width in (1, 3, 5, 8, 16, 17, 32):
        parts = [OPS.int4_linear(x[i: i + width].contiguous(), layer.q4, layer.scale, layer.min, 72, layer.bias,
                                 act_bits=8) for i in range(0, 40, width)]
        assert torch.equal(torch.cat(parts), full), width
    q4 = layer.q4.clone()
    q4[0, 0, 0] ^= 1  # the check bites
    assert not torch.equal(OPS.int4_linear(x, q4, layer.scale, layer.min, 72, layer.bias, act_bits=8), full)


def test_int4a8_layers_need_the_kernels():
    """No silent fallback to another arithmetic: without verispec's kernels an int4a8 layer
    refuses to run, and an engine over an int4a8 model with kernels off refuses to start."""
    layer = _int4_layer(act_bits=8)
    with pytest.raises(RuntimeError, match="int4a8"):
        layer(torch.randn(2, 96).bfloat16())
    layer.kernels = OPS
    assert layer(torch.randn(2, 96).bfloat16()).shape == (2, 40)
    model = _packed_tiny_model("int4a8")
    model.weight_format = "int4a8"
    config = EngineConfig(model="tiny", weight_format="int4a8", kernels="off")
    with pytest.raises(ValueError, match="'int4a8'.*kernels only"):
        LLMEngine(config, model, TinyTokenizer(64))


@pytest.mark.parametrize("act_bits", [
    pytest.param(16, marks=pytest.mark.skipif(not OPS.int4_vector, reason="no AVX-512 or AVX2 here")), 8])
def test_int4_linear_a_non_finite_activation_makes_its_rows_nan(act_bits):
    layer = _int4_layer(seed=3, act_bits=act_bits)
    x = torch.randn(3, 96).bfloat16()
    x[1, 40] = float("inf")
    x[2, 5] = float("nan")
    for portable in (False, True):
        got = OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 40, layer.bias, portable=portable,
                              act_bits=act_bits)
        assert bool(got[0].isfinite().all()) and bool(got[1:].isnan().all())


@pytest.mark.skipif(not OPS.int4_vector, reason="no AVX-512 or AVX2 here")
def test_int4_linear_rows_do_not_depend_on_the_pass():
    """Bit for bit: each token's output is the same alone, in any pass width (the vector
    path's tiles: 1..8 tokens on AVX-512, 1..4 on AVX2, 16 on AMX from 32 tokens a pass with
    the rest on AVX-512's), and on the portable loop: a verify pass and a plain step compute
    the same numbers. An outlier channel puts some groups' activations at the 16-bit grid's
    ends (|m| near 2^14: the AMX path's high byte plane at its widest)."""
    layer = _int4_layer(n=72, k=160, seed=1)
    x = torch.randn(40, 160)
    x[:, 0] *= 300
    x = x.bfloat16()
    full = OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 72, layer.bias)
    assert torch.equal(full, OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 72, layer.bias, portable=True))
    for width in (1, 3, 5, 8, 16, 17, 32):
        parts = [OPS.int4_linear(x[i: i + width].contiguous(), layer.q4, layer.scale, layer.min, 72, layer.bias)
                 for i in range(0, 40, width)]
        assert torch.equal(torch.cat(parts), full), width
    # the check bites: one weight changed moves outputs
    q4 = layer.q4.clone()
    q4[0, 0, 0] ^= 1
    assert not torch.equal(OPS.int4_linear(x, q4, layer.scale, layer.min, 72, layer.bias), full)


def test_the_int4_kernel_uses_amx_tiles_where_the_cpu_has_them():
    """A CPU with AMX-INT8 (and a kernel that grants it, Linux 5.16 on) runs wide int4 passes
    on tiles, which test_int4_linear_rows_do_not_depend_on_the_pass compares with the
    portable loop bit for bit (it caught a high plane weighed 128 instead of 256); without
    it the AVX-512 tiles run and `int4_amx` says so."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    assert OPS.int4_amx == (" amx_int8" in flags and " amx_tile" in flags and OPS.isa == "avx512")
    assert OPS.set_int4_amx(False) is True and OPS.set_int4_amx(True) is False  # (the switch benchmarks use)


@pytest.mark.skipif(not (OPS.int4_vector and OPS.bf16_vector), reason="no AVX-512 or AVX2 here")
def test_vector_paths_round_subnormal_outputs_like_the_portable_loops():
    """Outputs below float32's normal range (|y| < 2^-126) round to bf16 subnormals, as
    c10::BFloat16 rounds them: _mm512_cvtneps_pbh would flush them to zero and the two
    paths would differ (the check bites: every output is subnormal, and not all are 0)."""
    x = (torch.randn(9, 160) * 1e-40).bfloat16()
    layer = _int4_layer(n=40, k=160, bias=False, seed=2)
    w, _ = _bf16_weights(40, 160, bias=False)
    for run in (lambda portable: OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 40, portable=portable),
                lambda portable: OPS.bf16_linear(x, pack_bf16(w), 40, portable=portable)):
        want = run(True)
        assert bool((want.float().abs() < 2.0 ** -126).all()) and bool((want != 0).any())
        assert torch.equal(run(False), want)


def test_int4_linear_refuses_bad_input():
    layer = _int4_layer()
    x = torch.randn(2, 96).bfloat16()
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        OPS.int4_linear(x.float(), layer.q4, layer.scale, layer.min, 40)
    with pytest.raises(RuntimeError, match="q4 must be contiguous uint8"):
        OPS.int4_linear(torch.randn(2, 64).bfloat16(), layer.q4, layer.scale, layer.min, 40)
    with pytest.raises(RuntimeError, match="out_features must fit"):
        OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 49)
    with pytest.raises(RuntimeError, match="scale and min must be contiguous fp16"):
        OPS.int4_linear(x, layer.q4, layer.scale.float(), layer.min, 40)
    with pytest.raises(RuntimeError, match="bias must be contiguous bf16"):
        OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 40, torch.zeros(39).bfloat16())
    with pytest.raises(RuntimeError, match="act_bits must be 16 or 8"):
        OPS.int4_linear(x, layer.q4, layer.scale, layer.min, 40, act_bits=4)


def _bf16_weights(n: int, k: int, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).bfloat16()
    return w, (torch.randn(n, generator=g).bfloat16() if bias else None)


def _cancelling(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, w with a large first pair, x[0] = x[1] = 256 and w[1] = -w[0] = 256 w[0]: the two
    float32 chains carry +-P (~2^16) through the sum, rounding every later product at P's
    precision, and cancel at the end. Any change in the order of the float32 operations then
    shows through the output's bf16 rounding (on random data it hides almost all of them)."""
    x, w = x.clone(), w.clone()
    x[:, :2] = 256
    w[:, 0] *= 256
    w[:, 1] = -w[:, 0]
    return x, w


def _pairs_swapped(w16: torch.Tensor) -> torch.Tensor:
    """A layout bug: each 64-byte line's (k, k + 1) halves exchanged."""
    return w16.view(*w16.shape[:2], 16, 2).flip(-1).reshape(w16.shape).contiguous()


# N: one block, a padded last block; K: one pair, odd (the last pair padded), not a multiple of 16
BF16_SHAPES = [(16, 2), (40, 97), (33, 160), (72, 1538)]


@pytest.mark.skipif(not OPS.bf16_vector, reason="no AVX-512 or AVX2 here: layers use PyTorch's matmul")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n,k", BF16_SHAPES)
@pytest.mark.parametrize("data", ["random", "cancelling"])
def test_bf16_linear_avx512_and_portable_are_bit_identical(n, k, bias, data):
    """Every pass width 1..40 (tiles of 8 and every remainder): the vector path does the
    portable loop's operations in its order; a pair-swapped layout is caught."""
    w, b = _bf16_weights(n, k, bias)
    x = torch.randn(40, k).bfloat16()
    if data == "cancelling":
        x, w = _cancelling(x, w)
    w16 = pack_bf16(w)
    for t in range(1, 41):
        xt = x[:t].contiguous()
        assert torch.equal(OPS.bf16_linear(xt, w16, n, b), OPS.bf16_linear(xt, w16, n, b, portable=True)), t
    if k > 2:  # (16, 2)'s single pair of random values can round alike either way round
        swapped = OPS.bf16_linear(x, _pairs_swapped(w16), n, b, portable=True)
        assert not torch.equal(OPS.bf16_linear(x, w16, n, b), swapped)


@pytest.mark.parametrize("broken", [False, True], ids=["ok", "pairs swapped"])
@pytest.mark.parametrize("n,k", BF16_SHAPES)
def test_bf16_linear_computes_the_weights(n, k, broken):
    """Against float64 on the same bf16 weights: within the one bf16 rounding of the output
    (float32 accumulation adds ~k 2^-24); against PyTorch's bf16 linear: within 2 ulps."""
    w, b = _bf16_weights(n, k, seed=3)
    w16 = _pairs_swapped(pack_bf16(w)) if broken else pack_bf16(w)
    x = torch.randn(7, k).bfloat16()
    want = x.double() @ w.double().t() + b.double()
    got = OPS.bf16_linear(x, w16, n, b)
    assert got.shape == (7, n) and got.dtype == torch.bfloat16
    scale = (x.double().abs() @ w.double().abs().t() + b.double().abs()) * k * 2 ** -24  # the sum's own error
    exact = (got.double() - want).abs() <= want.abs() * 2 ** -8 + scale + 1e-6
    near_torch = (got.float() - F.linear(x, w, b).float()).abs() <= want.abs().float() * 2 ** -6 + scale.float() + 1e-5
    assert bool(exact.all()) != broken and bool(near_torch.all()) != broken


@pytest.mark.skipif(not OPS.bf16_vector, reason="no AVX-512 or AVX2 here")
def test_bf16_linear_rows_do_not_depend_on_the_pass():
    """Bit for bit: token i's output alone, in passes of 3 and 7, and in one pass of 21 (the
    vector path's tiles of 1..8 or 1..3 tokens): a verify pass and a plain step compute the same numbers."""
    w, b = _bf16_weights(72, 160, seed=1)
    x, w = _cancelling(torch.randn(21, 160).bfloat16(), w)
    w16 = pack_bf16(w)
    full = OPS.bf16_linear(x, w16, 72, b)
    for width in (1, 3, 7):
        parts = [OPS.bf16_linear(x[i: i + width].contiguous(), w16, 72, b) for i in range(0, 21, width)]
        assert torch.equal(torch.cat(parts), full), width
    # the check bites: one weight changed moves outputs
    w16 = w16.clone()
    w16[0, 0, 0] += 1
    assert not torch.equal(OPS.bf16_linear(x, w16, 72, b), full)


def test_bf16_linear_refuses_bad_input():
    w, b = _bf16_weights(40, 96)
    w16, x = pack_bf16(w), torch.randn(2, 96).bfloat16()
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        OPS.bf16_linear(x.float(), w16, 40)
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        OPS.bf16_linear(torch.randn(96, 2).bfloat16().t(), w16, 40)
    with pytest.raises(RuntimeError, match="w16 must be contiguous bf16"):
        OPS.bf16_linear(torch.randn(2, 64).bfloat16(), w16, 40)
    with pytest.raises(RuntimeError, match="w16 must be contiguous bf16"):
        OPS.bf16_linear(x, w16.float(), 40)
    with pytest.raises(RuntimeError, match="out_features must fit"):
        OPS.bf16_linear(x, w16, 49)
    with pytest.raises(RuntimeError, match="out_features must fit"):
        OPS.bf16_linear(x, w16, 32)
    with pytest.raises(RuntimeError, match="bias must be contiguous bf16"):
        OPS.bf16_linear(x, w16, 40, b[:39])
    with pytest.raises(RuntimeError, match="bias must be contiguous bf16"):
        OPS.bf16_linear(x, w16, 40, b.float())


@pytest.mark.parametrize("n,k", BF16_SHAPES)
def test_bf16_layer_unpacks_exactly_and_matches_pytorch_without_kernels(n, k):
    """pack/unpack round trip (padding dropped); kernels off: PyTorch's matmul on the same
    weights exactly; on: within bf16 rounding of it."""
    w, b = _bf16_weights(n, k, seed=2)
    layer = Bf16Linear(pack_bf16(w), n, k, b)
    assert torch.equal(unpack_bf16(layer.w16, n, k), w)
    x = torch.randn(5, k).bfloat16()
    assert torch.equal(layer.forward(x), F.linear(x, w, b))
    layer.kernels = OPS
    got, want = layer.forward(x).float(), F.linear(x.float(), w.float(), b.float())
    assert ((got - want).abs() <= want.abs() * 2 ** -7 + 1e-2).all()


def _q8_blocks(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale (N, K / 32) fp16 values, codes (N, K) int8), like a GGUF Q8_0 tensor's blocks."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half().float()
    return scale, codes


def _q8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The activations' 16-bit grid, then float32 accumulation of the groups' exact integer
    sums: gamma_(G + 1) sum |w x| (see q8_0_coef), with a margin for x's rounding in it."""
    n = w.shape[1] // 32 + 2
    return _activation_grid_error(x, w) + n * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())


Q8_SHAPES = [(16, 32), (40, 96), (72, 576)]  # one block, a padded last block, the default head's K


@pytest.mark.parametrize("broken", [False, True], ids=["ok", "rows reversed"])
@pytest.mark.parametrize("n,k", Q8_SHAPES)
def test_q8_linear_computes_the_blocks_in_float32(n, k, broken):
    """Against float64 on the blocks' weights d q: within the bound of the activations'
    16-bit grid and float32 accumulation (no bf16 rounding of x or y anywhere); a layout bug
    is caught; pack/unpack round trip."""
    scale, codes = _q8_blocks(n, k)
    q8, sc = pack_q8(scale, codes)
    w = (codes.float().view(n, -1, 32) * scale[..., None]).view(n, k)
    assert torch.equal(unpack_q8(q8, sc, n), w)
    if broken:  # a layout bug: each block's 16 rows in reverse order
        q8 = q8.flip(-1).contiguous()
    x = torch.randn(13, k)
    got = OPS.q8_linear(x, q8, sc, n)
    assert got.shape == (13, n) and got.dtype == torch.float32
    ok = (got.double() - x.double() @ w.double().t()).abs() <= _q8_bound(x, w) + 1e-30
    assert bool(ok.all()) != broken


@pytest.mark.skipif(not OPS.q8_vector, reason="no AVX-512 or AVX2 here: the head runs PyTorch's float32 matmul")
def test_q8_linear_rows_do_not_depend_on_the_pass():
    """Bit for bit: the portable loop, and each token alone, in passes of 3 and 5, and in one
    of 21 (tiles of 1..8): a verify pass and a plain step compute the same logits."""
    scale, codes = _q8_blocks(72, 160, seed=1)
    q8, sc = pack_q8(scale, codes)
    x = torch.randn(21, 160)
    full = OPS.q8_linear(x, q8, sc, 72)
    assert torch.equal(full, OPS.q8_linear(x, q8, sc, 72, portable=True))
    for t in range(1, 22):  # every tile width, vector against portable
        assert torch.equal(OPS.q8_linear(x[:t].contiguous(), q8, sc, 72), full[:t]), t
    for width in (1, 3, 5):
        parts = [OPS.q8_linear(x[i: i + width].contiguous(), q8, sc, 72) for i in range(0, 21, width)]
        assert torch.equal(torch.cat(parts), full), width
    q8 = q8.clone()
    q8[0, 0, 0] ^= 1  # the check bites: one code changed moves outputs
    assert not torch.equal(OPS.q8_linear(x, q8, sc, 72), full)


def test_q8_linear_refuses_bad_input():
    scale, codes = _q8_blocks(40, 96)
    q8, sc = pack_q8(scale, codes)
    x = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        OPS.q8_linear(x.bfloat16(), q8, sc, 40)
    with pytest.raises(RuntimeError, match="q8 must be contiguous int8"):
        OPS.q8_linear(torch.randn(2, 64), q8, sc, 40)
    with pytest.raises(RuntimeError, match="q8 must be contiguous int8"):
        OPS.q8_linear(x, q8.to(torch.uint8), sc, 40)
    with pytest.raises(RuntimeError, match="out_features must fit"):
        OPS.q8_linear(x, q8, sc, 49)
    with pytest.raises(RuntimeError, match="scale must be contiguous fp16"):
        OPS.q8_linear(x, q8, sc.float(), 40)
    with pytest.raises(ValueError, match="fp16 values"):
        pack_q8(scale + 1e-6, codes)
    with pytest.raises(ValueError, match="K divisible by 32"):
        pack_q8(scale, codes[:, :90])


def test_q8_layer_without_kernels_is_pytorchs_float32_matmul():
    scale, codes = _q8_blocks(40, 96, seed=2)
    layer = Q8Linear(*pack_q8(scale, codes), 40)
    x = torch.randn(5, 96)
    w = (codes.float().view(40, -1, 32) * scale[..., None]).view(40, 96)
    assert torch.equal(layer.forward(x), F.linear(x, w))
    layer.kernels = OPS
    assert ((layer.forward(x).double() - x.double() @ w.double().t()).abs() <= _q8_bound(x, w)).all()


@pytest.mark.parametrize("spill", [False, True], ids=["kernel attention", "kernels, attention by SDPA"])
@pytest.mark.parametrize("broken", [False, True])
def test_model_with_kernels_matches_the_model_without(dtype, broken, spill):
    """A prefill chunk (SDPA), verify and decode rows (the kernel) in one pass; or, with the
    other kernels on, every row through SDPA groups (as rows longer than KERNEL_QUERY_LIMIT)."""
    torch.manual_seed(3)
    model = LlamaModel(tiny_config(vocab=64, hidden=64, layers=3)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    model.layers.to(dtype)
    model.embed_tokens.to(dtype)  # the final norm and the head stay float32, as loaded models do
    rows = [([i % 64 for i in range(40)], 0), ([5], 30), ([1, 2, 3], 12), ([9], 7)]  # (new tokens, start)
    slots = [list(range(r * 64 + s, r * 64 + s + len(t))) for r, (t, s) in enumerate(rows)]
    ids = torch.tensor([i for t, _ in rows for i in t])

    def run(ops):
        meta = AttentionMetadata.build(
            [len(t) for t, _ in rows], [s + len(t) for t, s in rows],
            [list(range(s, s + len(t))) for t, s in rows], slots,
            [list(range(r * 64, r * 64 + s + len(t))) for r, (t, s) in enumerate(rows)],
            kernel_queries=0 if ops is None or spill else KERNEL_QUERY_LIMIT)
        assert (meta.kernel is not None and len(meta.groups) == 1) == (ops is not None and not spill)
        kv = model.new_kv_store(4 * 64)
        g = torch.Generator().manual_seed(4)
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))  # the context before each row's new tokens
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        model.kernels = ops
        return model(ids, meta, kv)

    plain = run(None)
    fused = run(BrokenOps() if broken else OPS)
    tol = 1e-4 if dtype is torch.float32 else 0.1
    assert (bool(((fused - plain).abs() <= tol).all())) != broken


def _packed_tiny_model(fmt: str, hidden: int = 64) -> LlamaModel:
    """A tiny bf16 model whose linears are on verispec's packed kernels (int4 or bf16)."""
    torch.manual_seed(5)
    model = LlamaModel(tiny_config(vocab=64, hidden=hidden, layers=3)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    model.layers.to(torch.bfloat16)
    model.embed_tokens.to(torch.bfloat16)
    if fmt == "bf16":
        _pack_bf16_linears(model)
    else:
        for block in model.layers:
            for parent, name in ((block.self_attn, "qkv_proj"), (block.self_attn, "o_proj"),
                                 (block.mlp, "gate_up_proj"), (block.mlp, "down_proj")):
                lin = getattr(parent, name)
                setattr(parent, name, make_int4_linear(quantize_int4(lin.weight.detach().float()), lin.bias,
                                                       torch.bfloat16, 8 if fmt == "int4a8" else 16))
    return model


@pytest.mark.skipif(not (OPS.int4_vector and OPS.bf16_vector), reason="no AVX-512 or AVX2 here: no packed layers")
@pytest.mark.parametrize("fmt,threads", [("int4", 1), ("int4a8", 1), ("bf16", 1), ("int4", 2), ("int4a8", 3),
                                         ("bf16", 2)])
def test_decoder_stack_equals_the_per_layer_path(fmt, threads):
    """Decode and verify rows, every query in the attention kernel: the layers in one C++
    call give the per-layer Python path's logits bit for bit (the K/V it writes too); a
    stack wired wrong (layers in reverse order) is caught. With 2 or 3 threads the stack's
    team splits every linear and the attention (contexts long enough for the attention
    kernel to go parallel) and meets at barriers; the per-layer path forks per kernel."""
    model = _packed_tiny_model(fmt, hidden=256)  # head_dim 64: the vector attention path
    rows = [([5], 230), ([1, 2, 3], 112), ([9], 70), ([4, 8], 200)]  # (new tokens, start)
    slots = [list(range(r * 256 + s, r * 256 + s + len(t))) for r, (t, s) in enumerate(rows)]
    ids = torch.tensor([i for t, _ in rows for i in t])
    model.kernels = OPS

    def run(stack: bool, logits_index=None):
        meta = AttentionMetadata.build(
            [len(t) for t, _ in rows], [s + len(t) for t, s in rows],
            [list(range(s, s + len(t))) for t, s in rows], slots,
            [list(range(r * 256, r * 256 + s + len(t))) for r, (t, s) in enumerate(rows)],
            kernel_queries=KERNEL_QUERY_LIMIT)
        assert meta.kernel is not None and meta.kernel.tokens is None and not meta.groups
        kv = model.new_kv_store(4 * 256)
        g = torch.Generator().manual_seed(4)
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        model.fused_stack = stack
        torch.set_num_threads(threads)
        try:
            return model(ids, meta, kv, logits_index), kv
        finally:
            torch.set_num_threads(1)

    (want, kv_want), (got, kv_got) = run(False), run(True)
    assert model._stack and model._stack.num_layers == 3  # the stack ran
    assert torch.equal(got, want) and torch.equal(kv_got.k, kv_want.k) and torch.equal(kv_got.v, kv_want.v)
    some = torch.tensor([0, 3, 6])  # the logits of some positions only (a short prefill's last token)
    got_some = run(True, some)[0]
    assert torch.equal(got_some, run(False, some)[0])
    assert torch.allclose(got_some, want[some], atol=1e-5)  # (the float32 head's matmul over 3 rows, not 7)
    model.layers = torch.nn.ModuleList(reversed(list(model.layers)))  # a stack wired wrong
    wrong = build_stack(model, OPS)
    model.layers = torch.nn.ModuleList(reversed(list(model.layers)))
    model._stack = wrong
    assert not torch.equal(run(True)[0], want)


@pytest.mark.skipif(not OPS.int4_vector or OPS.isa == "portable", reason="no vector attention kernel here")
@pytest.mark.parametrize("every_row", [True, False], ids=["every row in the kernel", "broken: SDPA past 32 tokens"])
def test_prefill_chunks_of_any_length_run_in_the_stack_and_do_not_depend_on_their_chunking(every_row, monkeypatch):
    """Where the attention kernel has a vector form, a 100-token prompt is prefilled in the
    decoder stack (every query in the kernel: no per-layer path, no SDPA), and its last
    position's logits are bit-identical whether it is prefilled in one chunk or in two (60 +
    40): each query's result depends on its own keys only (and each token's linears on the
    token alone).
    Routed as before (rows past 32 tokens to SDPA) the stack does not run for it."""
    import verispec.engine.runner as runner_module
    from verispec.engine.runner import ModelRunner, RowInput
    if not every_row:
        monkeypatch.setattr(runner_module, "kernel_query_limit", lambda ops, dtype, d: KERNEL_QUERY_LIMIT)
    model = _packed_tiny_model("int4", hidden=256)  # head_dim 64: the vector attention path
    model.kernels = OPS
    calls = []

    class Spy:
        def __init__(self, stack):
            self.stack = stack

        def forward(self, *args, **kwargs):
            calls.append(args[0].shape[0])  # tokens in the pass
            return self.stack.forward(*args, **kwargs)
    model._stack = Spy(decoder_stack(model))
    ids = [int(t) for t in torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(7))]
    table = list(range(8))  # blocks of 16: 128 slots

    def runner():
        return ModelRunner(model, num_slots=256, block_size=16)
    whole = runner().forward([RowInput(ids, 0, table, 99)])[0]
    assert (calls == [100]) == every_row
    r = runner()
    assert r.forward([RowInput(ids[:60], 0, table, 60)])[0].shape[0] == 0
    parts = r.forward([RowInput(ids[60:], 60, table, 39)])
    if every_row:
        assert calls == [100, 60, 40]
        assert torch.equal(parts[0], whole)
    else:
        assert calls == []  # every pass with a row over 32 tokens took the per-layer path
        assert torch.allclose(parts[0], whole, atol=0.05)


@pytest.mark.skipif(not OPS.int4_vector, reason="no AVX-512 or AVX2 here: no packed layers")
def test_decoder_stack_checks_its_arguments_before_running():
    """Bad input to the stack raises naming the problem (before its parallel region, where
    nothing may throw) and leaves the pools untouched."""
    model = _packed_tiny_model("int4")
    stack = build_stack(model, OPS)
    d, hkv = model.cfg.head_dim, model.cfg.num_kv_heads
    pools = [torch.zeros(64, hkv, d, dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(1, 64).bfloat16()
    cos, sin = torch.ones(1, 1, d).bfloat16(), torch.zeros(1, 1, d).bfloat16()
    ctx, rows, lens = torch.arange(5).view(1, 5), torch.zeros(1, dtype=torch.long), torch.tensor([5])

    def forward(slot=4, ctx=ctx, lens=lens, k_pools=pools):
        return stack.forward(x, cos, sin, k_pools, pools, torch.tensor([slot]), ctx, rows, lens, 0.25)

    assert forward().shape == (1, 64)  # the arguments are fine
    pools[0].zero_()
    for bad, message in [(dict(slot=64), "slot out of range"), (dict(ctx=torch.tensor([[0, 1, 2, 3, 99]])),
                                                                "slot out of range"),
                         (dict(lens=torch.tensor([6])), "1..C context slots"),
                         (dict(k_pools=pools[:2]), "one K and one V pool per layer")]:
        with pytest.raises(RuntimeError, match=message):
            forward(**bad)
    assert not pools[0].any()


def test_decoder_stack_is_not_built_for_layers_off_the_packed_kernels():
    """A dense float32 model (nn.Linear layers): the per-layer path runs."""
    model = LlamaModel(tiny_config(vocab=64, hidden=64, layers=2)).eval()
    assert build_stack(model, OPS) is None


class BrokenOps:
    """The kernels with a bug: the fused norm forgets the residual add."""

    def add_rms_norm(self, x, delta, w, eps):
        return x, OPS.add_rms_norm(x, torch.zeros_like(x), w, eps)[1]

    def __getattr__(self, name):
        return getattr(OPS, name)


@pytest.mark.parametrize("broken", [False, True], ids=["ok", "bound ignored"])
def test_refine_head_recomputes_exactly_the_logits_near_each_rows_largest(broken):
    """Against RefinedHead's selection in PyTorch: the same candidates (within 2 bounds of
    each row's largest approximate logit) recomputed as float32 dot products, every other
    logit untouched, the count returned; over max_count it says so (-1). Each row's two
    best tokens are 0.05 apart and the approximation (off by <= 0.1, inside the bound)
    swaps them: broken (the bound taken as 0) refines only the approximate best, and the
    row's true argmax is missed."""
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(1000, 64, generator=g), torch.randn(3, 64, generator=g)
    for r in range(3):  # the row's runner-up moved to 0.05 below its best
        top2 = (x[r] @ weight.t()).topk(2).indices
        weight[top2[1]] += ((x[r] @ weight[top2[0]]) - 0.05 - x[r] @ weight[top2[1]]) * x[r] / x[r].dot(x[r])
    exact = x @ weight.t()
    approx = exact + 0.05 * (2 * torch.rand(exact.shape, generator=g) - 1)
    for r in range(3):
        a, b = exact[r].topk(2).indices
        assert float(exact[r, a] - exact[r, b]) < 0.06
        approx[r, a], approx[r, b] = exact[r, a] - 0.1, exact[r, b] + 0.1
    assert not torch.equal(approx.argmax(-1), exact.argmax(-1))
    coef = 0.0 if broken else 0.1 / float(x.norm(dim=-1).min())    # bound >= 0.1 >= the error
    bound = coef * x.norm(dim=-1) + 1e-3
    want = approx >= (approx.amax(-1) - 2 * bound)[:, None]
    got = approx.clone()
    n = OPS.refine_head(got, x, weight, coef, 1000)
    assert n == int(want.sum()) and bool(((got != approx) <= want).all())
    assert torch.allclose(got[want], exact[want], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~want], approx[~want])
    assert torch.equal(got.argmax(-1), exact.argmax(-1)) != broken
    assert OPS.refine_head(approx.clone(), x, weight, coef, n - 1) == -1
