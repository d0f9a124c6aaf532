"""Page ids of the KV pool (or slots of the park store): integer bookkeeping only, the workers
own the bytes.

Check-then-act: `can_allocate` never mutates; `allocate` assumes it was checked. A page freed by
every holder returns to the free list; reference counts let `n > 1` completions share pages.
The free list is a FIFO: a freed page goes to the back, so a restored sequence lands on other
pages than it left (placement bugs show up), and consecutive allocations tend to be runs.
"""

from __future__ import annotations

from collections import deque


def pages_for(n_positions: int, page_size: int) -> int:
    """Pages that hold `n_positions`: a partly filled tail page counts in full."""
    return -(-n_positions // page_size)


class PageAllocator:
    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.free_pages = deque(range(n_pages))
        self.refs = [0] * n_pages

    @property
    def n_free(self) -> int:
        return len(self.free_pages)

    @property
    def n_used(self) -> int:
        return self.n_pages - len(self.free_pages)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_pages)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_pages), "allocate() without can_allocate()"
        pages = [self.free_pages.popleft() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0
            self.refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"page {p} freed twice"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_pages.append(p)
