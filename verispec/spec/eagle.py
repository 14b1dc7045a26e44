"""The EAGLE-style head proposer: drafts a chain from the target's own hidden states.

The head (verispec.model.eagle) has one layer of KV, in its own store indexed by the SAME
slots as the target's (the request's block table), like the draft model's. Its entry i
reads the token t_{i+1} and the feature f_i, and predicts t_{i+2}:

    position i        0    1   ...  N-2       N-1        N        (N = req.num_tokens)
    token read        t1   t2  ...  t_{N-1}   d1         d2       (t_{N-1}: the pending token)
    feature read      h0   h1  ...  h_{N-2}   g_{N-2}    g_{N-1}  (h: target; g: head output)
    entry predicts    t2   t3  ...  d1        d2         d3
                      |-------- exact --------|-- provisional --|

Exact entries use only committed tokens and the target's features; they are the
request's `computed` count. Provisional entries chain the head's own output feature and
are rewritten next round: after verification only positions < req.num_computed are
verified, and `rollback` trims `computed` there.

The target's features live beside its KV: a store indexed by the same slots, written by
`observe` after every target pass for every row in it (from the engine's first request
for the head on; slots computed before then read zeros), so a slot's feature and its KV
are always from the same computation. Whatever makes a slot's KV valid (committed tokens, a
prefix cached by another request) makes its feature valid, and a rejected draft's feature
is rewritten, as its KV is, before any exact entry reads it. A preempted request
(req.num_computed fell below `computed`) recomputes its head KV: its blocks may have moved.
Unlike the target's, an entry depends on the token after its position: two running
requests that share a full block and differ at the next block's first token write
different entries at that block's last slot, and one drafts from the other's (a worse
draft, never a wrong output: verification reads only the target).

q over the target's vocabulary is the head's distribution over its N tokens scattered
into V (-inf logits elsewhere), through the target's own logits-to-probs transform:
zero outside the subset, so the rejection sampler's residual max(0, p - q) covers those
tokens and verification stays exact.
"""
from __future__ import annotations

from itertools import accumulate
from pathlib import Path

import torch

from verispec.engine.runner import block_slots, row_metadata
from verispec.model.eagle import EagleHead, load_head
from verispec.request import Request
from verispec.sampling import SamplingTensors, noise_key, sample
from verispec.spec.draft_model import draft_sampling_tensors
from verispec.spec.policy import MAX_SPEC_TOKENS
from verispec.spec.proposer import Offer, ProposerContext, ProposerUnavailable


def heads_root() -> Path:
    """Where `verispec train-draft eagle` exports a model's head and `--spec eagle` finds it:
    <VERISPEC_CACHE>/heads/<target registry name>/ (beside the registered drafts)."""
    from verispec.model.fetch import cache_root
    return cache_root() / "heads"
# A round leaves at most this many exact entries to compute (pending + every accepted draft);
# more is a one-off catch-up (`prepare`), timed apart from drafting.
ROUND_ENTRIES = MAX_SPEC_TOKENS + 1


def registered_head(model: str) -> Path | None:
    """The head committed for registry model `model`, or None."""
    path = heads_root() / model
    return path if (path / "head.json").is_file() else None


def build_eagle(context: ProposerContext) -> "EagleProposer":
    """The proposer over `--draft-head` or the model's registered head; ProposerUnavailable else."""
    cfg = context.config
    path = getattr(cfg, "draft_head", None) or registered_head(cfg.model)
    if path is None:
        raise ProposerUnavailable(f"speculative method 'eagle' needs a draft head: --draft-head DIR "
                                  f"(none is registered for {cfg.model!r}; `verispec train-draft eagle` "
                                  "trains one)")
    target = context.target
    if target is None or not getattr(target, "returns_hidden", False):
        raise ProposerUnavailable("speculative method 'eagle' needs the target's hidden states, which "
                                  "this target runner does not return (tensor parallelism)")
    head = load_head(path, target.device)
    head.bind(target.model.embed_tokens)
    ops = target.model.kernels
    if ops is not None and ops.bf16_vector and target.model.embed_tokens.weight.dtype == torch.bfloat16:
        # a bf16 target on the kernels: the head too, in int4 where the target's layers are
        int4 = target.model.weight_format in ("int4", "int4a8") and ops.int4_vector
        head.pack(ops, int4)
    return EagleProposer(head, target, context.block_table, context.shared_generator)


class EagleProposer:
    """A `Proposer` that wants the target's hidden states (`wants_hidden`, `observe`)."""

    name = "eagle"
    timed = True        # a head pass costs a (small) fraction of a target step: priced
    has_probs = True
    wants_hidden = True
    eos_ids: tuple[int, ...] = ()  # what min_tokens bans besides stop_token_ids (set by the engine)

    def __init__(self, head: EagleHead, target, block_table, shared_generator: torch.Generator | None = None):
        self.head = head
        self.target = target              # the target's ModelRunner: slots, vocabulary, device
        self.block_table = block_table    # seq_id -> list[int]
        self.shared_generator = shared_generator
        self.kv = head.new_kv_store(target.kv.num_slots, target.device)
        self._features_by_slot: torch.Tensor | None = None  # `features`, made on first use
        self.vocab = target.vocab_limit or target.model.cfg.vocab_size
        self.computed: dict[str, int] = {}  # request id -> its exact head entries
        self.catch_up_tokens = 0

    # ------------------------------------------------------------------ state
    @property
    def features(self) -> torch.Tensor:
        """(slots, H): the target's final hidden state at each KV slot, in the dtype the head
        reads it in; allocated by the first use (a server that never drafts with the head
        holds none)."""
        if self._features_by_slot is None:
            self._features_by_slot = torch.zeros(self.target.kv.num_slots, self.head.cfg.hidden_size,
                                                 dtype=self.head.dtype, device=self.target.device)
        return self._features_by_slot

    def _computed(self, req: Request) -> int:
        computed = self.computed.get(req.request_id, 0)
        return 0 if computed > req.num_computed else computed  # preempted: recompute

    def observe(self, reqs: list[Request], starts: list[int], hidden: list[torch.Tensor]) -> None:
        """After a target pass over every row in it: hidden[i] (n_i, H) is the target's at
        positions starts[i].. of reqs[i], stored at those positions' KV slots."""
        bs = self.target.block_size
        slots = [s for req, start, h in zip(reqs, starts, hidden)
                 for s in block_slots(self.block_table(req.request_id), start, start + h.shape[0], bs)]
        if slots:
            self.features.index_copy_(0, torch.tensor(slots, device=self.features.device),
                                      torch.cat(hidden).to(self.features.dtype))

    def rollback(self, req: Request) -> None:
        """Only positions < req.num_computed are verified: entries past them are not exact."""
        if req.request_id in self.computed:
            self.computed[req.request_id] = min(self.computed[req.request_id], req.num_computed)

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        """For /metrics: head entries computed by catch-ups since start."""
        return {"catch_up_tokens_total": self.catch_up_tokens}

    # ------------------------------------------------------------------ offer, catch-up
    def offer(self, rows: list[Request], budgets: list[int]) -> list[Offer]:
        return [Offer(b, self.missing(r)) for r, b in zip(rows, budgets)]

    def missing(self, req: Request) -> int:
        """Exact entries a catch-up would compute (all but the last one a round computes),
        when more are missing than a round leaves; else 0."""
        n = req.num_tokens - 2 - self._computed(req)
        return n if n > ROUND_ENTRIES else 0

    def prepare(self, reqs: list[Request]) -> int:
        """Compute every missing exact entry but the last (the round's `draft` does that one)."""
        spans = [(r, self._computed(r), r.num_tokens - 2) for r in reqs if self.missing(r)]
        if not spans:
            return 0
        self._pass([r for r, _, _ in spans], [lo for _, lo, _ in spans],
                   [r.all_ids[lo + 1: hi + 1] for r, lo, hi in spans], self._gather_features(spans))
        for r, _, hi in spans:
            self.computed[r.request_id] = hi
        done = sum(hi - lo for _, lo, hi in spans)
        self.catch_up_tokens += done
        return done

    def _gather_features(self, spans: list[tuple[Request, int, int]]) -> torch.Tensor:
        """(sum of hi - lo, H): the target's features of positions lo..hi-1 of each
        (request, lo, hi) in turn, from the slot store."""
        bs = self.target.block_size
        slots = [s for req, lo, hi in spans for s in block_slots(self.block_table(req.request_id), lo, hi, bs)]
        return self.features[torch.tensor(slots, device=self.features.device)]

    # ------------------------------------------------------------------ drafting
    def draft(self, reqs: list[Request], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """ks[i] tokens for reqs[i] with q (k_i, V), or q None when every row is greedy (the
        argmax over the subset: the verifier reads None as one-hot)."""
        greedy = all(r.params.greedy for r in reqs)
        probs_out: list[list[torch.Tensor]] | None = None if greedy else [[] for _ in reqs]
        tokens_out: list[list[int]] = [[] for _ in reqs]
        limits = list(ks)
        active = list(range(len(reqs)))
        logits, feats = self._pass(reqs, *self._round_entries(reqs))            # (B, N), (B, H)
        while True:
            drawn = self._choose(reqs, active, tokens_out, logits, probs_out)
            going = []  # indices into this pass of the rows that draft on
            for j, i in enumerate(active):
                if drawn[j] is None:  # no admissible token in the head's vocabulary: stop here
                    limits[i] = len(tokens_out[i])
                    continue
                tokens_out[i].append(drawn[j])
                if len(tokens_out[i]) < limits[i]:
                    going.append(j)
            if not going:
                break
            # one token a row from now on: the last pass's output features are the next inputs
            feats = feats if len(going) == len(active) else feats[going]       # (B', H)
            active = [active[j] for j in going]
            nexts = [reqs[i].num_tokens - 2 + len(tokens_out[i]) for i in active]  # the next entries' positions
            logits, feats = self._pass([reqs[i] for i in active], nexts, [[drawn[j]] for j in going], feats)
        if probs_out is None:
            return [(t, None) for t in tokens_out]
        return [(t, torch.stack(p) if p else None) for t, p in zip(tokens_out, probs_out)]

    def _round_entries(self, reqs: list[Request]) -> tuple[list[int], list[list[int]], torch.Tensor]:
        """`_pass`'s starts, tokens and features for the round's exact entries, the last (N-2)
        predicting d1; marks them computed. That one is recomputed if a failed attempt of this
        step already computed it (same inputs, same KV)."""
        starts = [min(self._computed(r), r.num_tokens - 2) for r in reqs]
        features = self._gather_features([(r, lo, r.num_tokens - 1) for r, lo in zip(reqs, starts)])
        for r in reqs:
            self.computed[r.request_id] = r.num_tokens - 1
        return starts, [r.all_ids[lo + 1:] for r, lo in zip(reqs, starts)], features

    def _pass(self, reqs: list[Request], starts: list[int], tokens: list[list[int]], features: torch.Tensor):
        """One head pass: row b reads tokens[b] at positions starts[b].. and their rows of
        `features` (T, H), flat in row order; returns the logits (B, N) and output features
        (B, H) of each row's last entry."""
        q_lens = [len(t) for t in tokens]
        tables = [self.block_table(r.request_id) for r in reqs]
        device = self.target.device
        # Rows go where a target's runner sends them: with a vector attention kernel every row,
        # a catch-up's included, is in the kernel (measured faster than SDPA: kernel_query_limit).
        meta = row_metadata(starts, q_lens, tables, self.target.block_size, device, self.head.kernel_queries)
        ids = torch.tensor([t for row in tokens for t in row], device=device)
        last = None if len(ids) == len(reqs) else torch.tensor([end - 1 for end in accumulate(q_lens)], device=device)
        return self.head(ids, features, meta, self.kv, last)

    def _choose(self, reqs, active, tokens_out, logits: torch.Tensor, probs_out) -> list[int | None]:
        """The next draft token of each active row from the head's logits (B, N) over its subset."""
        vocab_ids = self.head.vocab_ids
        plain = not any(reqs[i].params.has_processors for i in active)
        if probs_out is None and plain:
            return vocab_ids[logits.argmax(-1)].tolist()
        full = self.full_logits(logits)                                            # (B, V)
        st = self.tensors(reqs, active, tokens_out, full.device)
        if probs_out is None:  # greedy with processors: the argmax of the processed logits
            processed = st.process(full)
            ok = torch.isfinite(processed.max(-1).values).tolist()
            return [t if good else None for t, good in zip(processed.argmax(-1).tolist(), ok)]
        probs = self.to_probs(st, full)                                            # (B, V)
        mass = probs.sum(-1)
        good = torch.isfinite(mass) & (mass > 0)                                   # (B,)
        safe = torch.where(good[:, None], probs, probs.new_full((), 1.0))
        ok = good.tolist()
        keys = [noise_key(reqs[i].params, len(reqs[i].output_ids) + len(tokens_out[i])) for i in active]
        drawn = sample(safe, keys, shared_generator=self.shared_generator).tolist()
        for j, i in enumerate(active):
            if ok[j]:
                probs_out[i].append(probs[j])
        return [t if good else None for t, good in zip(drawn, ok)]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's logits (B, N) scattered into the target's vocabulary (B, V), -inf elsewhere."""
        full = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
        return full.index_copy_(1, self.head.vocab_ids, logits)

    def tensors(self, reqs, active, tokens_out, device) -> SamplingTensors:
        return draft_sampling_tensors(reqs, active, tokens_out, device, self.eos_ids)

    def to_probs(self, st: SamplingTensors, logits: torch.Tensor) -> torch.Tensor:
        """q: exactly the target's logits -> probs transform (tests patch this to inject bugs)."""
        return st.to_probs(logits)
