"""Block ids, reference counts and the free list behind the paged KV cache.

The KV tensors themselves are owned by the engine (one preallocated tensor per model, the
target's and the draft's, both indexed by the same slot ids). This module only hands out
block ids: a block is `block_size` consecutive slots, and position p of a sequence lives in

    slot = block_table[p // block_size] * block_size + p % block_size

A block is either free (on the free list, reference count 0) or allocated (count >= 1).
Holders are the sequences whose block table contains it and the prefix tree, one
reference each; the block goes back to the free list when the last one lets go.
"""
from __future__ import annotations

from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    """Not enough free blocks to satisfy an allocation; nothing was allocated."""


class RefCountError(RuntimeError):
    """A reference-count misuse: a double free, or a reference taken on a free block."""


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The KV slot of `position` in a sequence with this block table."""
    return block_table[position // block_size] * block_size + position % block_size


def slots_for(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV slots of positions [start, end) in a sequence with this block table."""
    if end > len(block_table) * block_size:
        raise ValueError(f"end={end} is past the block table's {len(block_table)} blocks "
                         f"of {block_size} slots")
    return [slot_of(block_table, p, block_size) for p in range(start, end)]


class BlockPool:
    """A fixed set of KV blocks with reference counts and a free list."""

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # LIFO: a block freed too early is handed out again at once, so a use-after-free
        # bug corrupts someone's KV within a step and tests see it instead of it hiding.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        """Blocks with at least one holder."""
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        """Number of holders of `block` (0 = free)."""
        self._check_id(block)
        return self._ref_counts[block]

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks off the free list, each with reference count 1."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, only {len(self._free)} free "
                              f"of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def incref(self, block: int) -> None:
        """Add a holder to an allocated block."""
        self._check_id(block)
        if self._ref_counts[block] == 0:
            raise RefCountError(f"incref of free block {block}: only allocate() hands "
                                f"out free blocks")
        self._ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop a holder; returns True when this frees the block."""
        self._check_id(block)
        if self._ref_counts[block] == 0:
            raise RefCountError(f"decref of free block {block}: double free")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)
            return True
        return False

    def check_integrity(self) -> None:
        """Raise AssertionError unless the free list and the counts agree."""
        free = set(self._free)
        _ensure(len(free) == len(self._free), "a block is on the free list twice")
        for block, count in enumerate(self._ref_counts):
            _ensure(count >= 0, f"block {block} has reference count {count}")
            _ensure((count == 0) == (block in free),
                    f"block {block} has reference count {count} but is "
                    f"{'' if block in free else 'not '}on the free list")
        _ensure(len(free) + sum(c > 0 for c in self._ref_counts) == self.num_blocks,
                "free + allocated != total")

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block id must be an integer in [0, {self.num_blocks}), "
                             f"got {block!r}")


def _ensure(ok: bool, message: str) -> None:
    # An explicit raise, not `assert`: integrity checks must still run under `python -O`.
    if not ok:
        raise AssertionError(message)
