"""One rank's model: its slices read from the model's files, built, given its collectives.

Only the rank's slices are read (safetensors slices), so no rank holds the whole model;
a GGUF is converted once into its cache folder first, as for one process. Tensor-parallel
ranks do not use the warm-start cache of runtime weights (engine.load_model): each rank's
weights differ, and every rank converts its slices at start-up.
"""
from __future__ import annotations

import torch

from verispec.config import EngineConfig
from verispec.distributed.layers import Collectives, parallelize
from verispec.distributed.sharding import RankShard
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel
from verispec.model.loader import ensure_cached, load_config_and_tokenizer, load_safetensors_dir, resolve_model
from verispec.model.tokenizer import Tokenizer


def load_rank_model(config: EngineConfig, rank: int, world: int, device: torch.device
                    ) -> tuple[LlamaModel, ModelConfig, Tokenizer, Collectives]:
    """(rank's parallelized model, the whole model's config, tokenizer, its collectives)."""
    source = resolve_model(config.model)
    gguf_path = source.path if source.kind == "gguf" else None
    directory = ensure_cached(source) if gguf_path is not None else source.path
    full, tokenizer = load_config_and_tokenizer(source)
    shard = RankShard(full, rank, world)
    state = load_safetensors_dir(directory, full, shard.index)  # only the rank's slices are read
    model = LlamaModel.from_state_dict(shard.config(), state, dtype=getattr(torch, config.dtype), device=device,
                                       weight_format=config.weight_format, gguf_path=gguf_path, shard=shard)
    comm = Collectives(shard)
    return parallelize(model, shard, comm), full, tokenizer, comm
