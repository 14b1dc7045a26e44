"""Small file helpers shared by the stages: atomic writes and settings that must not change."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def write_json(path: Path, obj) -> None:
    """Write JSON atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def save_torch(path: Path, obj) -> None:
    """torch.save atomically: an interrupted stage leaves no truncated shard behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_torch(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


def as_stored(settings: dict) -> dict:
    """`settings` as read back from its JSON file (tuples become lists)."""
    return json.loads(json.dumps(settings))


def ensure_same_settings(path: Path, settings: dict, what: str) -> None:
    """Record `settings` at `path`, or check they equal the recorded ones.

    A resumed stage must not mix results made with different settings; the error names the
    first field that differs and how to start afresh.
    """
    if not path.exists():
        write_json(path, settings)
        return
    old = read_json(path)
    fresh = as_stored(settings)
    if old != fresh:
        diff = _first_difference(old, fresh)
        raise ValueError(f"{what} in {path.parent} was made with different settings ({diff}); "
                         "use a new --work-dir or delete that folder")


def _first_difference(old, new, where: str = "") -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _first_difference(old.get(key), new.get(key), f"{where}.{key}" if where else key)
    return f"{where or 'value'}: recorded {old!r}, now {new!r}"
