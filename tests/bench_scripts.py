"""Loading a script of bench/ as a module, for the tests of its pure parts."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(script: str, name: str) -> ModuleType:
    """bench/<script>.py (e.g. "roofline", "experiments/linear_widths") as module `name`
    (registered: dataclasses need it), with bench/ on the path for the scripts' own
    `import common`."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
