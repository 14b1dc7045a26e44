"""CppExtension: a build that fails leaves the caller its Python path (None, once, with a
warning) unless the caller requires the extension, and then the error names what failed."""
from __future__ import annotations

import logging

import pytest

from verispec.native import CppExtension


def test_a_failed_build_falls_back_once_and_a_required_one_names_what_failed(tmp_path, caplog, monkeypatch):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    ext = CppExtension("the test extension", source, "verispec_test_broken", ["-O0"], fallback="plain Python")
    with caplog.at_level(logging.WARNING, logger="verispec"):
        assert ext.load() is None
        assert ext.load() is None  # the result is kept: no second build, no second warning
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "the test extension could not be built, using plain Python" in warnings[0]
    with pytest.raises(RuntimeError, match="the test extension could not be built: "):
        ext.load(required=True)
