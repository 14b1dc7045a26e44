"""Which torch device an engine runs on (`EngineConfig.device`)."""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """The device for `name`: "auto" is the current CUDA device when torch can use one, else
    the CPU; "cpu", "cuda" or "cuda:N" as given. Asking for CUDA that torch cannot use is
    an error that says why (a CPU-only build, no visible device, an index out of range)."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "torch sees no CUDA device (check CUDA_VISIBLE_DEVICES and the driver)")
        raise ValueError(f"device {name!r} was asked for, but {why} (torch {torch.__version__}); "
                         "use device cpu or auto")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)
