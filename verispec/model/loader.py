"""Find a model, load its config, weights (HF names) and tokenizer, and place its weights.

A model is a registry name, a `.gguf` file, or a Hugging Face-format directory. GGUF files
are converted ONCE into a cache folder that is itself an HF-format directory, so every warm
start takes the same fast path (safetensors + tokenizer.json, no `gguf`, no `transformers`):

    $VERISPEC_CACHE (default ~/.cache/verispec)/
      sha256_memo.json         path -> (size, mtime, sha256): warm starts do not re-hash
      <sha256 of the .gguf>/
        config.json            HF config (architectures, sizes, rope, eos list)
        model.safetensors      float32, dequantized, HF names, Q/K un-permuted
        tokenizer.json         byte-level BPE rebuilt from the GGUF vocabulary and merges
        tokenizer_config.json  chat_template, add_bos_token, special token strings
        generation_config.json bos / eos ids
        verispec.json          written last: cache format version + source; marks completion
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from verispec.model.config import ModelConfig
from verispec.model.fetch import cache_root, cached_sha256
from verispec.model.registry import ModelNotFound, ModelSource, lookup, model_names
from verispec.model.tokenizer import Tokenizer, meta_from_configs

__all__ = ["ModelNotFound", "ModelSource", "resolve_model", "load_model_files", "load_safetensors_dir",
           "load_config_and_tokenizer", "ensure_cached", "cache_dir_for", "place_models"]

log = logging.getLogger("verispec")

CACHE_FORMAT_VERSION = 1
_MARKER = "verispec.json"


def resolve_model(spec: str) -> ModelSource:
    """Turn a registry name, a `.gguf` path or an HF-format directory into a ModelSource."""
    if spec in model_names():
        return lookup(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"{path}: not a .gguf file (give a .gguf, an HF model directory "
                                f"or one of: {', '.join(model_names())})")
        return ModelSource(kind="gguf", path=path.resolve(), name=path.stem)
    if path.is_dir():
        _check_hf_dir(path)
        return ModelSource(kind="hf", path=path.resolve(), name=path.resolve().name)
    if os.sep in spec or spec.endswith(".gguf"):
        raise ModelNotFound(f"{spec}: no such file or directory")
    raise ModelNotFound(f"unknown model {spec!r}: not a file or directory, and not a registry name "
                        f"({', '.join(model_names())})")


def _check_hf_dir(path: Path) -> None:
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelNotFound(f"{path}: not a Hugging Face model directory (missing {', '.join(missing)})")


# --- loading -----------------------------------------------------------------------------------

def load_model_files(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, state dict (HF names; float32 for GGUF, file dtype for safetensors), tokenizer."""
    directory = ensure_cached(source) if source.kind == "gguf" else source.path
    config, tokenizer = _load_hf_config_and_tokenizer(directory, source.name)
    return config, load_safetensors_dir(directory, config), tokenizer


def load_config_and_tokenizer(source: ModelSource) -> tuple[ModelConfig, Tokenizer]:
    """Config and tokenizer only (no weights): fast, and converts nothing for an uncached GGUF."""
    if source.kind == "hf":
        return _load_hf_config_and_tokenizer(source.path, source.name)
    cached = _complete_cache_dir(source.path)
    if cached is not None:
        return _load_hf_config_and_tokenizer(cached, source.name)
    files = _gguf_light_files(source.path)
    backend = files["tokenizer"]
    tokenizer = Tokenizer(backend, meta_from_configs(backend, files["tokenizer_config"],
                                                     files["generation_config"], files["config"]))
    return ModelConfig.from_hf(files["config"], name=source.name), tokenizer


def _load_hf_config_and_tokenizer(directory: Path, name: str) -> tuple[ModelConfig, Tokenizer]:
    tokenizer = Tokenizer.from_file(directory)
    cfg = json.loads((directory / "config.json").read_text())
    # One EOS set for the engine: the tokenizer's (generation config + tokenizer + model config).
    cfg["eos_token_id"] = list(tokenizer.eos_token_ids)
    return ModelConfig.from_hf(cfg, name=name), tokenizer


# index(HF name, ndim) -> the part of that tensor to read (an index), or None: all of it
SliceIndex = Callable[[str, int], tuple[slice, ...] | None]


def load_safetensors_dir(directory: Path, config: ModelConfig, index: SliceIndex | None = None
                         ) -> dict[str, torch.Tensor]:
    """The state dict (HF names) of the folder's safetensors files; with `index`, only the
    part of each tensor it names is read (a tensor-parallel rank's slices)."""
    state = dict(_read_safetensors(Path(directory), index))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the model reuses (its run of) embed_tokens.weight
    return state


def _read_safetensors(directory: Path, index: SliceIndex | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)  # a handle: reads nothing yet
                where = None if index is None else index(name, len(part.get_shape()))
                yield name, f.get_tensor(name) if where is None else part[where].contiguous()


# --- placement ---------------------------------------------------------------------------------

def place_models(models: list, kernels_mode: str, huge_pages: bool):
    """Place loaded models (all on one device) for running: their weights into huge pages
    (when asked, on the CPU, and the OS gives them), then verispec's kernels attached per
    `kernels_mode` ("on": required, "auto", "off"; CPU only). Returns (the kernels or None,
    whether any weights moved). ValueError for an int4a8 model left without kernels."""
    from verispec.model import kernels, memory

    on_cpu = models[0].embed_tokens.weight.device.type == "cpu"
    ops = kernels.load(required=kernels_mode == "on") if kernels_mode != "off" and on_cpu else None
    moved = False
    if huge_pages and on_cpu and memory.huge_pages_available():
        for model in models:  # before the kernels: the decoder stack is built from these
            moved = memory.move_to_huge_pages(model) > 0 or moved
    for model in models:
        if ops is None and model.weight_format == "int4a8":
            raise ValueError("weight format 'int4a8' (int4 on the 8-bit activation grid) runs on "
                             "verispec's kernels only; they are off (kernels: off, or a device "
                             "other than the CPU) or could not be built")
        model.kernels = ops
    return ops, moved


# --- GGUF cache --------------------------------------------------------------------------------

def cache_dir_for(gguf_path: Path) -> Path:
    """Cache folder of a GGUF file: `<cache root>/<sha256 of the file>`."""
    return cache_root() / cached_sha256(gguf_path)


def _complete_cache_dir(gguf_path: Path) -> Path | None:
    directory = cache_dir_for(gguf_path)
    try:
        marker = json.loads((directory / _MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return directory if marker.get("format_version") == CACHE_FORMAT_VERSION else None


def ensure_cached(source: ModelSource) -> Path:
    """Convert a GGUF into its cache folder unless already done; return the folder."""
    if source.kind != "gguf":
        raise ValueError(f"ensure_cached: source kind must be 'gguf', got {source.kind!r}")
    done = _complete_cache_dir(source.path)
    if done is not None:
        return done
    directory = cache_dir_for(source.path)
    log.info("converting %s into %s (once)", source.path, directory)
    building = directory.with_name(f"{directory.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    try:
        _convert_gguf(source.path, building)
        if _complete_cache_dir(source.path) is None:  # no concurrent process finished first
            shutil.rmtree(directory, ignore_errors=True)  # stale: older format or interrupted
            try:
                os.replace(building, directory)
            except OSError:
                if _complete_cache_dir(source.path) is None:  # not a concurrent winner: a real failure
                    raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return directory


def _gguf_light_files(gguf_path: Path, meta=None) -> dict:
    """Config, tokenizer and tokenizer/generation configs of a GGUF, built from its metadata."""
    from verispec.model import gguf_loader as g

    meta = meta or g.open_gguf(gguf_path)
    eos = g.eos_token_ids_from_gguf(meta)
    return {
        "config": g.hf_config_from_gguf(meta, eos),
        "tokenizer": g.build_tokenizer(meta),
        "tokenizer_config": g.tokenizer_config_from_gguf(meta, eos),
        "generation_config": {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos,
                              **_gguf_sampling(meta)},
    }


# llama.cpp's `general.sampling.*` keys -> generation_config.json names. Few GGUFs carry
# them (the default models do not): then the server's defaults stay neutral.
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}


def _gguf_sampling(meta) -> dict:
    return {name: meta.get(key) for key, name in _GGUF_SAMPLING.items() if meta.get(key) is not None}


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from verispec.model import gguf_loader as g

    out.mkdir(parents=True)
    meta = g.open_gguf(gguf_path)
    files = _gguf_light_files(gguf_path, meta)
    for name in ("config", "tokenizer_config", "generation_config"):
        (out / f"{name}.json").write_text(json.dumps(files[name], indent=2, ensure_ascii=False))
    files["tokenizer"].save(str(out / "tokenizer.json"))
    shapes = [(g.hf_tensor_name(t.name), t.shape) for t in meta.tensors]
    write_safetensors_f32(out / "model.safetensors", shapes, g.iter_hf_tensors(meta, files["config"]))
    marker = {"format_version": CACHE_FORMAT_VERSION, "source": str(gguf_path),
              "sha256": cached_sha256(gguf_path), "architecture": meta.arch}
    (out / _MARKER).write_text(json.dumps(marker, indent=2))


def write_safetensors_f32(path: Path, shapes: list[tuple[str, tuple[int, ...]]], tensors: Iterable) -> None:
    """Stream float32 tensors into a safetensors file, one tensor in memory at a time.

    The header (names, shapes, byte offsets) is written first from `shapes`; `tensors` must
    then yield (name, float32 array) in the same order.
    """
    header, offset = {}, 0
    for name, shape in shapes:
        nbytes = 4 * _numel(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (want_name, want_shape), (name, array) in zip(shapes, tensors, strict=True):
            if name != want_name or tuple(array.shape) != want_shape or array.dtype.str != "<f4":
                raise ValueError(f"tensor stream out of order: got {name} {array.shape} {array.dtype}, "
                                 f"expected {want_name} {want_shape} float32")
            f.write(array.tobytes())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
