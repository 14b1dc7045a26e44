"""The EAGLE-style head proposer: drafts a chain from the target's own hidden states.

The head (verispec.model.eagle) has one layer of KV, in its own store indexed by the SAME
slots as the target's (the request's block table), like the draft model's. Its entry i
reads the token t_{i+1} and the feature f_i, and predicts t_{i+2}:

    position i        0    1   ...  N-2       N-1        N        (N = req.num_tokens)
    token read        t1   t2  ...  t_{N-1}   d1         d2       (t_{N-1}: the pending token)
    feature read      h0   h1  ...  h_{N-2}   g_{N-2}    g_{N-1}  (h: target; g: head output)
    entry predicts    t2   t3  ...  d1        d2         d3
                      |-------- exact --------|-- provisional --|

Exact entries use only committed tokens and the target's features (`observe` stores
those after every target pass, for positions the head has not consumed yet); they are
`_Row.computed`. Provisional entries chain the head's own output feature and are
rewritten next round: after verification only positions < req.num_computed hold the
target's verified features, and `rollback` trims both the features kept and `computed`
there (a feature of a rejected draft's position must never be read).

Positions the target never computed for this request (a prompt prefix served by the
prefix cache) have no feature: the head reads a zero vector there (their tokens only).
A preempted request (req.num_computed fell below `computed`) recomputes its head KV (its
blocks may have moved) from the features its prefill recomputes, zeros for a cached prefix.

q over the target's vocabulary is the head's distribution over its N tokens scattered
into V (-inf logits elsewhere), through the target's own logits-to-probs transform:
zero outside the subset, so the rejection sampler's residual max(0, p - q) covers those
tokens and verification stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import torch

from verispec.engine.runner import row_metadata
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
        head.pack(ops)  # a bf16 target on the kernels: the head too (half its bytes a pass)
    return EagleProposer(head, target, context.block_table, context.shared_generator)


@dataclass
class _Row:
    """Per request: head KV entries [0, computed) are exact; `features` holds the target's
    final hidden states of positions [start, start + len) not consumed yet, as chunks."""

    computed: int = 0
    start: int = 0
    chunks: list[torch.Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + sum(c.shape[0] for c in self.chunks)


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
        self.vocab = target.vocab_limit or target.model.cfg.vocab_size
        self.rows: dict[str, _Row] = {}
        self.catch_up_tokens = 0

    # ------------------------------------------------------------------ state
    def _row(self, req: Request) -> _Row:
        row = self.rows.setdefault(req.request_id, _Row())
        if row.computed > req.num_computed:  # preempted: its head KV may sit in other blocks now
            row.computed = 0
        return row

    def observe(self, reqs: list[Request], starts: list[int], hidden: list[torch.Tensor]) -> None:
        """After a target pass: hidden[i] (n_i, H) is the target's at positions starts[i]..;
        kept until the head consumes it (a rejected draft's position is trimmed by rollback)."""
        for req, start, h in zip(reqs, starts, hidden):
            row = self._row(req)
            _trim(row, start)  # a rerun of these positions replaces what was kept
            if not row.chunks:
                row.start = start
            elif row.end < start:  # a gap (cannot happen within one admission): zeros there
                row.chunks.append(h.new_zeros(start - row.end, h.shape[1]))
            row.chunks.append(h.clone())  # not a view: the pass's other rows are not kept alive

    def rollback(self, req: Request) -> None:
        """Only positions < req.num_computed are verified: keep their features and entries."""
        row = self.rows.get(req.request_id)
        if row is not None:
            _trim(row, req.num_computed)
            row.computed = min(row.computed, req.num_computed)

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        """For /metrics: head entries computed by catch-ups since start, features kept now."""
        return {"catch_up_tokens_total": self.catch_up_tokens,
                "kept_features": sum(row.end - row.start for row in self.rows.values())}

    # ------------------------------------------------------------------ offer, catch-up
    def offer(self, rows: list[Request], budgets: list[int]) -> list[Offer]:
        return [Offer(b, self.missing(r)) for r, b in zip(rows, budgets)]

    def missing(self, req: Request) -> int:
        """Exact entries a catch-up would compute (all but the last one a round computes),
        when more are missing than a round leaves; else 0."""
        row = self.rows.get(req.request_id)
        computed = 0 if row is None or row.computed > req.num_computed else row.computed
        n = req.num_tokens - 2 - computed
        return n if n > ROUND_ENTRIES else 0

    def prepare(self, reqs: list[Request]) -> int:
        """Compute every missing exact entry but the last (the round's `draft` does that one)."""
        todo = [(r, self._row(r)) for r in reqs if self.missing(r)]
        if not todo:
            return 0
        spans = [(row, row.computed, r.num_tokens - 2) for r, row in todo]
        self._pass([r for r, _ in todo], [lo for _, lo, _ in spans],
                   [r.all_ids[lo + 1: hi + 1] for (r, _), (_, lo, hi) in zip(todo, spans)], self._features(spans))
        for row, _, hi in spans:
            row.computed = hi
            _consume(row, hi - 1)
        done = sum(hi - lo for _, lo, hi in spans)
        self.catch_up_tokens += done
        return done

    def _features(self, spans: list[tuple[_Row, int, int]]) -> torch.Tensor:
        """(sum of hi - lo, H): the features of positions lo..hi-1 of each (row, lo, hi) in
        turn, the target's where kept, zeros where not."""
        out = torch.zeros(sum(hi - lo for _, lo, hi in spans), self.head.cfg.hidden_size, device=self.target.device)
        offset = 0
        for row, lo, hi in spans:
            pos = row.start
            for c in row.chunks:
                a, b = max(lo, pos), min(hi, pos + c.shape[0])
                if a < b:
                    out[offset + a - lo: offset + b - lo] = c[a - pos: b - pos]
                pos += c.shape[0]
            offset += hi - lo
        return out

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
        rows = [self._row(r) for r in reqs]
        starts = [min(row.computed, r.num_tokens - 2) for r, row in zip(reqs, rows)]
        features = self._features([(row, lo, r.num_tokens - 1) for r, row, lo in zip(reqs, rows, starts)])
        for r, row in zip(reqs, rows):
            row.computed = r.num_tokens - 1
            _consume(row, row.computed - 1)  # the last exact entry's feature stays for a rerun
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


def _trim(row: _Row, end: int) -> None:
    """Drop kept features of positions >= end."""
    keep, pos = [], row.start
    for c in row.chunks:
        if pos >= end:
            break
        keep.append(c[: end - pos])
        pos += c.shape[0]
    row.chunks = keep


def _consume(row: _Row, upto: int) -> None:
    """Drop kept features of positions < upto (their entries are computed)."""
    keep, pos = [], row.start
    for c in row.chunks:
        if pos + c.shape[0] > upto:
            keep.append(c[max(0, upto - pos):])
        pos += c.shape[0]
    row.chunks = keep
    row.start = max(row.start, upto) if keep else upto
