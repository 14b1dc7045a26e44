"""The draft-model proposer: a smaller model with the same tokenizer.

Its KV lives in its own preallocated store, indexed by the SAME slots as the target's (the
same block tables), so it needs no block manager of its own. `Request.draft_computed` is
the draft's KV length; after a verify round it is rolled back to the verified length
(O(1): positions past it are rewritten before they are read again).

The draft's KV is filled lazily: prompts are prefilled by the target alone, and a request
that never drafts (plain rows, n-gram rows, rows the policy keeps at k = 0) never runs
the draft model at all. When a request drafts, `catch_up` (the interface's `prepare`)
first computes everything its draft KV lacks (the prompt on its first draft, the tokens
decoded since it last drafted), in passes of at most `chunk_tokens`; then each draft
call feeds the one or two tokens a round leaves unseen (the pending token, plus the last
accepted draft after a fully accepted round) and drafts autoregressively. The engine
times catch-ups apart from drafting: they are one-off costs, not the per-round cost the
policy weighs.
"""
from __future__ import annotations

import torch

from verispec.engine.runner import ModelRunner, RowInput
from verispec.model import kernels
from verispec.request import Request
from verispec.sampling import SamplingTensors, noise_key, sample
from verispec.spec.proposer import Offer


class DraftModelProposer:
    """A `Proposer`: `prepare` is the catch-up, `draft` the autoregressive loop."""

    name = "draft"
    timed = True       # a draft pass costs a fraction of a target step: priced by the policy
    has_probs = True
    eos_ids: tuple[int, ...] = ()  # what min_tokens bans besides stop_token_ids (set by the engine)

    def __init__(self, runner: ModelRunner, block_table, shared_generator: torch.Generator | None = None,
                 chunk_tokens: int = 512):
        self.runner = runner
        self.block_table = block_table  # seq_id -> list[int]
        self.shared_generator = shared_generator
        self.chunk_tokens = chunk_tokens  # most tokens one catch-up pass computes
        self.catch_up_tokens = 0          # tokens computed by catch-ups so far

    def offer(self, rows: list[Request], budgets: list[int]) -> list[Offer]:
        """Every row may draft its whole budget, after catching up on what its KV lacks."""
        return [Offer(b, self.missing(r)) for r, b in zip(rows, budgets)]

    def prepare(self, rows: list[Request]) -> int:
        return self.catch_up(rows)

    def forget(self, request_id: str) -> None:
        """Nothing kept per request here: its draft KV length lives on the request."""

    @staticmethod
    def missing(req: Request) -> int:
        """Tokens a catch-up would compute for the request: those its draft KV lacks before
        the pending token, when more are missing than a round leaves (one); else 0."""
        n = req.num_tokens - 1 - req.draft_computed
        return n if n > 1 else 0

    def catch_up(self, reqs: list[Request]) -> int:
        """Fill each request's draft KV up to the token before its pending one (`missing`);
        no logits are computed. Returns the tokens computed."""
        todo = [r for r in reqs if self.missing(r)]
        done = 0
        while todo:
            rows, budget = [], self.chunk_tokens
            for req in todo:
                if budget <= 0:
                    break
                end = min(req.num_tokens - 1, req.draft_computed + budget)
                tokens = req.all_ids[req.draft_computed:end]
                rows.append(RowInput(tokens, req.draft_computed, self.block_table(req.request_id), len(tokens)))
                req.draft_computed = end
                budget -= len(tokens)
            self.runner.forward(rows)
            done += sum(len(r.token_ids) for r in rows)
            todo = [r for r in todo if r.draft_computed < r.num_tokens - 1]
        self.catch_up_tokens += done
        return done

    def draft(self, reqs: list[Request], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Draft ks[i] tokens for reqs[i]; returns (tokens, q (k_i, V)) per request.

        A seeded row drafts d = race(q, u(seed, j)) at output position j, with the very noise
        the verifier races p with there (`seeded_verify`): when q is close to p, d is
        likely the target's own choice. When every request is greedy, q is one-hot at each drafted token (temperature 0), so
        the tokens are argmaxes and q is returned as None, which the verifier reads as that
        one-hot: the same proposals and the same verdicts without V-wide softmax and sampling.
        """
        if all(r.params.greedy for r in reqs):
            return [(tokens, None) for tokens in self._draft(reqs, ks, None)]
        probs_out: list[list[torch.Tensor]] = [[] for _ in reqs]
        tokens_out = self._draft(reqs, ks, probs_out)
        return [(t, torch.stack(p)) for t, p in zip(tokens_out, probs_out)]

    def _draft(self, reqs: list[Request], ks: list[int], probs_out: list[list[torch.Tensor]] | None) -> list[list[int]]:
        """The autoregressive loop; appends each step's q to probs_out (None: greedy argmax)."""
        tokens_out: list[list[int]] = [[] for _ in reqs]
        active = list(range(len(reqs)))
        while active:
            rows = []
            for i in active:
                req, drafted = reqs[i], tokens_out[i]
                table = self.block_table(req.request_id)
                if not drafted:  # catch up on every token not seen yet, pending one included
                    tokens = req.all_ids[req.draft_computed:]
                    rows.append(RowInput(tokens, req.draft_computed, table, len(tokens) - 1))
                else:            # the last drafted token sits after the pending token's position
                    rows.append(RowInput(drafted[-1:], req.num_tokens - 1 + len(drafted), table, 0))
            logits = torch.cat(self.runner.forward(rows))  # (B, V): one scored position per row
            if probs_out is None and not any(reqs[i].params.has_processors for i in active):
                drawn = kernels.greedy_tokens(logits, self.runner.model.kernels)
            elif probs_out is None:  # greedy: the argmax of the processed logits
                drawn = kernels.greedy_tokens(self.tensors(reqs, active, tokens_out, logits.device)
                                              .process(logits), self.runner.model.kernels)
            else:
                st = self.tensors(reqs, active, tokens_out, logits.device)
                probs = self.to_probs(st, logits)           # (B, V)
                keys = [noise_key(reqs[i].params, len(reqs[i].output_ids) + len(tokens_out[i])) for i in active]
                drawn = sample(probs, keys, shared_generator=self.shared_generator).tolist()
                for j, i in enumerate(active):
                    probs_out[i].append(probs[j])
            for j, i in enumerate(active):
                tokens_out[i].append(drawn[j])
                reqs[i].draft_computed = rows[j].end
            active = [i for i in active if len(tokens_out[i]) < ks[i]]
        return tokens_out

    def tensors(self, reqs: list[Request], active: list[int], tokens_out: list[list[int]],
                device) -> SamplingTensors:
        return draft_sampling_tensors(reqs, active, tokens_out, device, self.eos_ids)

    def to_probs(self, st: SamplingTensors, logits: torch.Tensor) -> torch.Tensor:
        """q: exactly the target's logits -> probs transform (tests patch this to inject bugs)."""
        return st.to_probs(logits)

    @staticmethod
    def rollback(req: Request) -> None:
        """After verification only the verified positions of the draft's KV stay valid."""
        req.draft_computed = min(req.draft_computed, req.num_computed)


def draft_sampling_tensors(reqs: list[Request], active: list[int], tokens_out: list[list[int]], device,
                           eos_ids) -> SamplingTensors:
    """The active rows' SamplingTensors at their next draft position: the tokens drafted so
    far this round count as generated (as they will have been, if accepted)."""
    params = [reqs[i].params for i in active]
    histories = [(reqs[i].prompt_ids, reqs[i].output_ids + tokens_out[i]) if reqs[i].params.has_processors
                 else None for i in active]
    return SamplingTensors.from_params(params, device, histories, eos_ids, [reqs[i].grammar for i in active])
