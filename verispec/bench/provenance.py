"""What a result was measured with: software versions, verispec's git commit, the machine."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

_PACKAGES = ("verispec", "httpx", "numpy", "prometheus_client", "matplotlib", "tqdm", "torch",
             "vllm", "sglang")


def software_versions() -> dict:
    """Python and the installed versions of the packages that shape a measurement."""
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_info() -> dict:
    """Commit and dirty state of the verispec checkout this harness runs from."""
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"repo": str(repo), "commit": commit,
            "dirty": None if status is None else bool(status)}


def machine_info() -> dict:
    """CPU model, logical cores, RAM and OS of the machine running the client."""
    return {"cpu_model": _cpu_model(), "logical_cores": os.cpu_count(),
            "ram_bytes": _ram_bytes(), "hostname": platform.node(),
            "system": platform.system(), "machine": platform.machine()}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
