"""Weight formats of the linear layers: dense, int8 and int4 weight-only.

A model's format is chosen ONCE, at load time, and every pass of that model uses it: the
target's distribution is a property of its weights, so plain and verify passes of one
request must read the same ones (choosing a kernel per pass width would change the output).

    dense  weights in the model dtype (bf16 or float32); the LM head in float32. bf16 linear
           layers on the CPU are `Bf16Linear`s: verispec's kernel (kernels.bf16_linear,
           2.1x PyTorch's bf16 matmul on the default model's layers at batch 1), else
           PyTorch's matmul; a bf16 target's head there is a `RefinedHead` over the head
           rounded to bf16 (greedy exactly the float32 head's, half its bytes a step)
    int8   w[n, k] = s[n] * q[n, k], q in [-127, 127]        torch._weight_int8pack_mm
    int4   groups of 32 along k, w = q * scale + min, q in [0, 15], scale and min fp16
                                  verispec's kernel (kernels.int4_linear), else
                                  torch._weight_int4pack_mm_for_cpu
    int4a8 the same weights, the kernel's activations on an 8-bit grid per group of 32
           (GGUF's Q8_0 activations, llama.cpp's arithmetic for Q4 weights): ~1.25x faster
           a step on an AVX2 CPU, KL to the float32 model ~5x int4's (docs/benchmarks.md);
           verispec's kernels only (no fallback), opt-in: `auto` never picks it
    auto   int4 for a GGUF whose linear weights are all Q4_0 / Q4_1 (the mapping below is
           exact, so it is the file's own weights), else dense

GGUF Q4 blocks (32 weights, an fp16 scale d and, for Q4_1, an fp16 minimum m) ARE int4
groups of 32, with fp16 scale and min exactly:

    Q4_1: w = d * q + m        ->  scale = d, min = m
    Q4_0: w = d * (q - 8)      ->  scale = d, min = -8 d

verispec's int4 kernel (AVX-512, 1.3-2.3x PyTorch's int4 kernel on this project's layers)
reads these fp16 values as they are. Without it (kernels off, or a CPU without AVX-512)
the layer packs its weights for PyTorch's kernel on first use, which wants scales and zero
points in bf16 (w = (q - 8) * scale + zero): rounded there (relative error <= 2^-8, below
the 4-bit step itself). Both kernels take bf16 activations; verispec's rounds them per
group of 32 onto a 16-bit integer grid (2^-14 of the group's largest |x|) for exact
integer dot products (see kernels.cpp).

The LM head of a quantized model (`RefinedHead`) computes approximate logits with packed
kernels (a GGUF Q8_0 head: its own blocks on verispec's Q8_0 kernel, float32 in and out;
any other head: int8; a dense bf16 target's head: its bf16 rounding on the bf16 kernel),
then recomputes in float32 every token that could be the argmax given a proven bound on the
approximation error: greedy decoding is exactly the float32 head's, and the other logits
differ from it by about the approximation's rounding (measured in docs/benchmarks.md).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("verispec")

WEIGHT_FORMATS = ("auto", "dense", "int8", "int4", "int4a8")
INT4_FORMATS = {"int4": 16, "int4a8": 8}  # int4 format -> the kernel's activation grid (bits)
INT4_GROUP = 32
# ggml block types whose blocks are int4 groups of 32 (gguf.GGMLQuantizationType values)
_GGML_Q4_0, _GGML_Q4_1, _GGML_Q8_0 = 2, 3, 8


# --- linear layers ---------------------------------------------------------------------------

class Int8Linear(nn.Module):
    """y = x @ (s[:, None] * q).T + b with int8 q (N, K) and per-row scales s (N,)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)    # (N,) activation dtype
        self.register_buffer("bias", bias)        # (N,) or None
        self.out_features, self.in_features = qweight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x, self.qweight, self.scales)  # (T, N)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W in int4 groups of 32 along K (see `pack_int4` for the layout).

    `kernels`: verispec's compiled kernels (set through `LlamaModel.kernels`); without them,
    or on a CPU without a vector path for them, PyTorch's int4 kernel runs on a copy packed
    on first use. `act_bits` 8 (weight format "int4a8"): the kernel rounds activations onto
    its 8-bit grid, which only verispec's kernels compute (no kernels: an error).
    """

    def __init__(self, q4: torch.Tensor, scale: torch.Tensor, min: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None, act_bits: int = 16):
        super().__init__()
        _check_act_bits(act_bits)
        self.act_bits = act_bits
        self.register_buffer("q4", q4)        # (N_pad / 16, K / 2, 16) uint8
        self.register_buffer("scale", scale)  # (N_pad / 16, K / 32, 16) fp16
        self.register_buffer("min", min)      # (N_pad / 16, K / 32, 16) fp16
        self.register_buffer("bias", bias)    # (N,) activation dtype, or None
        self.out_features, self.in_features = out_features, 2 * q4.shape[1]
        self.kernels = None
        self._torch_packed = None             # (packed, scales_zeros) for PyTorch's kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the kernels take (T, K): batched inputs (training, scoring) flattened
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        ops = self.kernels
        if self.act_bits == 8:
            if ops is None:
                raise RuntimeError("weight format 'int4a8' (int4 on the 8-bit activation grid) runs on "
                                   "verispec's kernels only, and they are off")
            return ops.int4_linear(x.contiguous(), self.q4, self.scale, self.min, self.out_features, self.bias,
                                   act_bits=8)
        if ops is not None and ops.int4_vector:
            return ops.int4_linear(x.contiguous(), self.q4, self.scale, self.min, self.out_features, self.bias)
        if self._torch_packed is None:
            self._torch_packed = torch_int4_pack(unpack_int4(self.q4, self.scale, self.min, self.out_features), x.dtype)
        packed, scales_zeros = self._torch_packed
        y = torch._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_zeros)  # (T, N_pad)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        return y if self.bias is None else y + self.bias


class Bf16Linear(nn.Module):
    """y = x @ W.T + b with W bf16 in verispec's kernel layout (see `pack_bf16`).

    `kernels`: verispec's compiled kernels (set through `LlamaModel.kernels`); without them,
    or on a CPU without AVX-512, PyTorch's matmul runs on a copy unpacked on first use.
    """

    def __init__(self, w16: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("w16", w16)    # (N_pad / 16, ceil(K / 2), 32) bf16
        self.register_buffer("bias", bias)  # (N,) bf16, or None
        self.out_features, self.in_features = out_features, in_features
        self.kernels = None
        self._torch_weight = None           # (N, K) for PyTorch's matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the kernels take (T, K): batched inputs (training, scoring) flattened
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        ops = self.kernels
        if ops is not None and ops.bf16_vector:
            return ops.bf16_linear(x.contiguous(), self.w16, self.out_features, self.bias)
        if self._torch_weight is None:
            self._torch_weight = unpack_bf16(self.w16, self.out_features, self.in_features)
        return F.linear(x, self._torch_weight, self.bias)


class Q8Linear(nn.Module):
    """y = x @ W.T with W as GGUF Q8_0 blocks (see `pack_q8`), float32 in and out: the
    approximate part of a Q8_0 LM head (`RefinedHead.q8_0`).

    `kernels`: verispec's compiled kernels (set through `LlamaModel.kernels`); without them
    PyTorch's float32 matmul runs on a copy dequantized on first use.
    """

    def __init__(self, q8: torch.Tensor, scale: torch.Tensor, out_features: int):
        super().__init__()
        self.register_buffer("q8", q8)        # (N_pad / 16, K, 16) int8
        self.register_buffer("scale", scale)  # (N_pad / 16, K / 32, 16) fp16
        self.out_features, self.in_features = out_features, q8.shape[1]
        self.kernels = None
        self._torch_weight = None             # (N, K) float32 for PyTorch's matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.kernels
        if ops is not None and ops.q8_vector:
            return ops.q8_linear(x.float().contiguous(), self.q8, self.scale, self.out_features)
        if self._torch_weight is None:
            self._torch_weight = unpack_q8(self.q8, self.scale, self.out_features)
        return F.linear(x.float(), self._torch_weight)


def pack_q8(scale: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (scale (N, K / 32) fp16 values, codes (N, K) int8) -> (q8, scale) in the
    kernel's layout (kernels.cpp), rows padded to 16:

        q8[b, k, j] = q[16 b + j, k]                     (N_pad / 16, K, 16) int8
        scale[b, g, j] = d of row 16 b + j, group g      (N_pad / 16, K / 32, 16) fp16"""
    n, k = codes.shape
    if k % INT4_GROUP or tuple(scale.shape) != (n, k // INT4_GROUP):
        raise ValueError(f"Q8_0 needs codes (N, K) with K divisible by {INT4_GROUP} and scales (N, K / "
                         f"{INT4_GROUP}), got {tuple(codes.shape)} and {tuple(scale.shape)}")
    if not torch.equal(scale.half().float(), scale.float()):
        raise ValueError("Q8_0 scales must be fp16 values (a GGUF block's d)")
    pad = -n % 16
    q, d = F.pad(codes, (0, 0, 0, pad)), F.pad(scale.float(), (0, 0, 0, pad))
    nb = (n + pad) // 16
    q8 = q.view(nb, 16, k).permute(0, 2, 1).contiguous()                   # (nb, K, 16)
    return q8, d.view(nb, 16, -1).permute(0, 2, 1).half().contiguous()     # (nb, K/32, 16)


def unpack_q8(q8: torch.Tensor, scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weights `pack_q8`'s output stands for: (N, K) float32, d * q (exact in float32)."""
    nb, k, _ = q8.shape
    return dequantize_q8_0(scale.permute(0, 2, 1).reshape(nb * 16, -1)[:out_features],
                           q8.permute(0, 2, 1).reshape(nb * 16, k)[:out_features])


def dequantize_q8_0(scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (scale (N, K / 32), codes (N, K) int8) -> w = d * q, (N, K) float32."""
    n, k = codes.shape
    return (codes.float().view(n, -1, INT4_GROUP) * scale.float()[..., None]).view(n, k)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> w16 in the kernel's layout (kernels.cpp), rows padded to 16, K to even:

        w16[b, c, 2 j + e] = w[16 b + j, 2 c + e]      (N_pad / 16, K_pad / 2, 32) bf16"""
    n, k = weight.shape
    w = F.pad(weight.to(torch.bfloat16), (0, k % 2, 0, -n % 16))              # (N_pad, K_pad)
    return w.view(-1, 16, w.shape[1] // 2, 2).permute(0, 2, 1, 3).reshape(w.shape[0] // 16, -1, 32).contiguous()


def unpack_bf16(w16: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of `pack_bf16` (padding dropped): (N, K) bf16."""
    nb, pairs, _ = w16.shape
    w = w16.view(nb, pairs, 16, 2).permute(0, 2, 1, 3).reshape(nb * 16, 2 * pairs)
    return w[:out_features, :in_features].contiguous()


def make_bf16_linear(linear: nn.Linear) -> Bf16Linear:
    bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
    return Bf16Linear(pack_bf16(linear.weight.detach()), linear.out_features, linear.in_features, bias)


@dataclass
class Int4Groups:
    """Int4 weights before packing: w = q * scale + min per group of 32 along K."""

    q: torch.Tensor      # (N, K) uint8 in [0, 15]
    scale: torch.Tensor  # (N, K / 32) float32 (fp16 values: `make_int4_linear` stores them so)
    min: torch.Tensor    # (N, K / 32) float32 (fp16 values)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, the weights these groups stand for."""
        n, k = self.q.shape
        w = self.q.float().view(n, k // INT4_GROUP, INT4_GROUP)
        return (w * self.scale[..., None] + self.min[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        """Stack along N (fusing q/k/v or gate/up keeps every group intact)."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "min")))


def pack_int4(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4 groups -> (q4, scale, min) in the kernel's lane layout (kernels.cpp), rows padded
    to 16 (one layout for both activation grids):

        q4 (N_pad / 16, K / 2, 16) uint8, as (N_pad / 16, K / 8, 16, 4):
            q4[b, c, j, i] = q[16 b + j, 8 c + i] | q[16 b + j, 8 c + 4 + i] << 4
        scale[b, g, j], min[b, g, j] of row 16 b + j, group g          (N_pad / 16, K / 32, 16) fp16

    so a 32-bit lane is one row's 8 codes. Scales and mins are rounded to fp16 (exact for
    GGUF blocks, whose values are fp16)."""
    n, k = groups.q.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
    for name in ("scale", "min"):
        if not torch.isfinite(getattr(groups, name).half()).all():
            raise ValueError(f"int4 {name}s out of the fp16 range (|value| > 65504)")
    pad = -n % 16
    q, scale, mn = groups.q, groups.scale, groups.min
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale, mn = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, mn))
    nb = (n + pad) // 16
    lanes = q.view(nb, 16, k // 8, 2, 4)                                    # (nb, 16, K/8, lo|hi, 4)
    q4 = (lanes[:, :, :, 0] | (lanes[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(nb, k // 2, 16)
    scale, mn = (t.view(nb, 16, -1).permute(0, 2, 1).half().contiguous() for t in (scale, mn))
    return q4, scale, mn


def _check_act_bits(act_bits: int) -> None:
    if act_bits not in (8, 16):
        raise ValueError(f"int4 act_bits must be 8 or 16, got {act_bits!r}")


def unpack_int4(q4: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, out_features: int) -> Int4Groups:
    """The inverse of `pack_int4` (padding rows dropped)."""
    nb, half_k, _ = q4.shape
    lanes = q4.view(nb, half_k // 4, 16, 4)
    q = torch.stack([lanes & 15, lanes >> 4], dim=3)                        # (nb, K/8, 16, 2, 4)
    q = q.permute(0, 2, 1, 3, 4).reshape(nb * 16, 2 * half_k)[:out_features]
    scale, mn = (t.permute(0, 2, 1).reshape(nb * 16, -1)[:out_features].float() for t in (scale, mn))
    return Int4Groups(q.contiguous(), scale.contiguous(), mn.contiguous())


def _torch_scale_zero(groups: Int4Groups, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) (N, K / 32) float32 as PyTorch's int4 kernel holds them: its convention
    w = (q - 8) * scale + zero, both rounded to `dtype`."""
    return groups.scale.to(dtype).float(), (groups.min + 8 * groups.scale).to(dtype).float()


def torch_int4_pack(groups: Int4Groups, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales_zeros) for torch._weight_int4pack_mm_for_cpu (see `_torch_scale_zero`);
    rows padded to a multiple of 16."""
    n, k = groups.q.shape
    pad = -n % 16
    q, (scale, zero) = groups.q, _torch_scale_zero(groups, dtype)
    if pad:
        q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype)])
        scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, zero))
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    return packed, torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # (G, N_pad, 2)


def quantize_int8(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of w (N, K): (q int8 (N, K), scales (N,) in `dtype`)."""
    w = w.float()
    amax = w.abs().amax(dim=1).clamp_min(1e-30)                          # (N,)
    scales = (amax / 127).to(dtype)
    # A scale rounded down to bf16 may clip the row's largest weight by a fraction of a step.
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor) -> Int4Groups:
    """Round-to-nearest asymmetric int4 in groups of 32 along K (the fallback for non-GGUF
    weights), scale and min rounded to fp16 first (what the kernel stores)."""
    n, k = w.shape
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)                              # (N, G)
    scale = ((hi - lo) / 15).half().float().clamp_min(2.0 ** -24)         # >= the smallest fp16
    mn = lo.half().float()
    q = torch.round((g - mn[..., None]) / scale[..., None]).clamp_(0, 15)
    return Int4Groups(q.to(torch.uint8).view(n, k), scale, mn)


def make_int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Int8Linear:
    q, scales = quantize_int8(weight, dtype)
    return Int8Linear(q, scales, None if bias is None else bias.to(dtype))


def make_int4_linear(groups: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype,
                     act_bits: int = 16) -> Int4Linear:
    return Int4Linear(*pack_int4(groups), groups.q.shape[0], None if bias is None else bias.to(dtype),
                      act_bits)


def quantize_model(model: nn.Module, weights: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype,
                   int4_groups: dict[str, Int4Groups] | None = None, head: nn.Module | None = None) -> None:
    """Replace the linear layers named in `weights` (fused names, float32) by `fmt` modules.

    `lm_head.weight` becomes `head`, or else an int8 `RefinedHead`. For int4, `int4_groups`
    (from a GGUF's Q4 blocks) are used as they are; other weights are quantized
    round-to-nearest.
    """
    if fmt != "int8" and fmt not in INT4_FORMATS:
        raise ValueError(f"quantize_model: fmt must be 'int8', 'int4' or 'int4a8', got {fmt!r}")
    int4_groups = int4_groups or {}
    for name, w in weights.items():
        if name == "lm_head.weight":
            model.lm_head = head if head is not None else RefinedHead.int8(w, dtype)
            continue
        parent_name, attr = name.rsplit(".", 1)[0].rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        bias = getattr(parent, attr).bias
        if fmt == "int8":
            layer = make_int8_linear(w, bias, dtype)
        else:
            groups = int4_groups.get(name)
            if groups is not None and tuple(groups.q.shape) != tuple(w.shape):
                raise ValueError(f"{name}: GGUF int4 groups are {tuple(groups.q.shape)}, weight is {tuple(w.shape)}")
            layer = make_int4_linear(groups if groups is not None else quantize_int4(w), bias, dtype,
                                     INT4_FORMATS[fmt])
        setattr(parent, attr, layer)


class ApproxHead(nn.Module):
    """A draft model's LM head: one quantized layer, float32 in and out, no refinement.

    A draft's logits need not be the float32 head's: whatever q the draft samples from is
    the q the verifier is handed, which keeps the output exact; only acceptance moves.
    """

    def __init__(self, layer: nn.Module, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.layer, self.dtype = layer, dtype
        self.out_features, self.in_features = layer.out_features, layer.in_features

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16) -> "ApproxHead":
        layer = make_int8_linear(weight, None, dtype) if fmt == "int8" else \
            make_int4_linear(quantize_int4(weight), None, dtype, INT4_FORMATS[fmt])
        return cls(layer, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.forward(x.to(self.dtype)).float()


# --- the refined LM head (quantized and dense bf16 targets) ------------------------------------

class RefinedHead(nn.Module):
    """Approximate logits from packed kernels, recomputed in float32 where the argmax could be.

    Let a = approximate logits (the sum of `parts`: bf16 in and out, or for a Q8_0 head one
    part in float32, see `q8_0_coef`), y = x @ W.T the float32 head, and B a bound with
    |a - y| <= B for every token of a row. The exact
    argmax t* satisfies a[t*] >= y[t*] - B >= y[argmax a] - B >= max(a) - 2B, so every
    token with a >= max(a) - 2B is recomputed in float32: greedy decoding is the float32
    head's. Other logits keep the approximation (their error is measured in
    docs/benchmarks.md). B adds worst cases, not estimates (W_a: the parts' weights):

      x, and W_a inside the kernel, rounded to bf16:   2 * 2^-8 * ||x|| * max_v ||W_a[v]||
      float32 accumulation over K terms:               K * 2^-24 * ||x|| * max_v ||W_a[v]||
      W_a != W (int8 re-quantization, bf16 scales):    ||x|| * max_v ||W[v] - W_a[v]||   (Cauchy-Schwarz)
      each part's output rounded to bf16:              2^-8 * ||x|| * max_v ||W_part[v]||, per part
    2^-8 is bf16's unit roundoff (8 significant bits, round to nearest: |fl(v) - v| <= 2^-8 |v|);
    the sum is scaled by 1 + 2^-7 for the products of these terms (second order).
    All are ||x|| times a constant of the weights, so the bound costs one norm per row and
    no pass over the logits (a looser output term only adds a few refined tokens).
    """

    max_refined_fraction = 0.125  # with more candidates than this, the whole row is recomputed

    def __init__(self, weight: torch.Tensor, parts: list[nn.Module], norm_coef: float,
                 dtype: torch.dtype = torch.bfloat16, torch_norm_coef: float | None = None):
        """`norm_coef`: B / ||x|| (see `bound_coef`); the constructors below compute it.
        `torch_norm_coef`: the bound of int4 parts on PyTorch's kernel (other scales)."""
        super().__init__()
        self.register_buffer("weight", weight.float())   # (V, K) float32
        self.parts = nn.ModuleList(parts)
        self.norm_coef = float(norm_coef)
        self.torch_norm_coef = float(norm_coef if torch_norm_coef is None else torch_norm_coef)
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape
        self.last_num_refined = 0  # logits recomputed by the latest call (for benchmarks)

    @staticmethod
    def bound_coef(weight: torch.Tensor, approx_weight: torch.Tensor, part_weights: list[torch.Tensor]) -> float:
        """The class docstring's bound B divided by ||x||: a constant of the weights."""
        k = weight.shape[1]
        w_norm = float(approx_weight.norm(dim=1).max())
        return (1 + 2.0 ** -7) * ((2 * 2.0 ** -8 + k * 2.0 ** -24) * w_norm +
                                  float((weight.float() - approx_weight).norm(dim=1).max()) +
                                  2.0 ** -8 * sum(float(w.norm(dim=1).max()) for w in part_weights))

    @classmethod
    def int8(cls, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> "RefinedHead":
        """Approximation: per-row int8 (any head)."""
        q, scales = quantize_int8(weight, dtype)
        approx = q.float() * scales.float()[:, None]
        return cls(weight, [Int8Linear(q, scales, None)], cls.bound_coef(weight, approx, [approx]), dtype)

    @classmethod
    def q8_0(cls, scale: torch.Tensor, codes: torch.Tensor) -> "RefinedHead":
        """A GGUF Q8_0 head (w = d * q per block of 32) on verispec's Q8_0 kernel, float32 in
        and out: the part's weights ARE the file's and nothing is rounded to bf16, so the
        bound is the activations' 16-bit grid and float32 accumulation (`q8_0_coef`), ~30x
        tighter than a bf16 part's, and a row refines tens of tokens, not hundreds. Without
        the kernel the bound is infinite: the float32 head itself.
        scale: (V, K / 32) float32 block scales (fp16 values); codes: (V, K) int8.
        """
        weight = dequantize_q8_0(scale, codes)
        part = Q8Linear(*pack_q8(scale, codes), codes.shape[0])
        return cls(weight, [part], cls.q8_0_coef(weight), torch.float32, torch_norm_coef=math.inf)

    @staticmethod
    def q8_0_coef(weight: torch.Tensor) -> float:
        """B / ||x|| for a Q8_0 part on verispec's kernel, against the float32 head's vecdot.

        The kernel rounds each group of 32 activations onto a 16-bit grid (kernels.cpp):
        |x_k - m_k p_g| <= p_g / 2 <= 2^-14 max_g |x|, so the rounded x differs from x by
        a vector delta with ||delta||^2 <= 32 * 2^-28 * sum_g max_g^2 <= 2^-23 ||x||^2,
        and |w . delta| <= 2^-11.5 ||w|| ||x|| (Cauchy-Schwarz). Then each group's integer
        dot product is exact, its conversion to float32 one rounding, and the G fused
        multiply-adds accumulating d p a are G more: with u = 2^-24 and gamma_n =
        n u / (1 - n u), at most gamma_(G + 1) sum_k |w_k x'_k| <= gamma_(G + 1) ||w||
        (1 + 2^-11.5) ||x|| (d p is exact: an fp16 value times a power of two). The
        refinement's vecdot sums K products in some order: gamma_K ||w|| ||x||. So
        B = (2^-11.5 + (1 + 2^-11.5) gamma_(G + 1) + gamma_K) max_v ||W[v]|| ||x||; the
        factor 1 + 2^-7 covers gamma's denominator and ||x|| computed in float32.
        """
        k = weight.shape[1]
        grid = 2.0 ** -11.5
        accumulate = (1 + grid) * (k // INT4_GROUP + 1) + k
        return (1 + 2.0 ** -7) * (grid + accumulate * 2.0 ** -24) * float(weight.norm(dim=1).max())

    @classmethod
    def bf16(cls, weight: torch.Tensor) -> "RefinedHead":
        """Approximation: the head rounded to bf16, on verispec's bf16 kernel (a dense bf16
        model's head: half the float32 head's bytes a step). Without the kernel the bound
        is infinite (PyTorch's bf16 matmul promises no accumulation order to bound), so
        every logit is recomputed: the float32 head itself."""
        w = weight.to(torch.bfloat16)
        approx = w.float()
        part = Bf16Linear(pack_bf16(w), *w.shape, None)
        return cls(weight, [part], cls.bound_coef(weight, approx, [approx]), torch.bfloat16,
                   torch_norm_coef=math.inf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, K) float32 -> logits (N, V) float32."""
        coef = self.norm_coef if all(_on_own_kernel(p) for p in self.parts) else self.torch_norm_coef
        if math.isinf(coef):
            return F.linear(x, self.weight)  # no bound for these kernels: the float32 head itself
        xb = x.to(self.dtype)
        logits = None
        for part in self.parts:
            a = part.forward(xb)                                                # (N, V) bf16
            logits = a.float() if logits is None else logits.add_(a)           # (N, V) float32
        ops = getattr(self.parts[0], "kernels", None)
        if ops is not None:  # the same selection and float32 recomputation, one pass over the logits
            n = ops.refine_head(logits, x.contiguous(), self.weight, coef,
                                int(self.max_refined_fraction * logits.numel()))
            if n < 0:
                return F.linear(x, self.weight)
            self.last_num_refined = n
            return logits
        bound = coef * x.norm(dim=-1) + 1e-3                                   # (N,)
        candidates = logits >= (logits.amax(dim=-1) - 2 * bound)[:, None]       # (N, V)
        rows, cols = candidates.nonzero(as_tuple=True)                          # (C,), (C,)
        self.last_num_refined = int(rows.numel())
        if rows.numel() > self.max_refined_fraction * logits.numel():
            return F.linear(x, self.weight)  # a flat distribution: the whole float32 head is cheaper
        logits[rows, cols] = torch.linalg.vecdot(self.weight[cols], x[rows])  # (C,) float32 dot products
        return logits


def _on_own_kernel(layer: nn.Module) -> bool:
    """Whether a head part runs the computation its bound was proven for: int8, or int4 /
    bf16 / Q8_0 on verispec's kernels (int4 on PyTorch's has its own bound, bf16 and Q8_0 on
    PyTorch's none)."""
    if isinstance(layer, Int4Linear):
        return layer.kernels is not None and layer.kernels.int4_vector
    if isinstance(layer, Bf16Linear):
        return layer.kernels is not None and layer.kernels.bf16_vector
    if isinstance(layer, Q8Linear):
        return layer.kernels is not None and layer.kernels.q8_vector
    return True


def _torch_int4_weights(groups: Int4Groups, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) float32: the weights PyTorch's int4 kernel computes with (scale, zero in `dtype`)."""
    n, k = groups.q.shape
    scale, zero = _torch_scale_zero(groups, dtype)
    q = groups.q.float().view(n, k // INT4_GROUP, INT4_GROUP) - 8
    return (q * scale[..., None] + zero[..., None]).view(n, k)


# --- GGUF Q4 blocks -> int4 groups ------------------------------------------------------------

def gguf_q4_tensor(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> Int4Groups:
    """Decode Q4_0 / Q4_1 blocks of a (N, K) tensor into int4 groups (codes kept exactly).

    A block is [d fp16][m fp16, Q4_1 only][16 bytes]: byte j holds weight j in its low
    nibble and weight j + 16 in its high nibble.
    """
    n, k = shape
    head = 2 if qtype == _GGML_Q4_0 else 4
    blocks = data.reshape(n, k // INT4_GROUP, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)      # (N, G)
    if qtype == _GGML_Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, G)
        mn = m
    else:
        mn = -8 * d
    packed = blocks[..., head:]                                                  # (N, G, 16)
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k)      # (N, K)
    return Int4Groups(torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(mn))


def gguf_int4_groups(path: Path) -> tuple[dict[str, Int4Groups], list[str]]:
    """Int4 groups of every Q4_0 / Q4_1 linear weight of a GGUF, under Hugging Face names.

    Q/K rows are un-permuted like the float32 conversion does (a row permutation keeps each
    row's groups intact). Returns (groups, names of 2-D weights stored in other types).
    """
    from verispec.model import gguf_loader as g

    meta = g.open_gguf(path)
    heads, kv_heads = meta.arch_key("attention.head_count"), meta.arch_key("attention.head_count_kv")
    data = np.memmap(meta.path, dtype=np.uint8, mode="r")
    groups, others = {}, []
    for t in meta.tensors:
        name = g.hf_tensor_name(t.name)
        if len(t.shape) != 2 or "embed_tokens" in name or "lm_head" in name:
            continue
        if t.qtype not in (_GGML_Q4_0, _GGML_Q4_1):
            others.append(name)
            continue
        n, k = t.shape
        nbytes = n * (k // INT4_GROUP) * (18 if t.qtype == _GGML_Q4_0 else 20)
        grp = gguf_q4_tensor(np.asarray(data[t.offset: t.offset + nbytes]), t.qtype, (n, k))
        if meta.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n_head = heads if ".q_proj." in name else (kv_heads or heads)
            grp = Int4Groups(*(torch.from_numpy(np.ascontiguousarray(g.unpermute_from_gguf(f.numpy(), n_head)))
                               for f in (grp.q, grp.scale, grp.min)))
        groups[name] = grp
    return groups, others


def gguf_q8_0_head(path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(block scales (V, K / 32) float32, codes (V, K) int8) of a GGUF's LM head if it is
    Q8_0 (`output.weight`, else the tied `token_embd.weight`); None otherwise.

    A Q8_0 block is [d fp16][32 x int8], w = d * q.
    """
    from verispec.model import gguf_loader as g

    meta = g.read_gguf(path)
    by_name = {t.name: t for t in meta.tensors}
    t = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if t is None or t.qtype != _GGML_Q8_0:
        return None
    v, k = t.shape
    data = np.memmap(meta.path, dtype=np.uint8, mode="r")
    blocks = np.asarray(data[t.offset: t.offset + v * (k // 32) * 34]).reshape(v, k // 32, 34)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)   # (V, G)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(v, k)                    # (V, K)
    return torch.from_numpy(scale), torch.from_numpy(codes)


def fuse_int4_groups(num_layers: int, groups: dict[str, Int4Groups]) -> dict[str, Int4Groups]:
    """HF names -> our fused names (qkv_proj, gate_up_proj), like `fuse_hf_state_dict`."""
    out = {}
    for i in range(num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        parts = {
            "self_attn.qkv_proj": [f"self_attn.{n}_proj" for n in "qkv"],
            "self_attn.o_proj": ["self_attn.o_proj"],
            "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
            "mlp.down_proj": ["mlp.down_proj"],
        }
        for fused, names in parts.items():
            found = [groups.get(f"{hf}{n}.weight") for n in names]
            if all(f is not None for f in found):
                out[f"{ours}{fused}.weight"] = Int4Groups.cat(found)
    return out


def resolve_weight_format(requested: str, dtype: torch.dtype, gguf_path: Path | None, draft: bool = False) -> str:
    """'auto' -> a concrete format; checks the combination is one the kernels run.

    A draft model's 'auto' is int4 for a Q4 GGUF and int8 otherwise, in bf16 (its precision
    moves only acceptance, never the output distribution; its cost is the whole point of
    it). Not round-to-nearest int4: on the trained draft of the default model (3 layers, its
    weights fine-tuned off the GGUF's 4-bit grid) RTN int4 agreed with the dense draft's
    argmax on 1 position in 8; int8 on all of them."""
    if requested not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {requested!r}")
    if requested == "auto":
        if dtype != torch.bfloat16:
            return "dense"
        q4 = gguf_path is not None and _all_linear_q4(gguf_path)
        if draft:
            return "int4" if q4 else "int8"
        return "int4" if q4 else "dense"
    if requested != "dense" and dtype != torch.bfloat16:
        raise ValueError(f"weight_format {requested!r} needs dtype bfloat16 (the packed CPU kernels "
                         f"are 10-30x slower with {dtype} activations), got {dtype}")
    return requested


def _all_linear_q4(path: Path) -> bool:
    from verispec.model import gguf_loader as g

    meta = g.read_gguf(path)
    linear = [t for t in meta.tensors if len(t.shape) == 2 and not t.name.startswith(("token_embd", "output."))]
    return bool(linear) and all(t.qtype in (_GGML_Q4_0, _GGML_Q4_1) for t in linear)


# --- saving and restoring a quantized model (warm starts) ------------------------------------

def quantized_metadata(model: nn.Module) -> dict[str, str]:
    """What `model.state_dict()` does not hold about its quantized modules, as strings.

    Saved next to the state dict (safetensors metadata), it lets `restore_quantized`
    rebuild the modules without recomputing anything from the source weights.
    """
    meta = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (Int4Linear, Q8Linear)):
            meta[f"{name}.out_features"] = str(mod.out_features)
            if isinstance(mod, Int4Linear):
                meta[f"{name}.act_bits"] = str(mod.act_bits)
        elif isinstance(mod, Bf16Linear):
            meta[f"{name}.out_features"] = str(mod.out_features)
            meta[f"{name}.in_features"] = str(mod.in_features)
        elif isinstance(mod, RefinedHead):
            meta[f"{name}.norm_coef"] = repr(mod.norm_coef)
            meta[f"{name}.torch_norm_coef"] = repr(mod.torch_norm_coef)
            meta[f"{name}.dtype"] = str(mod.dtype).removeprefix("torch.")
    return meta


def restore_quantized(model: nn.Module, state: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Install the quantized modules a saved state dict describes, in place of the skeleton's.

    The inverse of saving `model.state_dict()` with `quantized_metadata(model)`: every
    `<layer>.q4` becomes an Int4Linear, every `<layer>.qweight` an Int8Linear, every
    `<layer>.w16` a Bf16Linear, every `<layer>.q8` a Q8Linear, and a head with `parts` a
    RefinedHead. The model's keys
    then match `state` exactly, so a strict load_state_dict(state, assign=True) fills the rest.
    """
    def linear(prefix: str) -> nn.Module:
        bias = state.get(f"{prefix}.bias")
        if f"{prefix}.q4" in state:
            return Int4Linear(state[f"{prefix}.q4"], state[f"{prefix}.scale"], state[f"{prefix}.min"],
                              int(meta[f"{prefix}.out_features"]), bias, int(meta.get(f"{prefix}.act_bits", 16)))
        if f"{prefix}.q8" in state:
            return Q8Linear(state[f"{prefix}.q8"], state[f"{prefix}.scale"], int(meta[f"{prefix}.out_features"]))
        if f"{prefix}.w16" in state:
            return Bf16Linear(state[f"{prefix}.w16"], int(meta[f"{prefix}.out_features"]),
                              int(meta[f"{prefix}.in_features"]), bias)
        return Int8Linear(state[f"{prefix}.qweight"], state[f"{prefix}.scales"], bias)

    def install(path: str, module: nn.Module) -> None:
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)

    layers = {k.rsplit(".", 1)[0] for k in state if k.endswith((".q4", ".qweight", ".w16", ".q8"))}
    heads = {p.split(".parts.")[0] for p in layers if ".parts." in p}
    for head in sorted(heads):
        parts = sorted((p for p in layers if p.startswith(f"{head}.parts.")), key=lambda p: int(p.rsplit(".", 1)[1]))
        install(head, RefinedHead(state[f"{head}.weight"], [linear(p) for p in parts],
                                  float(meta[f"{head}.norm_coef"]), getattr(torch, meta[f"{head}.dtype"]),
                                  float(meta[f"{head}.torch_norm_coef"])))
    for path in sorted(p for p in layers if ".parts." not in p):
        install(path, linear(path))
