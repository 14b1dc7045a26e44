"""A model's weights in one region backed by 2 MiB (transparent huge) pages.

A decode step streams every weight once (~100 MB for the default model, GBs for larger
ones). In ordinary 4 KiB pages that is one TLB miss and a page walk every 4 KiB, and the
hardware prefetchers restart at every page boundary: on the Zen 4 machine the default
model decodes plain at batch 1 1.15-1.20x faster with its weights in huge pages
(`bench/huge_pages_ab.py`, docs/benchmarks.md "Huge pages"). Linux gives anonymous memory huge pages where asked
(`madvise(MADV_HUGEPAGE)`, transparent huge pages in "madvise" or "always" mode), so the
weights are copied once, at engine start, into one such mapping; each tensor becomes a
view of it. Nothing else changes: the same bytes, the same kernels.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch
import torch.nn as nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: every tensor starts on one, as PyTorch's allocator places them
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this OS gives anonymous memory huge pages when asked (Linux THP not "never")."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A (nbytes,) uint8 CPU tensor starting on a 2 MiB boundary, in an anonymous mapping
    advised for huge pages (the tensor keeps the mapping alive; pages fault in on first write)."""
    if nbytes <= 0:
        raise ValueError(f"huge_page_buffer needs a positive size, got {nbytes}")
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def move_to_huge_pages(module: nn.Module) -> int:
    """Copy every CPU parameter's and buffer's storage into one huge-page region and point
    the module's tensors at it (views with the same shapes, strides and offsets, so tensors
    that shared a storage still do). Returns the bytes moved (0: nothing on the CPU).

    The copies are exact and `module` computes the same numbers; what it held before is
    freed unless referenced elsewhere. Run it before anything keeps raw pointers to the
    weights (the engine calls it before enabling the kernels, which build the decoder stack
    from these tensors on first use).
    """
    # Every tensor's place first (a tied Parameter is met once per owner, and its .data
    # changes at the first), then the copies, then the views.
    slots: list[tuple[nn.Module, str, bool, torch.Tensor, tuple]] = []
    storages: dict[int, torch.UntypedStorage] = {}
    for owner in module.modules():
        for is_param, table in ((True, owner._parameters), (False, owner._buffers)):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or t.is_sparse:
                    continue
                storage = t.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage)
                slots.append((owner, name, is_param, t,
                              (storage.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)))
    if not storages:
        return 0
    offsets, total = {}, 0
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    region = huge_page_buffer(max(total, _ALIGN))
    for ptr, storage in storages.items():
        n = storage.nbytes()
        region[offsets[ptr]:offsets[ptr] + n].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    views: dict[tuple, torch.Tensor] = {}
    for _, _, _, t, key in slots:
        if key not in views:
            ptr, offset, shape, stride, dtype = key
            flat = region[offsets[ptr]:offsets[ptr] + storages[ptr].nbytes()].view(dtype)
            views[key] = flat.as_strided(shape, stride, flat.storage_offset() + offset)
    for owner, name, is_param, t, key in slots:
        if is_param:
            t.data = views[key]  # the same Parameter object: tied modules and optimisers keep it
        else:
            owner._buffers[name] = views[key]
    return total


def huge_page_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of the mapping holding `tensor` that the OS backs with huge pages right now
    (/proc/self/smaps AnonHugePages), or None where that cannot be read."""
    address = tensor.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(None, 1)[0]
        if "-" in head and ":" not in head:  # a mapping's header: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None
