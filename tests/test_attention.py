"""Attention groups rows by query length: a mixed batch gives each row what it gets alone."""
import pytest
import torch

import verispec.model.attention as attention
from tiny import tiny_pair
from verispec.model.attention import AttentionMetadata, partition_rows

# (context length after the pass, new tokens this pass, consecutive slots?)
MIXED = [
    (9, 1, True),     # decode rows of different context lengths: their group needs a mask
    (23, 1, True),
    (14, 1, False),   # scattered slots (the engine's pool after frees and prefix hits)
    (23, 1, True),
    (17, 3, True),    # verify rows, k = 2 and k = 4
    (30, 5, False),
    (12, 3, True),
    (40, 24, True),   # a prefill chunk: with GROUP_COST_PAIRS = 0, a group of its own
    (6, 1, True),
]


def _layout(rows, pool: int = 1024):
    """Disjoint slots per row: consecutive blocks, or every 3rd slot counted down."""
    slots, nxt = [], 1
    for c, _, consecutive in rows:
        if consecutive:
            slots.append(list(range(nxt, nxt + c)))
        else:
            slots.append(list(range(nxt + 3 * c - 1, nxt - 1, -3)))
        nxt += 3 * c
    assert nxt <= pool
    return slots


def _meta(rows, slots, which):
    q_lens = [rows[b][1] for b in which]
    c_lens = [rows[b][0] for b in which]
    return AttentionMetadata.build(
        q_lens, c_lens, [list(range(c - q, c)) for q, c in zip(q_lens, c_lens)],
        [slots[b][c - q: c] for b, q, c in zip(which, q_lens, c_lens)], [slots[b][:c] for b, c in zip(which, c_lens)])


def _batch_and_alone(rows, seed: int = 0):
    """Logits of every new token: all rows in one forward, and each row in its own."""
    model = tiny_pair(vocab=32, seed=seed)[0]
    slots = _layout(rows)
    kv = model.new_kv_store(1024)
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 32, (c,), generator=g) for c, _, _ in rows]
    for b, (c, q, _) in enumerate(rows):  # each row's earlier context, prefilled alone
        pre = [(c - q, c - q, True)]
        model(tokens[b][: c - q], _meta(pre, [slots[b]], [0]), kv)
    batch_meta = _meta(rows, slots, range(len(rows)))
    ids = torch.cat([tokens[b][c - q: c] for b, (c, q, _) in enumerate(rows)])
    batch = model(ids, batch_meta, kv).split([q for _, q, _ in rows])
    alone = [model(tokens[b][c - q: c], _meta(rows, slots, [b]), kv) for b, (c, q, _) in enumerate(rows)]
    return batch_meta, batch, alone


@pytest.mark.parametrize("group_cost, num_groups", [
    (10 ** 9, 2),                        # decode rows | every multi-token row
    (attention.GROUP_COST_PAIRS, 3),     # decode | verify rows | the prefill chunk
    (0, 4),                              # one group per query length
])
def test_a_mixed_batch_gives_each_row_its_alone_logits(group_cost, num_groups, monkeypatch):
    monkeypatch.setattr(attention, "GROUP_COST_PAIRS", group_cost)
    meta, batch, alone = _batch_and_alone(MIXED)
    for b, (got, want) in enumerate(zip(batch, alone)):
        # float32, logits up to ~17: only summation order differs with the padded shapes
        # and the GEMMs' row counts (measured <= 1.1e-5; a misrouted row is off by > 1e-2)
        torch.testing.assert_close(got, want, atol=3e-5, rtol=0, msg=lambda m, b=b: f"row {b}: {m}")
    assert len(meta.groups) == num_groups
    assert (meta.groups[0].query_len, meta.groups[0].num_rows) == (1, 5)
    assert meta.groups[0].attn_mask is not None  # decode rows of unequal context lengths


def test_the_torch_2_4_path_without_enable_gqa_agrees(monkeypatch):
    monkeypatch.setattr(attention, "_SDPA_HAS_GQA", False)  # KV heads expanded explicitly
    _, batch, alone = _batch_and_alone(MIXED)
    for b, (got, want) in enumerate(zip(batch, alone)):
        torch.testing.assert_close(got, want, atol=3e-5, rtol=0, msg=lambda m, b=b: f"row {b}: {m}")


def test_the_comparison_catches_outputs_scattered_to_the_wrong_rows(monkeypatch):
    """The check above is sensitive: swapping two decode rows' outputs fails it."""
    real_build = AttentionMetadata.build.__func__

    def swapped(cls, *args, **kw):
        meta = real_build(cls, *args, **kw)
        if len(meta.groups) > 1:
            idx = meta.groups[0].out_index
            meta.groups[0].out_index = torch.cat([idx[1:2], idx[:1], idx[2:]])
        return meta

    monkeypatch.setattr(AttentionMetadata, "build", classmethod(swapped))
    _, batch, alone = _batch_and_alone(MIXED)
    assert (batch[0] - alone[0]).abs().max() > 1e-2


def test_decode_rows_of_equal_length_need_no_mask_and_verify_rows_keep_their_own_padding():
    rows = [(20, 1, True), (20, 1, False), (25, 5, True), (20, 1, True), (22, 3, False)]
    meta = _meta(rows, _layout(rows), range(len(rows)))
    decode, verify = meta.groups
    assert (decode.num_rows, decode.query_len, decode.attn_mask) == (3, 1, None)
    assert tuple(decode.context_slots.shape) == (3, 20)
    assert (verify.num_rows, verify.query_len) == (2, 5) and tuple(verify.attn_mask.shape) == (2, 1, 5, 25)
    assert meta.out_rows == 11 + 2  # T plus the 3-token row's two padded queries
    assert sorted(decode.out_index.tolist() + verify.out_index.tolist()) == list(range(13))


def test_one_query_length_is_one_group_with_the_old_fast_paths():
    rows = [(20, 1, True)] * 4
    meta = _meta(rows, _layout(rows), range(4))
    (grp,) = meta.groups
    assert grp.query_index is None and grp.out_index is None and grp.attn_mask is None
    assert meta.gather_index is None and meta.context_start is None
    one = _meta([(20, 5, True)], _layout([(20, 5, True)]), [0])
    assert one.context_start == 1 and one.groups[0].query_index is None
    ragged = _meta([(20, 5, True), (9, 3, True)], _layout([(20, 5, True), (9, 3, True)]), [0, 1])
    assert len(ragged.groups) == 1 and ragged.gather_index is not None  # padded, gathered back


def test_partition_rows():
    assert partition_rows([1] * 16, [401] * 16) == [list(range(16))]
    assert partition_rows([5] + [1] * 15, [405] + [401] * 15) == [list(range(1, 16)), [0]]
    # Verify rows of similar length share a group ...
    assert partition_rows([1, 5, 4, 1, 5], [400] * 5) == [[0, 3], [1, 2, 4]]
    # ... but a prefill chunk does not pad them to its length.
    assert partition_rows([5, 512, 5, 1, 3], [405, 512, 405, 401, 403]) == [[3], [1], [0, 2, 4]]


def _kernel_fields(meta: AttentionMetadata) -> dict:
    """What the fused kernel and the layers read of kernel-only metadata: each query's
    position, slot, row, key count and its row's context slots up to that count."""
    k = meta.kernel
    ctx = [k.context_slots[r, :n].tolist() for r, n in zip(k.rows.tolist(), k.lens.tolist())]
    return {"positions": meta.positions.tolist(), "slots": meta.slot_mapping.tolist(), "rows": k.rows.tolist(),
            "lens": k.lens.tolist(), "context": ctx, "tokens": k.tokens, "groups": meta.groups,
            "num_rows": meta.num_rows, "out_rows": meta.out_rows, "max_position": meta.max_position}


def test_kernel_only_metadata_equals_the_general_build():
    """The runner's decode path (`kernel_only`, from block tables) and `build` (from each
    row's slot lists) describe the same pass: rows decoding and verifying drafts, contexts
    across block boundaries, blocks out of order; a lens off by one is caught."""
    gen = torch.Generator().manual_seed(0)
    bs = 16
    for trial in range(20):
        num_rows = 1 + trial % 5
        starts = [int(torch.randint(0, 200, (1,), generator=gen)) for _ in range(num_rows)]
        q_lens = [int(torch.randint(1, 9, (1,), generator=gen)) for _ in range(num_rows)]
        tables = [torch.randperm(64, generator=gen)[: -(-(s + q) // bs) + 2].tolist()
                  for s, q in zip(starts, q_lens)]  # a few spare blocks, as for drafts
        ctx = [[t[p // bs] * bs + p % bs for p in range(s + q)] for t, s, q in zip(tables, starts, q_lens)]
        general = AttentionMetadata.build(q_lens, [s + q for s, q in zip(starts, q_lens)],
                                          [list(range(s, s + q)) for s, q in zip(starts, q_lens)],
                                          [c[s:] for c, s in zip(ctx, starts)], ctx, "cpu",
                                          attention.KERNEL_QUERY_LIMIT)
        fast = AttentionMetadata.kernel_only(starts, q_lens, tables, bs)
        assert _kernel_fields(fast) == _kernel_fields(general)
    fast.kernel.lens[0] += 1  # an injected off-by-one
    assert _kernel_fields(fast) != _kernel_fields(general)
