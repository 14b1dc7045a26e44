"""EAGLE-style heads for the tiny test targets, saved where `--draft-head` reads them.

`random_head_dir`: random weights over a vocabulary subset (the gates' residual outside
the subset is exercised; acceptance is whatever chance gives). `trained_head_dir`: a head
distilled for a few seconds through verispec.train.eagle on the target's own greedy
continuations (the training pipeline end to end, and acceptance well above chance).
Both are cached per process.
"""
from __future__ import annotations

import tempfile

import torch

from tiny import run_all, tiny_engine
from verispec.model.eagle import EagleHead, save_head
from verispec.sampling import SamplingParams

_CACHE: dict = {}


def random_head_dir(target, vocab_ids: list[int], seed: int = 0, scale: float = 0.3) -> str:
    key = ("random", id(target), tuple(vocab_ids), seed)
    if key not in _CACHE:
        torch.manual_seed(seed)
        head = EagleHead(target.cfg, torch.tensor(vocab_ids))
        with torch.no_grad():
            for name, p in head.named_parameters():
                p.normal_(0, scale) if "norm" not in name else p.fill_(1.0)
        _CACHE[key] = str(save_head(head, tempfile.mkdtemp(prefix="eagle-head-") + "/head", {"target": "tiny"}))
    return _CACHE[key]


def trained_head_dir(target, num_draft_vocab: int, steps: int = 200, seed: int = 0) -> str:
    key = ("trained", id(target), num_draft_vocab, steps, seed)
    if key not in _CACHE:
        from verispec.train.eagle import (EagleConfig, draft_vocabulary, init_head, target_features, teacher_rows,
                                          train_steps)
        from verispec.train.traces import score_topk

        vocab = target.cfg.vocab_size
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(2, 12, (96,), generator=g)]
        outs = run_all(tiny_engine(target, method="none"), prompts,
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        records = [{"prompt_ids": torch.tensor(p, dtype=torch.int32),
                    "output_ids": torch.tensor(o.token_ids, dtype=torch.int32)} for p, o in zip(prompts, outs)]
        score_topk(target, records, 8)
        cfg = EagleConfig(num_draft_vocab=num_draft_vocab, steps=steps, tokens_per_step=512, lr=3e-3,
                          warmup_steps=10, max_seq_len=64, feature_weight=0.1, seed=seed)
        torch.manual_seed(seed)
        vocab_ids = draft_vocabulary(records, num_draft_vocab)
        head = init_head(target, vocab_ids)
        optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr)
        train_steps(head, target_features(target, records, cfg.max_seq_len), cfg, optimizer,
                    teacher_rows(target, vocab_ids))
        _CACHE[key] = str(save_head(head, tempfile.mkdtemp(prefix="eagle-head-") + "/head", {"target": "tiny"}))
    return _CACHE[key]
