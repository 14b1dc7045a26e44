"""Weight formats: GGUF Q4 blocks -> int4 groups exactly, the packed kernels compute what the
groups say, the refined LM head keeps float32 greedy choices, int8/int4 models stay close to
the float32 model."""
import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from test_model import run_rows, tiny_hf_model
from verispec.config import EngineConfig
from verispec.model import kernels
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel
from verispec.model.quant import (INT4_GROUP, ApproxHead, Bf16Linear, Int4Groups, Int4Linear, Int8Linear,
                                  Q8Linear, RefinedHead, gguf_q4_tensor, make_int4_linear, make_int8_linear,
                                  pack_bf16, quantize_int4, resolve_weight_format, unpack_int4, unpack_q8)

Q = gguf.GGMLQuantizationType


def _gguf_blocks(w: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.quantize(w.astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_q4_blocks_map_onto_int4_groups_exactly(qtype):
    """Our q * scale + min reproduces gguf's dequantization bit for bit, also after packing
    (fp16 scale and min hold the blocks' values exactly)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 128)).astype(np.float32) * rng.uniform(0.01, 3, size=(48, 1)).astype(np.float32)
    raw = _gguf_blocks(w, qtype)
    groups = gguf_q4_tensor(raw, int(qtype), w.shape)
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15
    want = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    assert np.array_equal(groups.dequantize().numpy(), want)
    layers = {act_bits: make_int4_linear(groups, None, torch.bfloat16, act_bits) for act_bits in (16, 8)}
    for act_bits, layer in layers.items():
        assert layer.act_bits == act_bits
        assert np.array_equal(unpack_int4(layer.q4, layer.scale, layer.min, 48).dequantize().numpy(), want)
    assert torch.equal(layers[16].q4, layers[8].q4)  # one layout for both activation grids
    with pytest.raises(ValueError, match="act_bits must be 8 or 16"):
        make_int4_linear(groups, None, torch.bfloat16, 4)


def test_a_swapped_nibble_order_is_caught():
    """The exactness check above is sensitive: reading weight j+16 from the low nibble fails it."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(16, 64)).astype(np.float32)
    raw = _gguf_blocks(w, Q.Q4_1)
    groups = gguf_q4_tensor(raw, int(Q.Q4_1), w.shape)
    q = groups.q.view(16, 2, 2, 16).flip(2).reshape(16, 64)  # low/high nibbles swapped per block
    broken = Int4Groups(q, groups.scale, groups.min)
    want = gguf.quants.dequantize(raw, Q.Q4_1).reshape(w.shape)
    assert np.abs(broken.dequantize().numpy() - want).max() > 1e-2


def test_int4_kernel_computes_the_groups():
    """Int4Linear(x) == x @ dequantize(groups with bf16 scales).T (bf16 kernel noise only)."""
    torch.manual_seed(0)
    w = torch.randn(40, 96)  # 40 rows: padded to 48 inside, sliced back
    groups = quantize_int4(w)
    layer = make_int4_linear(groups, torch.randn(40), torch.bfloat16)
    x = torch.randn(5, 96)
    want = x @ groups.dequantize().t() + layer.bias.float()
    got = layer(x.bfloat16()).float()
    assert got.shape == (5, 40)
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.02)


def test_int8_kernel_computes_per_row_scales():
    torch.manual_seed(0)
    w = torch.randn(97, 64)
    layer = make_int8_linear(w, None, torch.bfloat16)
    x = torch.randn(3, 64)
    want = x @ (layer.qweight.float() * layer.scales.float()[:, None]).t()
    torch.testing.assert_close(layer(x.bfloat16()).float(), want, atol=0.05 * want.abs().max().item(), rtol=0.02)
    assert (layer.qweight.float() * layer.scales.float()[:, None] - w).abs().max() < 0.02 * w.abs().max()


def test_q8_0_head_is_the_files_blocks_on_the_q8_kernel():
    """A Q8_0 head's one part holds the blocks exactly (its weights ARE d q, and so is the
    float32 head it refines with); without verispec's kernel it is the float32 head."""
    torch.manual_seed(0)
    codes = torch.randint(-128, 128, (40, 64), dtype=torch.int8)
    scale = (torch.rand(40, 2) * 0.01).half().float()  # GGUF block scales are fp16
    head = RefinedHead.q8_0(scale, codes)
    want = (codes.float().view(40, 2, INT4_GROUP) * scale[..., None]).view(40, 64)
    (part,) = head.parts
    assert isinstance(part, Q8Linear) and torch.equal(unpack_q8(part.q8, part.scale, 40), want)
    assert torch.equal(head.weight, want) and head.dtype == torch.float32
    x = torch.randn(3, 64)
    assert torch.equal(head(x), F.linear(x, want)) and math.isinf(head.torch_norm_coef)
    # the bound is the 16-bit activation grid's and float32 accumulation's: ~30x below a bf16 part's
    assert head.norm_coef < 0.05 * RefinedHead.bound_coef(want, want, [want])


def _near_tie_head(vocab: int = 2048, hidden: int = 64, seed: int = 0):
    """A head whose rows come in pairs that differ below int8 / bf16 resolution: near-ties."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(vocab // 2, hidden, generator=g)
    twin = base + 1e-3 * torch.randn(vocab // 2, hidden, generator=g)
    return torch.cat([base, twin])


def _refined_argmax_mismatches(head: RefinedHead, n: int = 400, seed: int = 1) -> int:
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(n, head.in_features, generator=g)
    return int((head(x).argmax(-1) != F.linear(x, head.weight).argmax(-1)).sum())


def _q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks of a weight: d = max |w| / 127 per 32 (an fp16 value), q = round(w / d)."""
    g = weight.float().view(weight.shape[0], -1, INT4_GROUP)
    d = (g.abs().amax(-1) / 127).half().float().clamp_min(2.0 ** -24)
    return d, torch.round(g / d[..., None]).clamp(-128, 127).to(torch.int8).view(weight.shape)


def _refined_head(kind: str, weight: torch.Tensor) -> RefinedHead:
    """int8; or on verispec's kernels: bf16 (the dense bf16 target's head), a GGUF Q8_0 head."""
    if kind == "int8":
        return RefinedHead.int8(weight)
    head = RefinedHead.bf16(weight) if kind == "bf16" else RefinedHead.q8_0(*_q8_0_blocks(weight))
    head.parts[0].kernels = kernels.load(required=True)
    return head


@pytest.mark.parametrize("kind", ["int8", "bf16", "q8_0"])
def test_refined_head_greedy_equals_float32_head(kind):
    weight = _near_tie_head()
    head = _refined_head(kind, weight)
    assert _refined_argmax_mismatches(head) == 0
    if kind == "bf16" and not head.parts[0].kernels.bf16_vector:
        # no vector bf16 kernel on this CPU (kernels.cpp, kBf16Vector): no bound, the float32 head
        assert head.last_num_refined == 0
        return
    assert 0 < head.last_num_refined < 400 * weight.shape[0] // 8  # refined some, not everything


@pytest.mark.parametrize("kind", ["int8", "bf16", "q8_0"])
def test_refined_head_error_bound_holds(kind):
    """The proven bound covers the real approximation error (the argmax guarantee rests on it)."""
    weight = _near_tie_head(seed=2)
    head = _refined_head(kind, weight)
    x = 3 * torch.randn(200, weight.shape[1])
    approx = head.parts[0](x.to(head.dtype)).float()
    exact = F.linear(x, head.weight)
    bound = head.norm_coef * x.norm(dim=-1)
    assert ((approx - exact).abs().amax(-1) <= bound).all()


@pytest.mark.skipif(not kernels.load(required=True).q8_vector, reason="no AVX-512 or AVX2 here: no Q8_0 kernel")
def test_q8_0_head_bound_covers_cancelling_float32_sums():
    """Chains that carry a large partial sum and cancel: the kernel's and vecdot's float32
    roundings add up to several units of 2^-24 |w| |x|, which a bound of one rounding misses
    and q8_0_coef covers (the refined argmax rests on it)."""
    k = 576
    codes = torch.full((64, k), 127, dtype=torch.int8)
    codes[:, 1::2] = -127                                   # even and odd chains cancel
    codes[:, 0] = torch.arange(64, dtype=torch.int8)        # rows apart by one code
    scale = torch.full((64, k // INT4_GROUP), 0.01).half().float()
    head = RefinedHead.q8_0(scale, codes)
    head.parts[0].kernels = kernels.load(required=True)
    g = torch.Generator().manual_seed(5)
    x = 1 + 1e-3 * torch.randn(50, k, generator=g)
    exact = x.double() @ head.weight.double().t()
    approx = head.parts[0](x).double()
    vecdot = torch.linalg.vecdot(head.weight[None], x[:, None]).double()   # (50, 64), as refined
    error = ((approx - exact).abs() + (vecdot - exact).abs()).amax(-1)
    norms = x.double().norm(dim=-1)
    one_rounding = 2.0 ** -24 * float(head.weight.norm(dim=1).max()) * norms
    assert (error <= head.norm_coef * norms).all()
    assert (error > one_rounding).any()


def test_bf16_head_without_the_kernel_is_the_float32_head():
    """PyTorch's bf16 matmul has no bound proven for it: the float32 head is computed, and
    the approximation is not (it was once computed and thrown away, with an unpacked copy)."""
    weight = _near_tie_head()
    head = RefinedHead.bf16(weight)
    x = 3 * torch.randn(7, weight.shape[1])
    assert torch.equal(head(x), F.linear(x, weight))
    assert head.parts[0]._torch_weight is None


def test_refined_head_bound_covers_worst_case_bf16_roundings():
    """x = 1 + 2^-8 rounds to bf16 1 (relative error 2^-8, bf16's unit roundoff) and the sum
    514 to 512 (2^-8 again): an error of 4.0 that a bound built on 2^-9 (3.0) missed."""
    k = 514
    weight = torch.ones(3, k)
    coef = RefinedHead.bound_coef(weight, weight, [weight])
    head = RefinedHead(weight, [Bf16Linear(pack_bf16(weight), 3, k, None)], coef)
    x = torch.full((1, k), 1 + 2 ** -8)
    error = (head.parts[0](x.bfloat16()).float() - F.linear(x, weight)).abs().amax()
    assert error >= 4.0 and error <= head.norm_coef * x.norm()


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_a_refined_head_without_its_bound_is_caught(kind):
    """Refining only the approximate argmax (bound 0) changes greedy choices: the test above bites."""
    weight = _near_tie_head()
    head = _refined_head(kind, weight)
    head.norm_coef = 0.0
    forward = head.forward

    def no_output_bound(x):
        # also drop the output-rounding term: refine exactly the approximate maximum
        xb = x.to(head.dtype)
        a = head.parts[0](xb).float()
        keep = a >= a.amax(-1, keepdim=True)
        out = a.clone()
        rows, cols = keep.nonzero(as_tuple=True)
        out[rows, cols] = (weight[cols] * x[rows]).sum(-1)
        return out

    head.forward = no_output_bound
    assert _refined_argmax_mismatches(head) > 0
    head.forward = forward


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_tiny_model_logits_close_to_float32(fmt):
    hf = tiny_hf_model("qwen2")  # q/k/v bias: biases go through the quantized layers too
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    ref = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.float32)
    ours = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.bfloat16, weight_format=fmt)
    assert ours.weight_format == fmt and type(ours.lm_head) is RefinedHead
    rows = [list(range(3, 40)), list(range(50, 61))]
    for chunk in (None, [1, 3]):
        for got, want in zip(run_rows(ours, rows, chunk), run_rows(ref, rows, chunk)):
            scale = want.abs().max().item()
            tol = 0.05 if fmt == "int8" else 0.25  # int4 round-to-nearest of random weights
            assert (got - want).abs().max().item() < tol * scale


def test_dense_bf16_model_packs_its_linears_and_kernels_stay_close():
    """Dense bf16 on the CPU: every body linear a Bf16Linear, the head a RefinedHead over
    its bf16 copy (a draft keeps the float32 head); verispec's bf16 kernel and PyTorch's
    matmul differ only by bf16 rounding, both near float32."""
    hf = tiny_hf_model("qwen2")  # q/k/v bias
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    ref = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.float32)
    ours = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.bfloat16, weight_format="dense")
    assert {type(m) for n, m in ours.named_modules() if n.endswith("_proj")} == {Bf16Linear}
    assert type(ours.lm_head) is RefinedHead and ours.lm_head.weight.dtype == torch.float32
    draft = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.bfloat16, weight_format="dense", draft=True)
    assert type(draft.lm_head) is torch.nn.Linear
    rows = [list(range(3, 40)), list(range(50, 61))]
    off = run_rows(ours, rows, None)
    ours.kernels = kernels.load(required=True)
    assert ours.layers[0].mlp.down_proj.kernels is ours.kernels
    for got, torch_ops, want in zip(run_rows(ours, rows, None), off, run_rows(ref, rows, None)):
        scale = want.abs().max().item()
        assert (got - torch_ops).abs().max().item() < 0.05 * scale
        assert (got - want).abs().max().item() < 0.05 * scale


def test_a_draft_model_defaults_to_int8_with_an_unrefined_head():
    """A draft's "auto" (not a Q4 GGUF) is int8 in bf16 and its head an ApproxHead: float32
    logits from one int8 layer, no refinement, with the float32 model's argmax."""
    hf = tiny_hf_model("llama")
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    ref = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.float32)
    draft = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.bfloat16, weight_format="auto", draft=True)
    assert draft.weight_format == "int8" and type(draft.lm_head) is ApproxHead
    assert isinstance(draft.lm_head.layer, Int8Linear)
    rows = [list(range(3, 40))]
    for got, want in zip(run_rows(draft, rows, None), run_rows(ref, rows, None)):
        assert got.dtype == torch.float32 and (got - want).abs().max().item() < 0.05 * want.abs().max().item()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    int4 = LlamaModel.from_state_dict(cfg, hf.state_dict(), dtype=torch.bfloat16, weight_format="int4", draft=True)
    assert type(int4.lm_head) is ApproxHead and isinstance(int4.lm_head.layer, Int4Linear)
    assert resolve_weight_format("auto", torch.float32, None, draft=True) == "dense"
    assert resolve_weight_format("auto", torch.bfloat16, None, draft=False) == "dense"
    with pytest.raises(ValueError, match="draft_weight_format 'int4' needs dtype bfloat16"):
        EngineConfig(draft_weight_format="int4", dtype="float32")


def test_weight_format_is_validated():
    with pytest.raises(ValueError, match="weight_format"):
        EngineConfig(weight_format="int3")
    with pytest.raises(ValueError, match="weight_format 'int4' needs dtype bfloat16"):
        EngineConfig(weight_format="int4", dtype="float32")
    with pytest.raises(ValueError, match="weight_format"):
        resolve_weight_format("fp8", torch.bfloat16, None)
    assert resolve_weight_format("auto", torch.bfloat16, None) == "dense"
    assert resolve_weight_format("auto", torch.float32, None) == "dense"


# --- the default model (GGUF Q4_1 body, Q8_0 head) ---------------------------------------------

@pytest.fixture(scope="module")
def default_model():
    from verispec.model.loader import load_model_files, resolve_model
    source = resolve_model("smollm2-135m-instruct")  # installed by the setup: missing is a failure
    cfg, state, tokenizer = load_model_files(source)
    return source, cfg, state, tokenizer


def test_default_gguf_int4_groups_equal_its_float32_weights(default_model):
    """Every Q4_1 tensor of the default GGUF, decoded as int4 groups (float32 scales), equals the
    float32 conversion the dense path loads (Q/K un-permuted alike)."""
    from verispec.model.quant import gguf_int4_groups, gguf_q8_0_head
    source, cfg, state, _ = default_model
    groups, others = gguf_int4_groups(source.path)
    assert not others and len(groups) == 7 * cfg.num_layers
    for name, grp in groups.items():
        assert torch.equal(grp.dequantize(), state[name]), name
    scale, codes = gguf_q8_0_head(source.path)
    head = (codes.float().view(*scale.shape, 32) * scale[..., None]).view(codes.shape)
    assert torch.equal(head, state["model.embed_tokens.weight"])
    assert resolve_weight_format("auto", torch.bfloat16, source.path) == "int4"


@pytest.mark.parametrize("own_kernel", [True, False], ids=["verispec int4 kernel", "PyTorch int4 kernel"])
def test_default_model_int4_logits_near_float32(default_model, own_kernel):
    """int4 (the file's own Q4_1 codes) stays as close to the float32 model as a bf16 copy
    does, on either int4 kernel: mean KL on one prompt of the order of bf16's own (~1e-3),
    argmax kept. (bench/weight_quality.py measures this on 20 prompts; a broken mapping
    scores KL >> 0.1.)"""
    from verispec.engine.runner import ModelRunner, RowInput
    source, cfg, state, tokenizer = default_model
    ids = tokenizer.encode_chat([{"role": "user", "content": "Explain in a few sentences why the sky is blue."}])

    def logits(model):
        blocks = -(-len(ids) // 16)
        return ModelRunner(model, blocks * 16, 16).forward([RowInput(ids, 0, list(range(blocks)), 0)])[0]

    ref = torch.log_softmax(logits(LlamaModel.from_state_dict(cfg, state, dtype=torch.float32)), -1)
    int4 = LlamaModel.from_state_dict(cfg, state, dtype=torch.bfloat16, weight_format="int4", gguf_path=source.path)
    int4.kernels = kernels.load(required=True) if own_kernel else None
    got = torch.log_softmax(logits(int4), -1)
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert kl < 0.01
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("own_kernel", [True, False], ids=["verispec Q8_0 kernel", "no kernels"])
def test_default_q8_0_head_error_bound_holds(default_model, own_kernel):
    """The default GGUF's Q8_0 head on verispec's kernel: its real error stays inside the
    proven bound, greedy is the float32 head's, and a row refines a handful of tokens (the
    bf16 parts' bound refined hundreds). Without the kernel: the float32 head itself."""
    from verispec.model.quant import gguf_q8_0_head
    source, _, state, _ = default_model
    head = RefinedHead.q8_0(*gguf_q8_0_head(source.path))
    assert torch.equal(head.weight, state["model.embed_tokens.weight"])
    g = torch.Generator().manual_seed(0)
    x = 2 * torch.randn(6, head.in_features, generator=g)  # ||x|| ~ 48, like the final norm's output
    if not own_kernel:
        assert torch.equal(head(x), F.linear(x, head.weight))
        return
    ops = kernels.load(required=True)
    if not ops.q8_vector:
        pytest.skip("no AVX-512 or AVX2 here: the head is the float32 head")
    head.parts[0].kernels = ops
    error = (head.parts[0](x).double() - x.double() @ head.weight.double().t()).abs().amax(-1)
    assert (error <= head.norm_coef * x.double().norm(dim=-1)).all()
    assert (head(x).argmax(-1) == F.linear(x, head.weight).argmax(-1)).all()
    assert head.last_num_refined <= 8 * x.shape[0]
