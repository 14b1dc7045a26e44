"""Can this draft model propose tokens for this target? (`verispec check-pair`)

Speculative decoding feeds the draft's token ids straight to the target, so both must give
every id the same meaning. We compare the tokenizers themselves (token strings in id order,
merges, which ids are special, BOS and EOS), not only their sizes.

Padded embeddings. Embedding tables are often padded past the tokenizer (Qwen2.5: 151936
rows in the 0.5B-32B models, 152064 in 7B/72B, for 151665 real tokens). Rows past the real
vocabulary belong to no token and are never produced by a trained model. Rule (logged when
it applies): a pair is compatible when the token lists are identical and BOTH embedding sizes
are >= the tokenizer's vocabulary size. The verdict's `shared_vocab_size` is then the smaller
embedding size: ids < shared_vocab_size exist in both models (real tokens, then padding rows
the two models share), and the engine masks the logits of rows >= shared_vocab_size to -inf
in both models, so such ids are never proposed or produced. When the two sizes are equal
(the usual case) nothing is masked.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from verispec.model.config import ModelConfig
from verispec.model.tokenizer import Tokenizer

log = logging.getLogger("verispec")


@dataclass(frozen=True)
class PairVerdict:
    ok: bool
    reason: str
    shared_vocab_size: int  # ids [0, shared_vocab_size) are valid in both models; 0 if not ok


def _refuse(reason: str) -> PairVerdict:
    return PairVerdict(ok=False, reason=reason, shared_vocab_size=0)


def _compare_tokens(target: list[str], draft: list[str]) -> str | None:
    """Why the two id->string tables differ (first differing id), or None if identical."""
    for i, (t, d) in enumerate(zip(target, draft)):
        if t != d:
            return f"token {i} differs: target {t!r}, draft {d!r}"
    if len(target) != len(draft):
        longer, name = (target, "target") if len(target) > len(draft) else (draft, "draft")
        n = min(len(target), len(draft))
        return (f"vocabulary sizes differ: target {len(target)} tokens, draft {len(draft)}; "
                f"token {n} ({longer[n]!r}) exists only in the {name}")
    return None


def _compare_merges(target: list[tuple], draft: list[tuple]) -> str | None:
    for rank, (t, d) in enumerate(zip(target, draft)):
        if t != d:
            return f"merges differ at rank {rank}: target {' '.join(t)!r}, draft {' '.join(d)!r}"
    if len(target) != len(draft):
        return f"merges differ: target has {len(target)}, draft {len(draft)}"
    return None


def _compare_specials(target: Tokenizer, draft: Tokenizer) -> str | None:
    if set(target.eos_token_ids) != set(draft.eos_token_ids):
        return f"EOS differs: target {sorted(target.eos_token_ids)}, draft {sorted(draft.eos_token_ids)}"
    if (target.bos_token_id, target.meta.add_bos_token) != (draft.bos_token_id, draft.meta.add_bos_token):
        return (f"BOS differs: target id {target.bos_token_id} (added: {target.meta.add_bos_token}), "
                f"draft id {draft.bos_token_id} (added: {draft.meta.add_bos_token})")
    if target.special_token_ids() != draft.special_token_ids():
        only = sorted(set(target.special_token_ids()) ^ set(draft.special_token_ids()))
        return f"special tokens differ: ids {only[:10]} are special in only one tokenizer"
    return None


def check_pair(target: Tokenizer, draft: Tokenizer, target_cfg: ModelConfig,
               draft_cfg: ModelConfig) -> PairVerdict:
    """Decide whether `draft` can propose for `target`; say why not, or over which ids."""
    problem = (_compare_tokens(target.token_strings(), draft.token_strings())
               or _compare_specials(target, draft)
               or _compare_merges(target.merges(), draft.merges()))
    if problem:
        return _refuse(problem)
    vocab = target.vocab_size
    for name, cfg in (("target", target_cfg), ("draft", draft_cfg)):
        if cfg.vocab_size < vocab:
            return _refuse(f"{name} embedding has {cfg.vocab_size} rows, fewer than the "
                           f"tokenizer's {vocab} tokens")
    shared = min(target_cfg.vocab_size, draft_cfg.vocab_size)
    reason = f"identical tokenizers ({vocab} tokens)"
    if target_cfg.vocab_size != vocab or draft_cfg.vocab_size != vocab:
        reason += (f"; padded embeddings (target {target_cfg.vocab_size} rows, draft "
                   f"{draft_cfg.vocab_size}): verifying over the first {shared} ids")
        if target_cfg.vocab_size != draft_cfg.vocab_size:
            reason += f", logits of rows >= {shared} masked to -inf in both models"
        log.info("check_pair: %s", reason)
    return PairVerdict(ok=True, reason=reason, shared_vocab_size=shared)


def check_pair_cli(target_spec: str, draft_spec: str) -> tuple[bool, str]:
    """`verispec check-pair`: load only tokenizers + configs, return (ok, one-line message)."""
    from verispec.model.loader import load_config_and_tokenizer, resolve_model

    target_cfg, target_tok = load_config_and_tokenizer(resolve_model(target_spec))
    draft_cfg, draft_tok = load_config_and_tokenizer(resolve_model(draft_spec))
    verdict = check_pair(target_tok, draft_tok, target_cfg, draft_cfg)
    status = "compatible" if verdict.ok else "incompatible"
    return verdict.ok, f"{status}: {target_spec} / {draft_spec}: {verdict.reason}"
