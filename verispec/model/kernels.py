"""Fused CPU kernels for the decode hot path: C++ (kernels.cpp), compiled on first use.

At batch 1 a small model's decode step is mostly per-op overhead: measured on the default
model (2 threads), an RMSNorm costs ~21 us, SDPA over a few hundred keys ~43 us, a rotary
embedding three ops and the K/V write two more, for ~1 us of arithmetic each. These
kernels replace them with one loop each, rounding where the PyTorch ops do (float32
accumulation, one rounding to the activation dtype at the same points):

    add_rms_norm(x, delta, w, eps) -> (x + delta, rms_norm(x + delta) * w)
    rms_norm(x, w, eps, delta=None) -> rms_norm(x [+ delta]) * w in w's dtype (float32 w:
                                   the final norm, whose result the float32 head reads)
    argmax_rows(logits)            each row's first largest value's index (a NaN's if it
                                   has one: torch.argmax's answer, ~5x faster at 49k)
    rotary_(qk, cos, sin)          in place, llama.apply_rotary's layout and rounding
    rotary_store_(qk, v, cos, sin, k_pool, v_pool, slots)
                                   rotary_, then k (qk's last Hkv heads) and v written to
                                   the pools at slots (paged_attention's index_copy_)
    silu_mul(gate_up) -> silu(gate) * up
    decode_attention(q (N, H, D), k_pool, v_pool (S, Hkv, D), slots (R, C), rows (N,),
                     lens (N,), scale)
                                   each query over the first lens[i] slots of its row,
                                   K/V read in place from the pool
    int4_linear(x, q4, scale, min, out_features, bias=None, portable=False, act_bits=16)
                                   x @ W.T + bias, W int4 in groups of 32 with fp16 scale
                                   and min (quant.Int4Linear's lane layout); act_bits 8:
                                   the activations on an 8-bit grid (weight format int4a8)
    bf16_linear(x, w16, out_features, bias=None, portable=False)
                                   x @ W.T + bias, W bf16 in blocks of 16 rows, k in pairs
                                   (quant.Bf16Linear's layout)
    q8_linear(x, q8, scale, out_features, portable=False)
                                   x @ W.T in float32 (x and the result), W GGUF Q8_0
                                   blocks (int8 codes, fp16 scale per 32; quant.Q8Linear's
                                   layout): a Q8_0 LM head
    refine_head(logits, x, weight, coef, max_count)
                                   quant.RefinedHead's float32 recomputation of the logits
                                   near each row's largest, in place

The three linear kernels have a vector path for AVX-512 and one for AVX2 (with FMA and
F16C); `isa` says which this build has ("avx512", "avx2" or "portable") and
`int4_vector`, `bf16_vector`, `q8_vector` whether each kernel has one. On CPUs with
AMX-INT8 the int4 kernel (16-bit activation grid) runs passes of 32 tokens or more on AMX
tiles (`int4_amx`: built for them and granted them by the OS; `set_int4_amx(False)` turns
them off, for comparisons), the same integers and float operations as its AVX-512 path, so
the same outputs bit for bit (kernels.cpp, "int4 linear on AMX tiles"). Both vector paths
compute what the portable loop computes, bit for bit (`portable=True` runs the loop; tests
compare them). Without a vector path the layers use PyTorch's kernels instead (int4:
`_weight_int4pack_mm_for_cpu`; bf16: matmul; the Q8_0 head: the float32 head), which are
faster than the portable loops. Decode attention has AVX-512 and AVX2 forms for bf16 at
head sizes 64 and 128, the element-wise kernels an AVX2 form for bf16 (the same roundings).

`load()` compiles them with torch.utils.cpp_extension (a C++ compiler is needed: ~30 s
once per machine and source version, cached under ~/.cache/torch_extensions, named by
the source and this CPU's instruction set) and returns the module, or None when compiling fails (the
model then runs the PyTorch ops; `EngineConfig.kernels` = "on" makes that an error).
"""
from __future__ import annotations

import platform
from pathlib import Path

from verispec.native import CppExtension

_SOURCE = Path(__file__).with_name("kernels.cpp")
# -fopenmp: at::parallel_for splits work across threads only in code compiled with OpenMP
# (without it every kernel here ran on one thread).
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


# -march=native: the build is for this CPU only, so its instruction set is in the name.
_EXTENSION = CppExtension("verispec kernels", _SOURCE, "verispec_kernels", _CFLAGS, ["-fopenmp"],
                          tag_extra=_cpu_flags, fallback="PyTorch ops")


def load(required: bool = False):
    """The compiled kernels module, or None (required: raise instead) if it cannot be built."""
    return _EXTENSION.load(required)


def greedy_tokens(logits, ops) -> list[int]:
    """Each row's argmax (torch.argmax's answer) as host ints (`greedy_argmax`, read back)."""
    return greedy_argmax(logits, ops).tolist()


def greedy_argmax(logits, ops):
    """Each row's argmax (torch.argmax's answer), (N,) int64 on the logits' device: through
    `ops.argmax_rows` (one vector pass; torch's takes ~4x longer over a 49k vocabulary)
    when the kernels are loaded (`ops`, else None) and the rows are contiguous float32."""
    import torch
    if ops is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1:
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)
