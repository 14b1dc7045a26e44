"""Deliberately broken pieces, injected into the engine to prove the gates can fail."""
from __future__ import annotations

import torch

import verispec.engine.engine as engine_mod
import verispec.spec.draft_model as draft_model_mod
from verispec.spec.draft_model import DraftModelProposer
from verispec.spec.eagle import EagleProposer
from verispec.spec.rejection import RejectionResult

_real_rejection_sample = engine_mod.rejection_sample
_real_draft_sample = draft_model_mod.sample


def _from_p(probs: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(probs, 1).squeeze(-1)


def skip_acceptance_test(target_probs, draft_tokens, draft_probs, num_draft, *args, **kw):
    """Accept every draft token, then a bonus token from p."""
    num = torch.as_tensor(num_draft)
    rows = torch.arange(draft_tokens.shape[0])
    out = torch.cat([draft_tokens, torch.full_like(draft_tokens[:, :1], -1)], dim=1)
    out[rows, num] = _from_p(target_probs[rows, num])
    return RejectionResult(out, num + 1, num)


def resample_from_p(target_probs, draft_tokens, draft_probs, num_draft, *args, **kw):
    """On rejection draw the replacement from p instead of the residual norm(max(0, p - q))."""
    res = _real_rejection_sample(target_probs, draft_tokens, draft_probs, num_draft, *args, **kw)
    num = torch.as_tensor(num_draft)
    rows = torch.arange(draft_tokens.shape[0])
    rejected = res.accepted_len < num
    fresh = _from_p(target_probs[rows, res.accepted_len])
    out = res.output_tokens.clone()
    out[rows, res.accepted_len] = torch.where(rejected, fresh, out[rows, res.accepted_len])
    return res._replace(output_tokens=out)


def drop_bonus(target_probs, draft_tokens, draft_probs, num_draft, *args, **kw):
    """Forget the bonus token when every draft was accepted."""
    res = _real_rejection_sample(target_probs, draft_tokens, draft_probs, num_draft, *args, **kw)
    all_accepted = (res.accepted_len == torch.as_tensor(num_draft)) & (res.accepted_len > 0)
    return res._replace(num_output=torch.where(all_accepted, res.accepted_len, res.num_output))


def double_bonus(target_probs, draft_tokens, draft_probs, num_draft, *args, **kw):
    """Emit the bonus token twice when every draft was accepted."""
    res = _real_rejection_sample(target_probs, draft_tokens, draft_probs, num_draft, *args, **kw)
    all_accepted = (res.accepted_len == torch.as_tensor(num_draft)) & (res.accepted_len > 0)
    rows = torch.arange(draft_tokens.shape[0])
    out = torch.cat([res.output_tokens, torch.full_like(res.output_tokens[:, :1], -1)], dim=1)
    bonus = out[rows, res.accepted_len]
    out[rows, res.accepted_len + 1] = torch.where(all_accepted, bonus, out[rows, res.accepted_len + 1])
    return RejectionResult(out, torch.where(all_accepted, res.num_output + 1, res.num_output), res.accepted_len)


def top_p_on_target_only(monkeypatch, top_p: float) -> None:
    """Drafts are drawn from the top-p-filtered q, but the verifier is handed q without top-p.

    (Handing the verifier the very q the drafts were drawn from is exact for ANY q, top-p or
    not; the bug is the mismatch between the two.)
    """
    def unfiltered(self, st, logits):
        return st.__class__(st.temperature, st.top_k, torch.ones_like(st.top_p), st.min_p,
                            st.use_sort, st.use_min_p).to_probs(logits)

    def sample_top_p(probs, generators, **kw):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        filtered = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        return _real_draft_sample(filtered / filtered.sum(-1, keepdim=True), generators, **kw)

    monkeypatch.setattr(DraftModelProposer, "to_probs", unfiltered)
    monkeypatch.setattr(draft_model_mod, "sample", sample_top_p)


def keep_stale_draft_kv(self, req, base: int, accepted: int, k: int) -> None:
    """After a rejection keep the rejected draft tokens' KV as if it were verified context.

    The target's next pass then conditions on tokens that are not in the output. With a
    draft model the draft's own position also runs past the row's tokens and the request
    fails with an error, so the gates inject this with prompt lookup, where it is silent.
    """
    req.num_computed = base + 1 + k
    proposer = self.proposers.get(req.spec_method)
    if proposer is not None:
        proposer.rollback(req)


def eagle_full_vocab_q(monkeypatch) -> None:
    """The head drafts from its distribution over its vocabulary subset, but hands the
    verifier q renormalised over the full vocabulary (logit 0 for every token outside the
    subset instead of -inf): q is then not the distribution the drafts were drawn from."""
    import verispec.spec.eagle as eagle_mod
    real_to_probs, real_sample, drawn_from = EagleProposer.to_probs, eagle_mod.sample, []

    def to_probs(self, st, logits):
        drawn_from[:] = [real_to_probs(self, st, logits)]
        return real_to_probs(self, st, logits.masked_fill(torch.isinf(logits), 0.0))

    monkeypatch.setattr(EagleProposer, "to_probs", to_probs)
    monkeypatch.setattr(eagle_mod, "sample", lambda probs, keys, **kw: real_sample(drawn_from[0], keys, **kw))


def eagle_stale_head_kv(monkeypatch) -> None:
    """After verification the head keeps its provisional entries (drafted positions, read
    from its own features and the drafted tokens) as if they were exact."""
    def rollback(self, req):
        if req.request_id in self.computed:
            self.computed[req.request_id] = req.num_computed
    monkeypatch.setattr(EagleProposer, "rollback", rollback)


SAMPLER_BUGS = {
    "skip_acceptance_test": skip_acceptance_test,
    "resample_from_p": resample_from_p,
    "drop_bonus": drop_bonus,
    "double_bonus": double_bonus,
}


def _greedy_through(sampler):
    """The engine's all-greedy path (`greedy_accept`) carrying the same bug: the argmaxes as
    one-hot distributions through the broken sampler."""
    def greedy_accept(target_argmax, drafts):
        k_max = max(len(t) for t in target_argmax) - 1
        argmax = torch.tensor([list(t) + [0] * (k_max + 1 - len(t)) for t in target_argmax])
        draft_tokens = torch.tensor([list(d) + [0] * (k_max - len(d)) for d in drafts]).view(len(drafts), k_max)
        vocab = int(max(argmax.max(), draft_tokens.max() if draft_tokens.numel() else 0)) + 1
        p = torch.nn.functional.one_hot(argmax, vocab).float()
        result = sampler(p, draft_tokens, None, [len(d) for d in drafts])
        emitted = [e[:n] for e, n in zip(result.output_tokens.tolist(), result.num_output.tolist())]
        return result.accepted_len.tolist(), emitted
    return greedy_accept


def inject(monkeypatch, bug: str, top_p: float = 1.0) -> None:
    if bug in SAMPLER_BUGS:
        monkeypatch.setattr(engine_mod, "rejection_sample", SAMPLER_BUGS[bug])
        monkeypatch.setattr(engine_mod, "greedy_accept", _greedy_through(SAMPLER_BUGS[bug]))
    elif bug == "top_p_on_target_only":
        top_p_on_target_only(monkeypatch, top_p)
    elif bug == "stale_draft_kv":
        monkeypatch.setattr(engine_mod.LLMEngine, "_rollback", keep_stale_draft_kv)
    elif bug == "eagle_full_vocab_q":
        eagle_full_vocab_q(monkeypatch)
    elif bug == "eagle_stale_head_kv":
        eagle_stale_head_kv(monkeypatch)
    else:
        raise KeyError(bug)
