"""Fused CPU kernels for the decode hot path: C++ (kernels.cpp), compiled on first use.

At batch 1 a small model's decode step is mostly per-op overhead: measured on the default
model (2 threads), an RMSNorm costs ~21 us, SDPA over a few hundred keys ~43 us, a rotary
embedding three ops, for ~1 us of arithmetic each. Three kernels replace them with one
loop each, rounding exactly where the PyTorch ops do (float32 accumulation, one rounding
to the activation dtype), so the model computes the same function:

    add_rms_norm(x, delta, w, eps) -> (x + delta, rms_norm(x + delta) * w)
    rotary_(qk, cos, sin)          in place, llama.apply_rotary's layout and rounding
    decode_attention(q (B, H, D), k_pool, v_pool (S, Hkv, D), slots (B, C), lens (B,), scale)
                                   one query per row, K/V read in place from the pool

`load()` compiles them with torch.utils.cpp_extension (a C++ compiler is needed: ~1 min
once per machine, cached under ~/.cache/torch_extensions, keyed by the source, the flags
and this CPU's instruction set) and returns the module, or None when compiling fails (the
model then runs the PyTorch ops; `EngineConfig.kernels` = "on" makes that an error).
"""
from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path

log = logging.getLogger("verispec")

_SOURCE = Path(__file__).with_name("kernels.cpp")
_loaded: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def load(required: bool = False):
    """The compiled kernels module, or None (required: raise instead) if it cannot be built."""
    if "module" in _loaded:
        module = _loaded["module"]
        if module is None and required:
            raise RuntimeError(f"verispec kernels are unavailable: {_loaded['error']}")
        return module
    try:
        from torch.utils.cpp_extension import load as build
        # -march=native: the build is for this CPU only, so its instruction set is in the name.
        tag = hashlib.sha1(_cpu_flags().encode()).hexdigest()[:8]
        module = build(name=f"verispec_kernels_{tag}", sources=[str(_SOURCE)],
                       extra_cflags=["-O3", "-march=native"], verbose=False)
        _loaded.update(module=module, error=None)
    except Exception as exc:  # no compiler, no headers: the PyTorch ops still work
        _loaded.update(module=None, error=f"{type(exc).__name__}: {exc}")
        if required:
            raise RuntimeError(f"verispec kernels could not be built: {_loaded['error']}") from exc
        log.warning("verispec kernels could not be built, using PyTorch ops: %s", _loaded["error"])
    return _loaded["module"]
