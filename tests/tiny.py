"""Tiny random target/draft pairs and a trivial tokenizer for engine tests.

The vocabulary is small enough (<= 16) that the exact autoregressive distribution of the
first generated tokens can be enumerated with the target model itself.
"""
from __future__ import annotations

import copy
import os

import torch

from verispec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from verispec.engine.engine import LLMEngine
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel


class TinyTokenizer:
    """Token i <-> the letter chr(ord('a') + i); no special tokens unless eos is given."""

    def __init__(self, vocab_size: int, eos: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = () if eos is None else (eos,)
        self.bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + int(i)) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)

    def encode_chat(self, messages) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    @property
    def backend(self):
        """The same vocabulary as a `tokenizers.Tokenizer` (what structured output compiles
        grammars against); the EOS id, if given, is the special token "</s>"."""
        from tokenizers import AddedToken, Tokenizer, decoders, models

        vocab = {chr(ord("a") + i): i for i in range(self.vocab_size)}
        if self.eos_token_ids and self.eos_token_ids[0] >= self.vocab_size:
            vocab["</s>"] = self.eos_token_ids[0]
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        if "</s>" in vocab:
            backend.add_special_tokens([AddedToken("</s>", special=True)])
        backend.decoder = decoders.ByteLevel()
        return backend


def tiny_config(vocab: int = 16, layers: int = 2, hidden: int = 32, max_len: int = 256) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                       max_position_embeddings=max_len, rope_theta=10000.0, name="tiny")


def tiny_pair(vocab: int = 16, noise: float = 0.5, seed: int = 0, logit_scale: float = 3.0):
    """A target and a draft = target + noise * N(0, 1) on every weight (noise tunes similarity).

    `logit_scale` sharpens the tiny models' near-uniform distributions so that acceptance is
    neither trivially 1 nor 0.
    """
    torch.manual_seed(seed)
    target = LlamaModel(tiny_config(vocab)).float().eval()
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0, 0.3)
        for layer in target.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        target.norm.weight.fill_(logit_scale)
    draft = LlamaModel(tiny_config(vocab)).float().eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn_like(p) * noise * 0.3)
    return target, draft


# The device tiny engines run on: scripts/gpu_check.py runs the tests marked `gpu` with
# VERISPEC_TEST_DEVICE=cuda (the models are built on the CPU and copied there).
TEST_DEVICE = os.environ.get("VERISPEC_TEST_DEVICE", "cpu")


def on_test_device(model: LlamaModel | None) -> LlamaModel | None:
    return model if model is None or TEST_DEVICE == "cpu" else copy.deepcopy(model).to(TEST_DEVICE)


def tiny_engine(target: LlamaModel, draft: LlamaModel | None = None, method: str = "ngram", k: int = 4,
                adaptive: bool = False, num_kv_tokens: int = 4096, block_size: int = 4,
                max_num_seqs: int = 256, max_batched_tokens: int = 4096, prefix_cache: bool = True,
                eos: int | None = None, seed: int = 0, huge_pages: bool = True,
                draft_head: str | None = None,
                auto_candidates: tuple[str, ...] = ("ngram", "eagle"),
                suffix_max_cached_requests: int | None = None) -> LLMEngine:
    config = EngineConfig(
        model="tiny", draft_model="tiny-draft" if draft is not None else None, dtype="float32", seed=seed, huge_pages=huge_pages,
        draft_head=draft_head,
        spec=SpecConfig(method=method, num_spec_tokens=k, adaptive=adaptive, auto_candidates=auto_candidates,
                        suffix_max_cached_requests=suffix_max_cached_requests),
        cache=CacheConfig(block_size=block_size, num_kv_tokens=num_kv_tokens, prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens))
    return LLMEngine(config, on_test_device(target), TinyTokenizer(target.cfg.vocab_size, eos),
                     on_test_device(draft))


def run_all(engine: LLMEngine, prompts: list[list[int]], params, spec=None, check=True) -> list:
    """Add every prompt, step until done (checking integrity each step), return final outputs."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{engine._arrivals + i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params_list):
        engine.add_request(rid, p, sp, spec)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if check:
            engine.check_integrity()
    return [final[rid] for rid in ids]
