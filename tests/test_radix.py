"""RadixCache and NoPrefixCache: block-aligned matching, splits, locking, LRU eviction."""
import pytest

from verispec.cache.kv_pool import BlockPool
from verispec.cache.prefix import NoPrefixCache
from verispec.cache.radix import RadixCache

BS = 2


def make(num_blocks=16):
    pool = BlockPool(num_blocks, BS)
    return pool, RadixCache(pool)


def cache_path(pool, tree, tokens):
    """Insert `tokens` (full blocks) with fresh blocks, as a finished sequence would, and drop
    the sequence's own references so the tree is the only holder."""
    blocks = pool.allocate(len(tokens) // BS)
    tree.insert(tokens, blocks)
    for b in blocks:
        pool.decref(b)
    return blocks


def test_empty_tree_matches_nothing():
    _, tree = make()
    assert tree.match_prefix([1, 2, 3, 4]) == ([], 0, None, 0)


def test_match_is_block_aligned():
    pool, tree = make()
    blocks = cache_path(pool, tree, [1, 2, 3, 4, 5, 6])
    m = tree.match_prefix([1, 2, 3, 4, 5])  # the partial last block cannot be shared
    assert m.blocks == blocks[:2] and m.num_tokens == 4
    m = tree.match_prefix([1, 2, 3, 9, 5, 6])  # mismatch inside the 2nd block
    assert m.blocks == blocks[:1] and m.num_tokens == 2
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 6
    assert tree.match_prefix([9, 2, 3, 4]).num_tokens == 0
    tree.check_integrity()


def test_insert_takes_a_reference_and_eviction_drops_it():
    pool, tree = make(num_blocks=4)
    blocks = pool.allocate(2)
    assert tree.insert([1, 2, 3, 4], blocks) == 0
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    for b in blocks:
        pool.decref(b)
    assert tree.num_cached_blocks == 2 and tree.num_evictable_blocks == 2
    assert tree.evict(5) == 2
    assert pool.num_free == 4 and tree.num_cached_blocks == 0
    assert tree.match_prefix([1, 2, 3, 4]).num_tokens == 0
    tree.check_integrity()
    pool.check_integrity()


def test_partial_match_splits_the_node_at_a_block_boundary():
    pool, tree = make()
    blocks = cache_path(pool, tree, [1, 2, 3, 4, 5, 6])
    assert len(tree.root.children) == 1
    m = tree.match_prefix([1, 2, 3, 4, 7, 7])
    upper = m.node
    assert upper.blocks == blocks[:2] and upper.key == (1, 2, 3, 4)
    (lower,) = upper.children.values()
    assert lower.blocks == blocks[2:] and lower.key == (5, 6) and lower.parent is upper
    assert tree.path_blocks(lower) == blocks
    tree.check_integrity()


def test_divergent_insert_branches_and_reports_the_existing_prefix():
    pool, tree = make()
    first = cache_path(pool, tree, [1, 2, 3, 4, 5, 6])
    mine = pool.allocate(3)
    existing = tree.insert([1, 2, 3, 4, 8, 9], mine)
    assert existing == 4  # the caller's first two blocks are duplicates; it drops them
    assert pool.ref_count(mine[0]) == 1 and pool.ref_count(mine[2]) == 2
    assert tree.match_prefix([1, 2, 3, 4, 8, 9]).blocks == first[:2] + mine[2:]
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).blocks == first
    upper = tree.root.children[(1, 2)]
    assert set(upper.children) == {(5, 6), (8, 9)}
    tree.check_integrity()


def test_duplicate_insert_keeps_the_trees_blocks():
    pool, tree = make()
    first = cache_path(pool, tree, [1, 2, 3, 4])
    dup = pool.allocate(2)
    assert tree.insert([1, 2, 3, 4], dup) == 4
    assert all(pool.ref_count(b) == 1 for b in dup)  # the tree took no reference
    assert tree.match_prefix([1, 2, 3, 4]).blocks == first
    tree.check_integrity()


def test_insert_rejects_partial_blocks_and_blocks_cached_elsewhere():
    pool, tree = make()
    blocks = cache_path(pool, tree, [1, 2])
    with pytest.raises(ValueError, match="full blocks only"):
        tree.insert([1, 2, 3], pool.allocate(1))
    pool.incref(blocks[0])
    with pytest.raises(ValueError, match="already cached"):
        tree.insert([7, 7], blocks)
    tree.check_integrity()


def test_eviction_takes_least_recently_used_leaves_first():
    pool, tree = make()
    a = cache_path(pool, tree, [1, 1])
    b = cache_path(pool, tree, [2, 2])
    c = cache_path(pool, tree, [3, 3])
    tree.match_prefix([1, 1])  # a is now the most recent
    assert tree.evict(1) == 1
    assert pool.ref_count(b[0]) == 0 and pool.ref_count(a[0]) == 1
    assert tree.evict(1) == 1
    assert pool.ref_count(c[0]) == 0 and pool.ref_count(a[0]) == 1
    tree.check_integrity()


def test_eviction_trims_a_leaf_from_its_tail():
    pool, tree = make()
    blocks = cache_path(pool, tree, [1, 2, 3, 4, 5, 6])
    assert tree.evict(1) == 1
    assert pool.ref_count(blocks[2]) == 0
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).blocks == blocks[:2]
    tree.check_integrity()


def test_eviction_climbs_to_parents_emptied_of_children():
    pool, tree = make()
    cache_path(pool, tree, [1, 2, 3, 4])
    tree.match_prefix([1, 2, 9, 9])  # split: [1 2] -> [3 4]
    assert tree.evict(2) == 2
    assert not tree.root.children and tree.num_cached_blocks == 0
    tree.check_integrity()


def test_locked_nodes_and_their_ancestors_are_not_evicted():
    pool, tree = make()
    shared = cache_path(pool, tree, [1, 2, 3, 4])
    cache_path(pool, tree, [1, 2, 3, 4, 5, 6])
    cache_path(pool, tree, [1, 2, 7, 8])
    m = tree.match_prefix([1, 2, 3, 4])
    tree.lock(m.node)
    assert tree.num_evictable_blocks == 2  # [5 6] and [7 8]; [1 2] and [3 4] are pinned
    assert tree.evict(10) == 2
    assert tree.match_prefix([1, 2, 3, 4]).blocks == shared
    tree.check_integrity(locked_nodes=[m.node])
    tree.unlock(m.node)
    assert tree.num_evictable_blocks == 2
    assert tree.evict(10) == 2
    tree.check_integrity(locked_nodes=[])


def test_lock_handle_survives_a_split_of_its_own_node():
    pool, tree = make()
    cache_path(pool, tree, [1, 2, 3, 4, 5, 6])
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    tree.lock(m.node)
    tree.match_prefix([1, 2, 3, 4, 9, 9])  # splits the locked node
    assert tree.path_blocks(m.node) == m.blocks
    assert m.node.parent.lock_ref == 1
    tree.check_integrity(locked_nodes=[m.node])
    assert tree.num_evictable_blocks == 0 and tree.evict(3) == 0
    tree.unlock(m.node)
    assert tree.num_evictable_blocks == 3
    tree.check_integrity(locked_nodes=[])


def test_unlock_of_an_unlocked_node_raises():
    pool, tree = make()
    cache_path(pool, tree, [1, 2])
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(tree.match_prefix([1, 2]).node)


def test_integrity_check_catches_wrong_lock_counts():
    pool, tree = make()
    cache_path(pool, tree, [1, 2])
    node = tree.match_prefix([1, 2]).node
    tree.lock(node)
    with pytest.raises(AssertionError, match="lock count"):
        tree.check_integrity(locked_nodes=[])
    node.lock_ref = 0  # corrupt: the evictable count no longer agrees
    with pytest.raises(AssertionError, match="evictable"):
        tree.check_integrity()


def test_integrity_check_catches_a_cached_block_that_was_freed():
    pool, tree = make()
    (block,) = cache_path(pool, tree, [1, 2])
    pool.decref(block)  # someone released the tree's reference
    with pytest.raises(AssertionError, match="is free"):
        tree.check_integrity()


def test_draft_kv_marks_whole_blocks_and_match_reports_the_marked_run():
    pool, tree = make()
    blocks = pool.allocate(3)
    tree.insert([1, 2, 3, 4, 5, 6], blocks, draft_tokens=3)  # 1 whole block of draft KV
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.num_tokens == 6 and m.draft_tokens == 2
    assert tree.match_prefix([1, 2, 3, 9]).draft_tokens == 2
    # The same blocks inserted again with more draft KV (the sequence that holds them caught
    # up): the run grows, splitting the node at the new boundary.
    tree.insert([1, 2, 3, 4, 5, 6], blocks, draft_tokens=4)
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).draft_tokens == 4
    # A partial match splits a marked node; both halves stay marked.
    assert tree.match_prefix([1, 2, 9, 9]).draft_tokens == 2
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).draft_tokens == 4
    tree.check_integrity()


def test_a_duplicate_insert_never_marks_blocks_it_does_not_hold():
    pool, tree = make()
    tree.insert([1, 2, 3, 4], pool.allocate(2))  # target KV only
    other = pool.allocate(2)                     # another sequence's copies, with draft KV
    assert tree.insert([1, 2, 3, 4], other, draft_tokens=4) == 4
    assert tree.match_prefix([1, 2, 3, 4]).draft_tokens == 0
    # Marked blocks under an unmarked parent do not count: the run starts at the root.
    tree.insert([1, 2, 3, 4, 5, 6], tree.match_prefix([1, 2, 3, 4]).blocks + pool.allocate(1), draft_tokens=6)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.num_tokens == 6 and m.draft_tokens == 6  # the tree's own blocks: marked now
    tree.check_integrity()


def test_no_prefix_cache_shares_nothing():
    pool = BlockPool(4, BS)
    cache = NoPrefixCache(pool)
    blocks = pool.allocate(1)
    assert cache.insert([1, 2], blocks) == 0
    assert cache.match_prefix([1, 2, 3]) == ([], 0, None, 0)
    assert pool.ref_count(blocks[0]) == 1
    assert cache.num_cached_blocks == cache.num_evictable_blocks == cache.evict(4) == 0
    cache.lock(None)
    cache.unlock(None)
    cache.check_integrity(locked_nodes=[None])


# --- block keys and the cache event log (what a replica tells the request router) ---------

def test_block_keys_chain_over_the_path_so_equal_keys_mean_equal_prefixes():
    from verispec.cache.events import block_keys
    a, b = block_keys([1, 2, 3, 4, 5], BS), block_keys([1, 2, 9, 4], BS)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_keys([7, 7, 3, 4], BS)[1] != a[1]   # same block, different prefix before it
    assert block_keys([3, 4], BS, parent=a[0]) == a[1:]


def test_the_tree_reports_the_keys_a_consumer_must_hold_through_splits_and_evictions():
    from verispec.cache.events import block_keys
    pool, tree = make(num_blocks=8)
    held: set[int] = set()
    tree.drain_events().apply(held)                     # the first drain is a snapshot
    cache_path(pool, tree, [1, 2, 3, 4, 5, 6])
    tree.match_prefix([1, 2, 3, 4, 9, 9])               # a split: no key changes
    cache_path(pool, tree, [1, 2, 3, 4, 7, 8])          # a branch: one new key
    delta = tree.drain_events()
    assert not delta.reset and sorted(delta.stored) == sorted(
        set(block_keys([1, 2, 3, 4, 5, 6], BS)) | set(block_keys([1, 2, 3, 4, 7, 8], BS)))
    delta.apply(held)
    tree.evict(1)                                       # the least recently used leaf: [5 6]
    tree.drain_events().apply(held)
    assert held == set(tree.all_block_keys()) == set(block_keys([1, 2, 3, 4, 7, 8], BS))
    tree.check_integrity()


def test_keys_evicted_and_stored_again_before_a_drain_fold_to_their_last_state():
    from verispec.cache.events import CacheEventLog
    log = CacheEventLog(max_pending=4)
    log.drain(list)
    log.stored([1, 2])
    log.removed([2, 3])
    log.stored([3])
    held = {2, 9}
    log.drain(list).apply(held)
    assert held == {1, 3, 9}
    log.stored(range(10, 20))                           # past max_pending: the next drain resyncs
    delta = log.drain(lambda: [42])
    assert delta.reset and delta.stored == [42]


def test_integrity_check_catches_block_keys_that_do_not_chain():
    pool, tree = make()
    cache_path(pool, tree, [1, 2, 3, 4])
    (node,) = tree.root.children.values()
    node.hashes = node.hashes[::-1]                     # a split that swapped halves would do this
    with pytest.raises(AssertionError, match="block keys"):
        tree.check_integrity()
