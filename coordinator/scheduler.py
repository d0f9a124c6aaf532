"""Continuous batching with chunked prefill. Decides what runs next; never moves bytes.

Each step takes, in order: one row for every running sequence that is decoding, then prompt
chunks of running sequences, then new sequences from the queue, within `max_batch_seqs` and
`max_batch_tokens`. Pages are counted, not tokens: a step that crosses a page boundary costs a
page. When running sequences cannot grow, the lowest-priority, newest one is preempted.
"""

from __future__ import annotations

from collections import deque

from .page_allocator import PageAllocator
from .sequence import Sequence


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_batch_seqs: int,
                 max_batch_tokens: int):
        self.allocator = allocator
        self.page_size = page_size
        self.max_batch_seqs = max_batch_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def pages_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page_size)

    def pages_needed(self, seq: Sequence, n: int) -> int:
        return self.pages_for(seq.n_computed + n) - len(seq.pages)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages = []

    def schedule(self) -> list[tuple[Sequence, int]]:
        batch: list[tuple[Sequence, int]] = []
        budget = self.max_batch_tokens
        ready = [s for s in self.running if not s.in_flight]
        decoding = [s for s in ready if s.n_remaining == 1]
        for seq in decoding + [s for s in ready if s.n_remaining > 1]:
            if len(batch) >= self.max_batch_seqs or budget == 0:
                break
            n = min(seq.n_remaining, budget)
            if self._reserve(seq, n):
                batch.append((seq, n))
                budget -= n
        while self.waiting and len(batch) < self.max_batch_seqs and budget > 0:
            seq = self.waiting[0]
            n = min(seq.n_remaining, budget)
            if not self._reserve(seq, n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _reserve(self, seq: Sequence, n: int) -> bool:
        need = self.pages_needed(seq, n)
        if not self.allocator.can_allocate(need):
            return False
        seq.pages += self.allocator.allocate(need)
        return True

    def pick_victim(self) -> Sequence | None:
        """Lowest priority first, then the newest; never one whose step is in flight."""
        idle = [s for s in self.running if not s.in_flight]
        if not idle:
            return None
        return min(idle, key=lambda s: (s.priority, -s.request.arrival, -s.id))

    def recompute(self, seq: Sequence) -> None:
        """Preempt by recompute: drop its pages; it re-runs its tokens when readmitted."""
        self.running.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.n_computed = 0
        seq.pages_sent = 0
        seq.announced = False
        seq.preemptions += 1
        self.waiting.appendleft(seq)
