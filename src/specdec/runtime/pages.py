"""The kernel's weights in transparent huge pages (2 MiB) where the OS offers them.

A pass streams every weight of the model from memory (47 MB for the default target, 730 MB for a Qwen2.5-0.5B body).
In 4 KiB pages that is a page-table walk every 4 KiB once the TLB's reach (a few MiB) is passed, and the hardware
prefetchers start each new page cold. In 2 MiB pages both go away: on a Zen 4 (2 threads, bf16 weights, 53 MB of
3456 x 640 products in turn, best of 7) a product of 16 rows took 203 µs against 220, 8 rows 121-124 against 128-133,
32 rows 367-372 against 386-389; a one-row product (memory-bound either way) alike.

Linux hands out huge pages to anonymous memory that asks for them (``madvise(MADV_HUGEPAGE)``) when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``; elsewhere the mapping is ordinary memory
and nothing else changes. ``SPECDEC_HUGE_PAGES=0`` keeps the weights where torch put them (for A/B runs). The bytes
are the same either way, so are the results.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.runtime.cpu import switched_off

HUGE_PAGE = 2 << 20
SWITCH = "SPECDEC_HUGE_PAGES"
ALIGN = 64  # each tensor's start: a cache line (the kernel's vector loads never straddle one at a panel's start)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), or None where there is none."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else None


def wanted() -> bool:
    """Whether weights go into huge pages: the OS gives them (``always``/``madvise``) and ``SPECDEC_HUGE_PAGES`` is
    not ``0``."""
    if switched_off(SWITCH):
        return False
    return thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


class HugePageArena:
    """One anonymous mapping, advised for huge pages and 2 MiB-aligned, that tensors are copied into back to back.

    Tensors placed in it (``place``) keep it alive: each holds a reference to the mapping through its buffer."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self._map = mmap.mmap(-1, self.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.advised = True
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP, a sandbox that refuses the call: ordinary pages, same bytes
            self.advised = False
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._next = (-self._bytes.data_ptr()) % HUGE_PAGE  # the first tensor on a huge-page boundary
        self._end = self._next + self.nbytes

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in the arena (same dtype, shape and bytes, contiguous)."""
        t = t.contiguous()
        n = t.numel() * t.element_size()
        start = self._next + (-self._next) % ALIGN
        if start + n > self._end:
            raise ValueError(f"the arena has {self._end - start} bytes left, not {n}")
        out = self._bytes[start : start + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self._next = start + n
        return out


def arena_for(sizes: Sequence[int]) -> HugePageArena | None:
    """An arena for tensors of these byte sizes, placed in turn, where ``wanted()``; else None (keep them as they are).
    Sized up front so that a caller can place each tensor as it makes it: loading never holds two copies of them all."""
    if not sizes or not wanted():
        return None
    return HugePageArena(sum(int(n) + ALIGN for n in sizes))
