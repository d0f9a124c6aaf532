"""Page ids of the KV pool (or slots of the park store): integer bookkeeping only, the workers
own the bytes.

Check-then-act: `can_allocate` never mutates; `allocate` assumes it was checked. A page freed by
every holder returns to the free list; reference counts let `n > 1` completions share pages.
The free list is a FIFO: a freed page goes to the back, so a restored sequence lands on other
pages than it left (placement bugs show up), and consecutive allocations tend to be runs.
A page can be retained (the prefix cache's pages): freed by every holder, it waits idle, still
counted as allocatable, and is reused only once the free list is empty, least recently used
first, so reclaiming cached pages always comes before preempting anyone.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


def pages_for(n_positions: int, page_size: int) -> int:
    """Pages that hold `n_positions`: a partly filled tail page counts in full."""
    return -(-n_positions // page_size)


class PageAllocator:
    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.free_pages = deque(range(n_pages))
        self.refs = [0] * n_pages
        # Pages someone wants kept when their last holder frees them (the prefix cache's): they
        # wait in `idle`, least recently freed first, and are handed out only when the free
        # list is empty; `on_evict(page)` is told when one is.
        self.retained: set[int] = set()
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.on_evict: Callable[[int], None] | None = None
        self.evictions = 0

    @property
    def n_free(self) -> int:
        """Pages that can be allocated: the free ones and the idle retained ones."""
        return len(self.free_pages) + len(self.idle)

    @property
    def n_used(self) -> int:
        """Pages some sequence holds."""
        return self.n_pages - self.n_free

    @property
    def n_unused(self) -> int:
        """Pages that can be allocated without evicting a cached one."""
        return len(self.free_pages)

    def can_allocate(self, n: int) -> bool:
        return n <= self.n_free

    def allocate(self, n: int) -> list[int]:
        assert n <= self.n_free, "allocate() without can_allocate()"
        pages = []
        for _ in range(n):
            if self.free_pages:
                pages.append(self.free_pages.popleft())
                continue
            page, _ = self.idle.popitem(last=False)  # the least recently used
            self.retained.discard(page)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(page)
            pages.append(page)
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Another holder of `pages`, which are held or idle (a retained page taken again)."""
        for p in pages:
            if self.refs[p] == 0:
                del self.idle[p]  # KeyError: neither held nor idle, a bug
            self.refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"page {p} freed twice"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.retained:
                    self.idle[p] = None
                else:
                    self.free_pages.append(p)

    def retain(self, page: int) -> None:
        """Keep `page` (held now) idle when its last holder frees it, until it is needed."""
        assert self.refs[page] > 0
        self.retained.add(page)

    def release_all(self) -> None:
        """Retain nothing any more: idle pages go back to the free list."""
        self.retained.clear()
        self.free_pages.extend(self.idle)
        self.idle.clear()
