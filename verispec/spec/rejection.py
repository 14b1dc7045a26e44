"""The batched, ragged rejection sampler that makes speculation lossless.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"):

- draft token d_i: the proposer's guess for position i, drawn from q_i (or chosen by a
  rule, for proposers without probabilities).
- accepted token: a draft token kept after the test u < p_i(d_i) / q_i(d_i), u ~ U[0, 1),
  i.e. kept with probability min(1, p_i(d_i) / q_i(d_i)). Testing stops at the first
  rejection; accepted_len counts the accepted prefix.
- recovered token: drawn at the first rejected position i from the residual
  norm(max(0, p_i - q_i)). Accepting d with probability min(p, q)(d) / q(d) and otherwise
  drawing from the residual gives exactly p_i: min(p, q) + max(0, p - q) = p.
- bonus token: when all of a row's drafts are accepted, one more token drawn from the
  target at the next position, p_{n}, which the target computed for free in the same pass.

Every row therefore emits accepted_len + 1 tokens, each distributed exactly as plain
decoding from the target would have produced it.

Layout (the ASCII table for one row with K = 4, num_draft_tokens = 3, accepted_len = 1):

    position           0      1      2      3      4
    draft_tokens       d0     d1     d2     pad    -          (B, K)
    target_probs       p0     p1     p2     p3     p4         (B, K + 1, V)
    test               acc    rej    (not tested; padding never is)
    output_tokens      d0     r1     -1     -1     -1         r1 ~ norm(max(0, p1 - q1))

With accepted_len = num_draft_tokens = 3 instead, output would be d0 d1 d2 b3 -1, with
the bonus b3 ~ p3.

Seeded rows are verified by `seeded_verify` instead: the target's own race choice at each
position, with noise keyed by (seed, output position), must equal the draft; so their
output is seeded plain decoding's, token for token (docs/correctness.md, "Seeded requests").
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from verispec.sampling import draw_uniform, race, seeded_uniform

# A residual of total mass below this is treated as empty (see `_final_distribution`).
# Far below any probability that matters, far above float32 underflow once the race
# divides it by E <= 88.
_MIN_RESIDUAL_MASS = 1e-20


class RejectionResult(NamedTuple):
    """What the sampler decided for each row."""

    output_tokens: torch.Tensor  # (B, K + 1) int64: accepted drafts, then the recovered or
                                 # bonus token, then -1 padding
    num_output: torch.Tensor     # (B,) int64 = accepted_len + 1
    accepted_len: torch.Tensor   # (B,) int64 draft tokens accepted, in [0, num_draft_tokens]


def rejection_sample(
    target_probs: torch.Tensor,                # (B, K + 1, V) float32 target p at each position
    draft_tokens: torch.Tensor,                # (B, K) int64 proposals; past a row's count: ignored
    draft_probs: torch.Tensor | None,          # (B, K, V) float32 draft q, or None = one-hot at d
    num_draft_tokens: torch.Tensor | Sequence[int],  # (B,) int64 in [0, K]; may live on the host
    *,
    shared_generator: torch.Generator | None = None,
) -> RejectionResult:
    """Verify each row's drafts against the target; emit accepted + recovered/bonus tokens.

    Rows are ragged: row b tests only its first num_draft_tokens[b] drafts (0 = plain
    decoding: one token from target_probs[b, 0]). Both p and q must come from the same
    `logits_to_probs` with the request's settings. Temperature 0 needs no special case:
    p is one-hot, so d is accepted iff it is the argmax and the recovered token is the
    argmax, exactly greedy decoding. Noise: one draw of V + K uniforms per row from
    `shared_generator` (seeded rows take `seeded_verify` instead).
    """
    _check_inputs(target_probs, draft_tokens, draft_probs, num_draft_tokens)
    batch, num_positions, vocab = target_probs.shape
    k_max = num_positions - 1
    device = target_probs.device
    num_draft = torch.as_tensor(num_draft_tokens, dtype=torch.int64).to(device, non_blocking=True)

    # Columns [0, V) drive the race for the final token, [V, V + K) the accept tests.
    noise = draw_uniform(batch, vocab + k_max, device, shared_generator=shared_generator)  # (B, V + K)
    valid = torch.arange(k_max, device=device)[None, :] < num_draft[:, None]      # (B, K)
    draft_tokens = torch.where(valid, draft_tokens, 0)  # padding may be -1: keep gathers legal

    accepted = _accept_mask(target_probs, draft_tokens, draft_probs, noise[:, vocab:])
    accepted_len = (accepted & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)  # (B,)
    final_probs = _final_distribution(target_probs, draft_tokens, draft_probs,
                                      accepted_len, num_draft)                    # (B, V)
    final_token = race(final_probs, noise[:, :vocab])                             # (B,)
    return _assemble(draft_tokens, accepted_len, final_token)


def seeded_verify(
    target_probs: torch.Tensor,                # (B, K + 1, V) float32 target p at each position
    draft_tokens: torch.Tensor | Sequence[Sequence[int]],  # (B, K) or per-row lists; past a count: ignored
    num_draft_tokens: torch.Tensor | Sequence[int],  # (B,) in [0, K]
    keys: Sequence[tuple[int, int]],           # (B,) (seed, output position of position 0)
) -> RejectionResult:
    """Verification for seeded rows by the race: the result is seeded plain decoding's.

    Row b's choice at position i is c_i = race(p_i, u(seed, j + i)) with (seed, j) =
    keys[b]: the token seeded plain decoding emits at output position j + i given the
    same prefix. Draft d_i is accepted iff d_i == c_i; at the first mismatch c_i is
    emitted, after all n drafts the bonus c_n. Every emitted token is therefore the one
    plain decoding would emit, whatever the drafts, k or the batch. Over seeds each c_i
    is an exact sample of p_i, so a draft is accepted with probability p_i(d_i) (a one-hot
    q's rejection-sampling rate). Noise is drawn only for the positions decided
    (accepted + 1 per row): about one V-wide generator draw each.
    """
    batch = target_probs.shape[0]
    vocab = target_probs.shape[-1]
    counts = num_draft_tokens.tolist() if isinstance(num_draft_tokens, torch.Tensor) else list(num_draft_tokens)
    rows = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else draft_tokens
    accepted, emitted = [], []
    for b in range(batch):
        seed, start = keys[b]
        drafts, choices = rows[b][: counts[b]], []
        for i in range(len(drafts) + 1):
            u = seeded_uniform([(seed, start + i)], vocab, target_probs.device)  # (1, V)
            choices.append(int(race(target_probs[b, i: i + 1], u)))
            if i == len(drafts) or choices[i] != drafts[i]:
                break
        accepted.append(len(choices) - 1)
        emitted.append(choices)
    return _host_result(accepted, emitted, target_probs.shape[1] - 1, target_probs.device)


def greedy_verify(
    target_argmax: torch.Tensor,               # (B, K + 1) int64 argmax of the target logits per position
    draft_tokens: torch.Tensor,                # (B, K) int64 proposals; past a row's count: ignored
    num_draft_tokens: torch.Tensor | Sequence[int],  # (B,) in [0, K]
) -> RejectionResult:
    """`rejection_sample` for rows that are all greedy, from argmaxes alone (no V-wide work).

    With one-hot p at t = argmax: a draft d is accepted iff p(d) = 1, i.e. d = t, whatever
    the uniform and whatever q (u q(d) < p(d) holds iff p(d) = 1 since u < 1, q <= 1); the
    residual max(0, p - q) at a rejection is one-hot at t (or, with no mass left, p itself,
    also one-hot at t); the bonus is t at position K. So rows accept their longest prefix
    of drafts equal to the target's argmaxes and then emit the next argmax: exactly what
    `rejection_sample` returns on `logits_to_probs` one-hots of the same logits (same
    argmax, same tie-breaking), which `tests/test_rejection.py` checks against it.
    No noise is drawn (greedy rows ignore it). The comparison runs on the host (a few
    Python integers a row: cheaper than a dozen tiny tensor ops), one transfer in, one out.
    """
    batch, k_max = draft_tokens.shape
    counts = num_draft_tokens.tolist() if isinstance(num_draft_tokens, torch.Tensor) else list(num_draft_tokens)
    drafts = [d[:n] for d, n in zip(draft_tokens.tolist(), counts)]
    accepted, emitted = greedy_accept(target_argmax.tolist(), drafts)
    return _host_result(accepted, emitted, k_max, draft_tokens.device)


def _host_result(accepted: list[int], emitted: list[list[int]], k_max: int, device) -> RejectionResult:
    """A RejectionResult from host lists: accepted drafts per row and the tokens it emits."""
    output = [e + [-1] * (k_max + 1 - len(e)) for e in emitted]
    accepted_len = torch.tensor(accepted, dtype=torch.int64, device=device)
    return RejectionResult(torch.tensor(output, dtype=torch.int64, device=device).view(len(emitted), k_max + 1),
                           accepted_len + 1, accepted_len)


def greedy_accept(target_argmax: Sequence[Sequence[int]],
                  drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """`greedy_verify` on host lists: row r's argmaxes (at least len(drafts[r]) + 1 of them)
    and its drafts -> (accepted prefix length, emitted tokens: the accepted drafts, then the
    next argmax) per row. The engine's all-greedy path: no tensor is built a round (after a
    decode pass streams the weights, each small tensor operation runs with cold caches)."""
    accepted, emitted = [], []
    for t, d in zip(target_argmax, drafts):
        a, n = 0, len(d)
        while a < n and d[a] == t[a]:
            a += 1
        accepted.append(a)
        emitted.append(list(d[:a]) + [t[a]])
    return accepted, emitted


def _accept_mask(
    target_probs: torch.Tensor,        # (B, K + 1, V)
    draft_tokens: torch.Tensor,        # (B, K) valid ids everywhere
    draft_probs: torch.Tensor | None,  # (B, K, V) or None
    uniform: torch.Tensor,             # (B, K) in [0, 1)
) -> torch.Tensor:                     # (B, K) bool, before masking padding
    """u < p(d) / q(d), written u * q(d) < p(d): accept with probability min(1, p(d)/q(d))."""
    k_max = draft_tokens.shape[1]
    index = draft_tokens[:, :, None]                                       # (B, K, 1)
    p_draft = target_probs[:, :k_max].gather(-1, index).squeeze(-1)       # (B, K)
    if draft_probs is None:
        # q is one-hot at d, q(d) = 1: accept with probability min(1, p(d)) = p(d).
        return uniform < p_draft
    q_draft = draft_probs.gather(-1, index).squeeze(-1)                    # (B, K)
    # p(d) = 0 never accepts (u * q >= 0); q(d) = 0 < p(d) always does (ratio infinite).
    return uniform * q_draft < p_draft


def _final_distribution(
    target_probs: torch.Tensor,        # (B, K + 1, V)
    draft_tokens: torch.Tensor,        # (B, K)
    draft_probs: torch.Tensor | None,  # (B, K, V) or None
    accepted_len: torch.Tensor,        # (B,)
    num_draft: torch.Tensor,           # (B,)
) -> torch.Tensor:                     # (B, V) unnormalised weights for the race
    """The residual at the first rejected position, else the target at the bonus position.

    Unnormalised: the race divides by the total anyway. If a residual is empty (total
    mass ~0) we sample from p instead. That only happens when p <= q everywhere that
    matters, i.e. p == q (both sum to 1), where every draft has p(d)/q(d) = 1 and u < 1
    accepts it: a rejection there has probability zero and can only come from float
    rounding in p and q, so any token from p is as good and never yields a NaN.
    """
    batch, num_positions, _ = target_probs.shape
    rows = torch.arange(batch, device=target_probs.device)
    p_stop = target_probs[rows, accepted_len]                           # (B, V)
    if num_positions == 1:
        return p_stop  # K = 0: every row decodes plainly
    draft_pos = accepted_len.clamp(max=num_positions - 2)               # (B,) in [0, K)
    d_stop = draft_tokens[rows, draft_pos]                              # (B,)
    if draft_probs is None:
        residual = _residual_one_hot(p_stop, d_stop)
    else:
        residual = _residual(p_stop, draft_probs[rows, draft_pos])
    rejected = accepted_len < num_draft                                 # (B,)
    usable = residual.sum(dim=-1) > _MIN_RESIDUAL_MASS                  # (B,)
    return torch.where((rejected & usable)[:, None], residual, p_stop)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), rows (B, V), unnormalised."""
    return (p - q).clamp_min_(0.0)


def _residual_one_hot(p: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """max(0, p - onehot(d)) for rows p (B, V) and tokens d (B,), without the one-hot.

    p - onehot(d) is p - 1 <= 0 at d and p elsewhere, so the residual is p with p(d)
    zeroed; normalised, that is p conditioned on x != d. Check: P(x) = p(d)[x = d] +
    (1 - p(d)) p(x)[x != d] / (1 - p(d)) = p(x).
    """
    return p.scatter(-1, draft[:, None], 0.0)


def _assemble(draft_tokens: torch.Tensor, accepted_len: torch.Tensor,
              final_token: torch.Tensor) -> RejectionResult:
    """Accepted drafts, then the final token at index accepted_len, then -1."""
    batch, k_max = draft_tokens.shape
    positions = torch.arange(k_max + 1, device=draft_tokens.device)           # (K + 1,)
    padded = torch.nn.functional.pad(draft_tokens, (0, 1))                    # (B, K + 1)
    output = torch.where(positions[None, :] < accepted_len[:, None], padded, -1)
    output.scatter_(1, accepted_len[:, None], final_token[:, None])
    return RejectionResult(output, accepted_len + 1, accepted_len)


def _check_inputs(target_probs, draft_tokens, draft_probs, num_draft_tokens) -> list[int] | None:
    """Reject malformed inputs early; returns the counts if they are on the host (else None)."""
    if target_probs.dim() != 3 or target_probs.shape[1] < 1:
        raise ValueError(f"target_probs must be (B, K + 1, V), got {tuple(target_probs.shape)}")
    batch, num_positions, vocab = target_probs.shape
    k_max = num_positions - 1
    if tuple(draft_tokens.shape) != (batch, k_max):
        raise ValueError(f"draft_tokens must be (B, K) = {(batch, k_max)}, got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k_max, vocab):
        raise ValueError(f"draft_probs must be (B, K, V) = {(batch, k_max, vocab)} or None, "
                         f"got {tuple(draft_probs.shape)}")
    if isinstance(num_draft_tokens, torch.Tensor) and num_draft_tokens.device.type != "cpu":
        if tuple(num_draft_tokens.shape) != (batch,):
            raise ValueError(f"num_draft_tokens must be (B,) = ({batch},), got {tuple(num_draft_tokens.shape)}")
        return None  # values are checked only where reading them costs no device sync
    counts = [int(n) for n in (num_draft_tokens.tolist() if isinstance(num_draft_tokens, torch.Tensor)
                               else num_draft_tokens)]
    if len(counts) != batch or any(not 0 <= n <= k_max for n in counts):
        raise ValueError(f"num_draft_tokens must be {batch} integers in [0, K={k_max}], got {counts}")
    return counts
