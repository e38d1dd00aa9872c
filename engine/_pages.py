"""`PageAllocator`: reference-counted KV-cache pages, on the host.

Page 0 is the scratch page: empty block-table entries point at it and idle slots write their (ignored)
keys and values there, so it is never handed out. A page returns to the free list when its last
reference is released; the samples of one prompt hold references to the same prompt pages.
"""

from __future__ import annotations

import numpy as np

SCRATCH_PAGE = 0


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, dtype=np.int32)
        # LIFO: recently freed pages are reused first.
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but scratch)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh pages, each with one reference."""
        if count > len(self._free):
            raise OutOfPages(f"asked for {count} KV pages, {len(self._free)} free of {self.capacity}")
        pages = [self._free.pop() for _ in range(count)]
        self._refs[pages] = 1
        return pages

    def share(self, pages: list[int], times: int = 1) -> None:
        """`times` more references to each of `pages` (already allocated)."""
        if pages and times:
            assert np.all(self._refs[pages] > 0), f"sharing free pages {pages}"
            np.add.at(self._refs, pages, times)

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each of `pages`; pages left with none are free again."""
        if not pages:
            return
        assert SCRATCH_PAGE not in pages, "the scratch page is never allocated"
        np.subtract.at(self._refs, pages, 1)
        assert np.all(self._refs[pages] >= 0), f"released pages more often than referenced: {pages}"
        freed = [p for p in dict.fromkeys(pages) if self._refs[p] == 0]
        self._free.extend(freed)

    def check_idle(self) -> None:
        """The invariant when no sequence is running: every page is free, none referenced."""
        held = np.flatnonzero(self._refs)
        if held.size or self.num_free != self.capacity:
            raise AssertionError(f"engine idle but {held.size} KV pages referenced ({self.num_free} of {self.capacity} free)")
