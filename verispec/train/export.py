"""Stage 4: write the trained draft as a Hugging Face-format directory.

The directory holds what `verispec.model.loader` reads for `--draft-model DIR`: config.json
(the target's, with the draft's layer count), model.safetensors (HF tensor names: q/k/v and
gate/up unfused again; the LM head omitted when tied), and the target's tokenizer files
unchanged (so `verispec check-pair` finds identical tokenizers). `verispec_draft.json` is
written last (provenance + completion marker); the folder is built beside the destination
and renamed into place, so a reader never sees half a draft.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel
from verispec.train.registry import MARKER
from verispec.train.store import write_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json")


def hf_state_dict(model: LlamaModel, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our fused names -> Hugging Face names (inverse of llama.fuse_hf_state_dict)."""
    cfg = model.cfg
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[name] = t
            continue
        if ".qkv_proj." in name:
            for part, piece in zip("qkv", t.split([q_size, kv_size, kv_size], dim=0)):
                out["model." + name.replace("qkv_proj", f"{part}_proj")] = piece
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out["model." + name.replace("gate_up_proj", "gate_proj")] = gate
            out["model." + name.replace("gate_up_proj", "up_proj")] = up
        else:
            out["model." + name] = t
    return {k: v.detach().to(dtype).contiguous() for k, v in out.items()}


def export_draft(model: LlamaModel, target_dir: Path, out_dir: Path, provenance: dict,
                 dtype: torch.dtype = torch.float32) -> Path:
    """Write `model` as an HF directory at `out_dir` (replacing any older export)."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    hf_config = json.loads((target_dir / "config.json").read_text())
    hf_config.update(_config_fields(model.cfg))
    building = out_dir.with_name(f"{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    try:
        (building / "config.json").write_text(json.dumps(hf_config, indent=2))
        save_file(hf_state_dict(model, dtype), str(building / "model.safetensors"), metadata={"format": "pt"})
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copy2(target_dir / name, building / name)
        write_json(building / MARKER, provenance)
        old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(building, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return out_dir


def _config_fields(cfg: ModelConfig) -> dict:
    return {"num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
            "torch_dtype": "float32"}
