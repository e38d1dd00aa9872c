"""`PageAllocator`: reference-counted KV-cache pages, on the host.

Page 0 is the scratch page: empty block-table entries point at it and idle slots write their (ignored)
keys and values there, so it is never handed out. A page returns to the free list when its last
reference is released; the samples of one prompt hold references to the same prompt pages.
"""

from __future__ import annotations

SCRATCH_PAGE = 0


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        # A list, not a numpy array: calls touch a few pages each, thousands of times a second, and
        # numpy's per-call cost (`np.subtract.at` most) was the engine thread's largest host cost.
        self._refs = [0] * num_pages
        self._references = 0  # the sum of `_refs`: the idle check is O(1)
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
        for page in pages:
            self._refs[page] = 1
        self._references += count
        return pages

    def share(self, pages: list[int], times: int = 1) -> None:
        """`times` more references to each of `pages` (already allocated)."""
        refs = self._refs
        for page in pages:
            assert refs[page] > 0, f"sharing free page {page}"
            refs[page] += times
        self._references += len(pages) * times

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each of `pages`; pages left with none are free again."""
        if not pages:
            return
        assert SCRATCH_PAGE not in pages, "the scratch page is never allocated"
        refs = self._refs
        for page in pages:
            refs[page] -= 1
            assert refs[page] >= 0, f"released page {page} more often than referenced"
            if refs[page] == 0:
                self._free.append(page)
        self._references -= len(pages)

    def check_idle(self) -> None:
        """The invariant when no sequence is running: every page is free, none referenced."""
        if self._references or self.num_free != self.capacity:
            raise AssertionError(f"engine idle but {self._references} KV page references held ({self.num_free} of {self.capacity} pages free)")
