"""Builds suffix decoding's C++ index (suffix_index.cpp) on first use.

torch.utils.cpp_extension compiles it (~10 s once per machine and source version, cached
under ~/.cache/torch_extensions, named by the source); it needs only pybind11's headers,
which torch ships. `load()` returns the module, or None when it cannot be built (the
proposer then runs suffix.py's Python index, which computes the same drafts).
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger("verispec")

_SOURCE = Path(__file__).with_name("suffix_index.cpp")
_loaded: dict[str, object] = {}


def load(required: bool = False):
    """The compiled module, or None (required: raise instead) if it cannot be built."""
    if "module" not in _loaded:
        try:
            from torch.utils.cpp_extension import load as build
            tag = hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:10]
            module = build(name=f"verispec_suffix_{tag}", sources=[str(_SOURCE)], extra_cflags=["-O2"],
                           verbose=False)
            _loaded.update(module=module, error=None)
        except Exception as exc:  # no compiler: the Python index drafts the same tokens
            _loaded.update(module=None, error=f"{type(exc).__name__}: {exc}")
            log.warning("suffix decoding's C++ index could not be built, using Python: %s", _loaded["error"])
    if _loaded["module"] is None and required:
        raise RuntimeError(f"suffix decoding's C++ index is unavailable: {_loaded['error']}")
    return _loaded["module"]
