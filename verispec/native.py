"""C++ extensions compiled on first use (the kernels, the n-gram and suffix indexes).

torch.utils.cpp_extension builds each one once per machine and version, cached under
~/.cache/torch_extensions by a name that carries a hash of its source and flags (and of
whatever else the build depends on, `tag_extra()`), so a running process never sees its
library rebuilt under it. A machine without a compiler gets None and the caller's
Python path; `required` turns that into an error naming why.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("verispec")


class CppExtension:
    """One extension: `load()` builds it the first time, then returns the same module."""

    def __init__(self, what: str, source: Path, prefix: str, cflags: list[str], ldflags: list[str] | None = None,
                 tag_extra: Callable[[], str] = str, fallback: str = "the Python path"):
        self.what, self.source, self.prefix, self.fallback = what, source, prefix, fallback
        self.cflags, self.ldflags, self.tag_extra = cflags, ldflags or [], tag_extra
        self._result: tuple[object, str | None] | None = None   # (module or None, error)

    def load(self, required: bool = False):
        """The compiled module, or None (required: raise instead) if it cannot be built."""
        if self._result is None:
            self._result = self._build()
        module, error = self._result
        if module is None and required:
            raise RuntimeError(f"{self.what} could not be built: {error}")
        return module

    def _build(self) -> tuple[object, str | None]:
        try:
            from torch.utils.cpp_extension import load as build
            digest = hashlib.sha1(self.tag_extra().encode() + self.source.read_bytes() + " ".join(self.cflags).encode())
            module = build(name=f"{self.prefix}_{digest.hexdigest()[:10]}", sources=[str(self.source)],
                           extra_cflags=self.cflags, extra_ldflags=self.ldflags, verbose=False)
            return module, None
        except Exception as exc:  # no compiler, no headers: the caller's Python path still works
            error = f"{type(exc).__name__}: {exc}"
            log.warning("%s could not be built, using %s: %s", self.what, self.fallback, error)
            return None, error
