"""BlockPool: allocation, reference counts, double frees, slot mapping, integrity check."""
import pytest

from verispec.cache.kv_pool import BlockPool, OutOfBlocks, RefCountError, slot_of, slots_for


def test_allocate_hands_out_distinct_blocks_with_one_reference():
    pool = BlockPool(num_blocks=6, block_size=4)
    blocks = pool.allocate(4)
    assert len(set(blocks)) == 4 and all(0 <= b < 6 for b in blocks)
    assert all(pool.ref_count(b) == 1 for b in blocks)
    assert pool.num_free == 2 and pool.num_allocated == 4
    assert set(pool.allocate(2)).isdisjoint(blocks)
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(num_blocks=3, block_size=2)
    pool.allocate(2)
    with pytest.raises(OutOfBlocks, match="need 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_allocate_zero_is_empty():
    assert BlockPool(2, 2).allocate(0) == []


def test_block_returns_to_free_list_only_when_last_holder_lets_go():
    pool = BlockPool(num_blocks=2, block_size=2)
    (block,) = pool.allocate(1)
    pool.incref(block)
    assert pool.ref_count(block) == 2
    assert pool.decref(block) is False
    assert pool.num_free == 1
    assert pool.decref(block) is True
    assert pool.num_free == 2 and pool.ref_count(block) == 0
    pool.check_integrity()


def test_double_free_raises():
    pool = BlockPool(num_blocks=2, block_size=2)
    (block,) = pool.allocate(1)
    pool.decref(block)
    with pytest.raises(RefCountError, match="double free"):
        pool.decref(block)
    pool.check_integrity()


def test_incref_of_free_block_raises():
    pool = BlockPool(num_blocks=2, block_size=2)
    with pytest.raises(RefCountError, match="free block"):
        pool.incref(0)


def test_freed_block_is_reused_first():
    # LIFO reuse makes a premature free corrupt someone's KV right away, so tests see it.
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.allocate(2)
    pool.decref(a)
    assert pool.allocate(1) == [a]


@pytest.mark.parametrize("num_blocks, block_size, field", [
    (0, 4, "num_blocks"), (4, 0, "block_size"), (2.5, 4, "num_blocks"), (4, "4", "block_size"),
])
def test_bad_sizes_are_rejected_naming_the_field(num_blocks, block_size, field):
    with pytest.raises(ValueError, match=field):
        BlockPool(num_blocks, block_size)


@pytest.mark.parametrize("block", [-1, 4, 1.0])
def test_bad_block_ids_are_rejected(block):
    pool = BlockPool(num_blocks=4, block_size=2)
    with pytest.raises(ValueError, match=r"block id must be an integer in \[0, 4\)"):
        pool.decref(block)


def test_negative_allocation_is_rejected():
    with pytest.raises(ValueError, match="n must be"):
        BlockPool(2, 2).allocate(-1)


def test_slot_mapping_follows_the_block_table():
    table = [5, 2, 7]
    assert slot_of(table, 0, 4) == 20
    assert slot_of(table, 5, 4) == 9
    assert slots_for(table, 3, 9, 4) == [23, 8, 9, 10, 11, 28]
    with pytest.raises(ValueError, match="past the block table"):
        slots_for(table, 0, 13, 4)


def test_integrity_check_catches_a_block_both_free_and_referenced():
    pool = BlockPool(num_blocks=3, block_size=2)
    (block,) = pool.allocate(1)
    pool._free.append(block)  # simulate a release that forgot the reference count
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_check_catches_a_leaked_block():
    pool = BlockPool(num_blocks=3, block_size=2)
    pool._free.pop()  # taken off the free list without a reference: leaked
    with pytest.raises(AssertionError, match="reference count 0 but is not on the free list"):
        pool.check_integrity()
