"""The EAGLE-style head: the target's hidden states, the head's drafts, its injected bugs.

Losslessness with the head is in the gates (test_gate_lossless.py: "eagle" settings over a
random head on 10 of 16 tokens; test_gate_greedy.py: a head trained by the pipeline). Here:
the hidden-state hook on every forward path, the head's drafts against a reference that
recomputes them from scratch (dense target pass, dense head chain), and the injected bugs:
  (a) q renormalised over the full vocabulary: caught by G1's statistics at x2;
  (b) the head's provisional entries kept after verification (stale features and KV):
      never a change in the output (q is what the drafts were drawn from, so G1/G2 cannot
      see it, and the test shows G2's identity holding), caught by the reference check.
"""
import sys
from dataclasses import replace

import pytest
import torch

from bugs import inject
from eagle_heads import random_head_dir, trained_head_dir
from test_gate_lossless import BUG_SAMPLES, PAIR, exact_joint, run_gate
from tiny import run_all, tiny_config, tiny_engine, tiny_pair
from verispec.engine.runner import ModelRunner, RowInput, row_metadata
from verispec.model import kernels
from verispec.model.attention import KERNEL_QUERY_LIMIT, AttentionMetadata
from verispec.model.eagle import EagleHead, load_head
from verispec.model.llama import LlamaModel
from verispec.sampling import SamplingParams
from verispec.spec.eagle import EagleProposer
from verispec.train.draft import causal_forward
from verispec.train.eagle import head_forward

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_pair():
    return tiny_pair(vocab=48, noise=0.1, seed=3)


def _rows_meta(rows, block, kernel_queries):
    return AttentionMetadata.build(
        [len(t) for t, _ in rows], [s + len(t) for t, s in rows], [list(range(s, s + len(t))) for t, s in rows],
        [list(range(r * block + s, r * block + s + len(t))) for r, (t, s) in enumerate(rows)],
        [list(range(r * block, r * block + s + len(t))) for r, (t, s) in enumerate(rows)],
        kernel_queries=kernel_queries)


@pytest.mark.parametrize("path", ["plain", "per-layer", "stack"])
def test_hidden_states_are_the_lm_heads_input_at_every_position_on_every_forward_path(path):
    ops = kernels.load(required=False)
    if path != "plain" and (ops is None or not ops.bf16_vector):
        pytest.skip("verispec's kernels (vector bf16) are not available here")
    from test_kernels import _packed_tiny_model
    model = _packed_tiny_model("bf16", hidden=256)
    model.kernels = None if path == "plain" else ops
    model.fused_stack = path == "stack"
    kq = 0 if path == "plain" else sys.maxsize  # every query in the attention kernel, or none
    rows = [([5, 6, 7, 8], 0), ([1], 9), ([2, 3], 4)]  # (new tokens, start): after a prefix of each
    ids = torch.tensor([t for r, _ in rows for t in r])
    index = torch.tensor([3, 4, 6])
    kv = model.new_kv_store(3 * 64)
    for r, (_, start) in enumerate(rows):  # the contexts before each row's new tokens
        if start:
            model(torch.arange(start) % 64, _prefix_meta(r, start, kq), kv)
    logits, h = model(ids, _rows_meta(rows, 64, kq), kv, index, return_hidden=True)
    assert h.shape == (7, 256) and h.dtype == torch.float32
    assert torch.equal(model.lm_head(h[index]), logits)
    assert torch.equal(model(ids, _rows_meta(rows, 64, kq), kv, index), logits)  # the hook changes nothing


def _prefix_meta(row: int, n: int, kernel_queries: int) -> AttentionMetadata:
    slots = list(range(row * 64, row * 64 + n))
    return AttentionMetadata.build([n], [n], [list(range(n))], [slots], [slots], kernel_queries=kernel_queries)


def test_the_runner_returns_every_positions_hidden_state_per_row():
    target, _ = tiny_pair(vocab=16)
    runner = ModelRunner(target, 64, 4)
    rows = [RowInput([1, 2, 3, 4, 5], 0, [0, 1], 4), RowInput([7, 8], 0, [2, 3], 0)]
    logits, hidden = runner.forward(rows, hidden=True)
    assert [h.shape[0] for h in hidden] == [5, 2] and [lg.shape[0] for lg in logits] == [1, 2]
    dense = causal_forward(target, torch.tensor([[1, 2, 3, 4, 5]]))[0]
    assert torch.allclose(hidden[0], dense, atol=1e-5)
    with torch.inference_mode():
        assert torch.allclose(target.lm_head(hidden[1]), logits[1])


def test_without_a_head_eagle_is_unavailable_and_says_how_to_get_one():
    engine = tiny_engine(tiny_pair(vocab=16)[0], method="ngram")
    with pytest.raises(ValueError, match="'eagle' is not available: .*--draft-head DIR"):
        engine.add_request("r", [1, 2], GREEDY, spec=_override("eagle"))


def _override(method):
    from verispec.request import SpecOverride
    return SpecOverride(method=method)


def test_a_saved_head_loads_its_vocabulary_and_weights(tmp_path):
    target = PAIR[0]
    head = load_head(random_head_dir(target, list(range(10))))
    assert head.vocab_ids.tolist() == list(range(10)) and head.lm_head.weight.shape == (10, target.cfg.hidden_size)
    with pytest.raises(ValueError, match="does not fit"):
        head.bind(LlamaModel(tiny_config(vocab=8)).embed_tokens)


def _recorded_drafts(engine, monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Wrap the proposer's draft: (the row's tokens, its drafts) of every drafting row."""
    seen, real = [], EagleProposer.draft

    def draft(self, reqs, ks):
        out = real(self, reqs, ks)
        seen.extend((list(r.all_ids), toks) for r, (toks, _) in zip(reqs, out))
        return out
    monkeypatch.setattr(EagleProposer, "draft", draft)
    return seen


def reference_drafts(target, head, ids: list[int], k: int) -> list[int]:
    """The head's greedy chain from scratch: the target's features over ids[:-1] by a dense
    pass, then k dense head passes, each reading the previous pass's output feature."""
    h = causal_forward(target, torch.tensor([ids[:-1]]))[0]             # (N-1, H): h_0..h_{N-2}
    tokens, feats = list(ids), [h[i] for i in range(h.shape[0])]
    for _ in range(k):
        logits, g = head_forward(head, torch.tensor([tokens]), torch.stack(feats + [feats[-1]])[None])
        tokens.append(int(head.vocab_ids[logits[0, -1].argmax()]))
        feats.append(g[0, -1])
    return tokens[len(ids):]


def _check_against_reference(greedy_pair, monkeypatch, bug: str | None):
    target = greedy_pair[0]
    path = trained_head_dir(target, 32)
    head = load_head(path).bind(target.embed_tokens)
    if bug:
        inject(monkeypatch, bug)
    engine = tiny_engine(target, method="eagle", k=3, draft_head=path, prefix_cache=False)
    seen = _recorded_drafts(engine, monkeypatch)
    # the last prompt is longer than a round's entries: its first draft catches up (`prepare`)
    prompts = [[1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 30, 9, 9, 4, 4, 41, 2, 9], [3, 30, 2, 8],
               [(7 * i) % 48 for i in range(26)]]
    outs = run_all(engine, prompts, GREEDY)
    plain = run_all(tiny_engine(target, method="none"), prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # G2's identity, bug or not
    rounds = len(seen)
    wrong = sum(d != reference_drafts(target, head, ids, len(d)) for ids, d in seen)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    return rounds, wrong, accepted


def test_the_heads_drafts_equal_a_from_scratch_reference(greedy_pair, monkeypatch):
    rounds, wrong, accepted = _check_against_reference(greedy_pair, monkeypatch, None)
    assert rounds > 20 and accepted > 5, (rounds, accepted)
    assert wrong == 0, f"{wrong} of {rounds} rounds drafted other tokens than the reference"


def test_a_stale_head_entry_after_verification_is_caught_by_the_reference_check(greedy_pair, monkeypatch):
    rounds, wrong, accepted = _check_against_reference(greedy_pair, monkeypatch, "eagle_stale_head_kv")
    assert wrong > 0, "provisional head entries kept as exact went unnoticed"


@pytest.mark.parametrize("keep_features", [True, False])
def test_a_cached_prefix_keeps_its_features_for_the_next_request(greedy_pair, monkeypatch, keep_features):
    """A request whose prompt prefix another request computed (served by the prefix cache)
    drafts what the from-scratch reference drafts: the prefix's features come from the
    slot store. Zeroing the store between the requests (a store that does not outlive a
    request) makes its drafts differ."""
    target = greedy_pair[0]
    path = trained_head_dir(target, 32)
    head = load_head(path).bind(target.embed_tokens)
    engine = tiny_engine(target, method="eagle", k=3, draft_head=path, prefix_cache=True)
    shared = [(7 * i) % 48 for i in range(24)]
    run_all(engine, [shared + [1, 2]], GREEDY)
    if not keep_features:
        engine.proposers["eagle"].features.zero_()
    seen = _recorded_drafts(engine, monkeypatch)
    (out,) = run_all(engine, [shared + [5, 6, 7]], GREEDY)
    assert out.num_cached_tokens >= 20 and len(seen) > 3
    wrong = sum(d != reference_drafts(target, head, ids, len(d)) for ids, d in seen)
    assert (wrong == 0) == keep_features, (wrong, len(seen))


def test_q_renormalised_over_the_full_vocabulary_is_caught_by_g1(monkeypatch):
    """Bug (a): the drafts come from the head's subset distribution, the verifier is handed
    q over the whole vocabulary. x2 (the first draft) is where it acts first."""
    inject(monkeypatch, "eagle_full_vocab_q")
    params = SamplingParams(temperature=1.0)
    verdict = run_gate(PAIR, exact_joint(PAIR[0], params, 4), "eagle", 2, params, num_samples=BUG_SAMPLES)
    assert verdict.passed["acceptance"], verdict.measured
    missed = [name for name in ("x2 TV", "x2 chi2") if verdict.passed[name]]
    assert not missed, ("q over the full vocabulary went unnoticed by", missed, verdict.measured)


def test_a_packed_linear_is_copied_into_the_head_without_its_bias():
    """The head starts from the target's last layer; a packed (bf16-kernel-layout) linear
    is read back through its forward, whose bias must not end up inside the weight."""
    from verispec.model.quant import make_bf16_linear
    from verispec.train.eagle import _dense_weight
    torch.manual_seed(0)
    dense = torch.nn.Linear(32, 16, bias=True)
    with torch.no_grad():
        dense.bias.mul_(10)   # a bias far above bf16 rounding of the weight
    copied = _dense_weight(make_bf16_linear(dense), "weight")
    assert torch.allclose(copied, dense.weight, atol=0.05)


def test_a_tensor_parallel_target_is_refused_for_want_of_a_whole_embedding():
    from types import SimpleNamespace

    from verispec.distributed.runner import TensorParallelRunner
    from verispec.spec.eagle import build_eagle
    from verispec.spec.proposer import ProposerContext, ProposerUnavailable
    assert ModelRunner.returns_hidden and not TensorParallelRunner.returns_hidden
    tp = TensorParallelRunner.__new__(TensorParallelRunner)  # the class's answer; no ranks started
    context = ProposerContext(SimpleNamespace(draft_head="unused", model="tiny"), target=tp)
    with pytest.raises(ProposerUnavailable, match="hidden states.*tensor parallelism"):
        build_eagle(context)


def _packed_head(hidden: int, int4: bool = False, packed: bool = True, qkv_bias: float | None = None):
    """A random head over a tiny bf16 target (head size hidden / 4), packed on the kernels;
    with `qkv_bias` a Qwen2-shaped one whose q/k/v projection has a bias of that scale."""
    torch.manual_seed(0)
    cfg = tiny_config(vocab=64, hidden=hidden)
    target = LlamaModel(replace(cfg, attention_bias=qkv_bias is not None)).eval()
    target.embed_tokens.to(torch.bfloat16)
    head = EagleHead(target.cfg, torch.arange(0, 64, 2))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, qkv_bias if name.endswith("bias") else 0.2)
    head.bind(target.embed_tokens)
    return head.pack(kernels.load(required=True), int4) if packed else head


def _head_pass(head, rows: list[tuple[int, int]], kernel_limit: int | None = None, stack: bool = True):
    """(logits, output features) of one pass over rows of (start, tokens) after a random
    context: through `EagleProposer._pass`, or with kernel_limit, the head on
    `row_metadata(..., kernel_limit)`."""
    from types import SimpleNamespace
    target = SimpleNamespace(kv=SimpleNamespace(num_slots=64 * len(rows)), device=torch.device("cpu"),
                             block_size=4, vocab_limit=64, model=None)
    tables = [list(range(b * 16, b * 16 + 16)) for b in range(len(rows))]  # 16 blocks of 4 a row
    proposer = EagleProposer(head, target, lambda request_id: tables[int(request_id)])
    g = torch.Generator().manual_seed(4)
    proposer.kv.k.copy_(torch.randn(proposer.kv.k.shape, generator=g))
    proposer.kv.v.copy_(torch.randn(proposer.kv.v.shape, generator=g))
    starts, tokens = [s for s, _ in rows], [[i % 64 for i in range(n)] for _, n in rows]
    features = torch.randn(sum(n for _, n in rows), head.cfg.hidden_size, generator=g)
    saved, head.stack = head.stack, head.stack if stack else None
    try:
        if kernel_limit is None:
            return proposer._pass([SimpleNamespace(request_id=str(b)) for b in range(len(rows))], starts, tokens,
                                  features)
        meta = row_metadata(starts, [n for _, n in rows], tables, 4, "cpu", kernel_limit)
        last = torch.tensor([n for _, n in rows]).cumsum(0) - 1
        return head(torch.tensor([t for row in tokens for t in row]), features, meta, proposer.kv, last)
    finally:
        head.stack = saved


def test_a_packed_heads_rows_go_where_a_targets_runner_sends_them():
    """Head size 64 (the kernel's vector form): every row, a 40-token catch-up included, in
    the kernel, on the stack or the per-layer path bit for bit. Head size 32: rows over
    KERNEL_QUERY_LIMIT go to SDPA, the rest stay in the kernel (bit for bit as the stack)."""
    ops = kernels.load(required=False)
    if ops is None or not ops.bf16_vector:
        pytest.skip("verispec's kernels (vector bf16) are not available here")
    rows = [(10, 20), (0, 40), (20, 1)]
    head = _packed_head(256)
    logits, g = _head_pass(head, rows)
    for stack in (True, False):
        in_kernel, in_kernel_g = _head_pass(head, rows, sys.maxsize, stack)
        assert torch.equal(logits, in_kernel) and torch.equal(g, in_kernel_g)
    head = _packed_head(128)
    assert head.kernel_queries == KERNEL_QUERY_LIMIT
    logits, _ = _head_pass(head, rows)
    in_kernel, _ = _head_pass(head, rows, sys.maxsize)
    assert torch.equal(logits[[0, 2]], in_kernel[[0, 2]])
    assert not torch.equal(logits[1], in_kernel[1])  # the 40-token row: SDPA's bf16 rounding
    assert torch.allclose(logits[1], in_kernel[1], atol=0.1)


def test_an_int4_packed_head_runs_its_layer_in_one_stack_call_near_the_float_head():
    """int4 (for int4 targets): the stack and the per-layer path agree bit for bit, and
    the logits follow the float32 head's (round-to-nearest int4 of its weights)."""
    ops = kernels.load(required=False)
    if ops is None or not (ops.bf16_vector and ops.int4_vector):
        pytest.skip("verispec's kernels (vector bf16 and int4) are not available here")
    rows = [(10, 20), (0, 1)]
    head = _packed_head(256, int4=True)
    assert head.stack is not None and type(head.lm_head).__name__ == "Int4Linear"
    logits, g = _head_pass(head, rows)
    per_layer, per_layer_g = _head_pass(head, rows, sys.maxsize, stack=False)
    assert torch.equal(logits, per_layer) and torch.equal(g, per_layer_g)
    exact, _ = _head_pass(_packed_head(256, packed=False), rows, 0)  # float32, SDPA
    agreement = torch.corrcoef(torch.stack([logits.flatten(), exact.flatten()]))[0, 1]
    assert 0.9 < agreement < 1.0, agreement  # random weights of std 0.2: int4 keeps their shape


@pytest.mark.parametrize("broken", [False, True])
def test_an_int4_packed_qwen2_head_keeps_its_qkv_bias(monkeypatch, broken):
    """A Qwen2 target's layer has a q/k/v bias: the int4 head follows the float32 head with
    its bias better than the same head without it (a head packed without the bias follows
    the latter)."""
    ops = kernels.load(required=False)
    if ops is None or not (ops.bf16_vector and ops.int4_vector):
        pytest.skip("verispec's kernels (vector bf16 and int4) are not available here")
    if broken:
        import verispec.model.quant as quant
        real = quant.make_int4_linear
        monkeypatch.setattr(quant, "make_int4_linear", lambda groups, bias, dtype, *a: real(groups, None, dtype, *a))
    rows = [(10, 20), (0, 1)]
    logits, _ = _head_pass(_packed_head(256, int4=True, qkv_bias=1.0), rows)
    exact = _packed_head(256, packed=False, qkv_bias=1.0)
    with_bias, _ = _head_pass(exact, rows, 0)
    with torch.no_grad():
        exact.layer.self_attn.qkv_proj.bias.zero_()
    without_bias, _ = _head_pass(exact, rows, 0)
    follows = [torch.corrcoef(torch.stack([logits.flatten(), ref.flatten()]))[0, 1] for ref in (with_bias, without_bias)]
    assert (follows[0] > follows[1]) != broken, follows


def test_passes_compute_hidden_states_only_once_a_request_drafts_with_the_head(greedy_pair):
    """A head that no request uses costs nothing: the target computes no hidden states and
    no feature store exists until the first eagle request; from then on every row feeds it
    (any may be cached)."""
    from verispec.request import SpecOverride
    target = greedy_pair[0]
    engine = tiny_engine(target, method="ngram", k=3, draft_head=trained_head_dir(target, 32))
    calls, forward = [], engine.target.forward

    def recording(rows, hidden=False):
        calls.append(hidden)
        return forward(rows, hidden=hidden) if hidden else forward(rows)
    engine.target.forward = recording
    run_all(engine, [[1, 2, 3, 4, 1, 2]], GREEDY)
    assert calls and not any(calls) and engine.proposers["eagle"]._features_by_slot is None
    run_all(engine, [[5, 6, 7]], GREEDY, spec=SpecOverride(method="eagle"))
    calls.clear()
    run_all(engine, [[9, 30, 9, 9]], GREEDY)  # n-gram again: its rows still feed the store
    assert calls and all(calls)
