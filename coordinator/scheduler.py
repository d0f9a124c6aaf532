"""Continuous batching with chunked prefill and page-counting preemption. Decides what runs
next; never moves bytes.

Each step takes, in order: one row for every running sequence that is decoding, then prompt
chunks of running sequences, then parked sequences restored (oldest first), then new sequences
from the queue, within `max_batch_seqs` and `max_batch_tokens`. Pages are counted, not tokens: a
partly filled tail page is charged in full and a step that crosses a page boundary costs a page.
When a running sequence cannot grow, sequences worse than it (lower priority, then newer) are
parked: their pages go to the park store and are freed. With the store full, a victim is
dropped to recompute from its token history instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .page_allocator import PageAllocator
from .sequence import Sequence


def pages_for(n_positions: int, page_size: int) -> int:
    """Pages that hold `n_positions`: a partly filled tail page counts in full."""
    return -(-n_positions // page_size)


@dataclass
class Move:
    seq: Sequence
    pages: list[int]
    slots: list[int]


@dataclass
class Schedule:
    batch: list[tuple[Sequence, int]] = field(default_factory=list)
    parks: list[Move] = field(default_factory=list)
    restores: list[Move] = field(default_factory=list)
    recomputed: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) pages

    def __bool__(self) -> bool:
        return bool(self.batch or self.parks or self.restores or self.recomputed or self.copies)


class Scheduler:
    def __init__(self, allocator: PageAllocator, park_slots: PageAllocator, page_size: int,
                 max_batch_seqs: int, max_batch_tokens: int):
        self.allocator = allocator
        self.park_slots = park_slots
        self.page_size = page_size
        self.max_batch_seqs = max_batch_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: deque[Sequence] = deque()  # oldest parked first
        self.copies: list[tuple[int, int]] = []  # copy-on-write tails for the next step

    def pages_needed(self, seq: Sequence, n: int) -> int:
        return pages_for(seq.n_computed + n, self.page_size) - len(seq.pages)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def holds(self, seq: Sequence) -> bool:
        return seq in self.running or seq in self.waiting or seq in self.parked

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and free its pages and park slots."""
        for queue in (self.running, self.waiting, self.parked):
            if seq in queue:
                queue.remove(seq)
        self.allocator.free(seq.pages)
        self.park_slots.free(seq.park_slots)
        seq.pages, seq.park_slots = [], []

    def rows(self, seq: Sequence, budget: int) -> int:
        """Rows `seq` runs next: its remaining tokens within the budget, up to a fork point."""
        n = min(seq.n_remaining, budget)
        return n if seq.fork_at is None else min(n, seq.fork_at - seq.n_computed)

    def schedule(self) -> Schedule:
        out = Schedule(copies=self.copies)
        self.copies = []
        budget = self.max_batch_tokens
        ready = [s for s in self.running if not s.in_flight]
        decoding = [s for s in ready if s.n_remaining == 1]
        for seq in decoding + [s for s in ready if s.n_remaining > 1]:
            if len(out.batch) >= self.max_batch_seqs or budget == 0:
                break
            if seq not in self.running:  # parked by an earlier sequence of this step
                continue
            n = self.rows(seq, budget)
            while not self.allocator.can_allocate(self.pages_needed(seq, n)):
                victim = self._victim(worse_than=seq, keep=[s for s, _ in out.batch])
                if victim is None:
                    break
                self.preempt(victim, out)
            if self._reserve(seq, n):
                out.batch.append((seq, n))
                budget -= n
        if out.parks or out.recomputed:
            return out  # never restore or admit in the step that had to make room
        while self.parked and len(out.batch) < self.max_batch_seqs and budget > 0:
            seq = self.parked[0]
            n = self.rows(seq, budget)
            if not self.allocator.can_allocate(len(seq.park_slots) + 1):
                return out  # restores go first: nothing new is admitted past a parked one
            self.parked.popleft()
            pages = self.allocator.allocate(len(seq.park_slots))
            out.restores.append(Move(seq, list(pages), list(seq.park_slots)))
            self.park_slots.free(seq.park_slots)
            seq.pages, seq.pages_sent, seq.park_slots = pages, len(pages), []
            self.running.append(seq)
            if self._reserve(seq, n):
                out.batch.append((seq, n))
                budget -= n
        while self.waiting and len(out.batch) < self.max_batch_seqs and budget > 0:
            seq = self.waiting[0]
            n = self.rows(seq, budget)
            if not self._reserve(seq, n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            out.batch.append((seq, n))
            budget -= n
        return out

    def fork(self, parent: Sequence) -> None:
        """n > 1: the parent has computed its prompt but the last token; each child shares the
        full pages read-only and gets its own copy of a partly filled tail page. A child that
        finds no page for its tail recomputes the prompt itself."""
        shared = parent.fork_at // self.page_size
        for child in parent.children:
            child.n_computed = parent.fork_at
            child.pages = parent.pages[:shared]
            self.allocator.share(child.pages)
            if shared < len(parent.pages):
                if not self.allocator.can_allocate(1):
                    self._drop_to_recompute(child)
                    continue
                tail = self.allocator.allocate(1)
                self.copies.append((parent.pages[shared], tail[0]))
                child.pages = child.pages + tail
            self.running.append(child)
        parent.fork_at, parent.children = None, []

    def _reserve(self, seq: Sequence, n: int) -> bool:
        need = self.pages_needed(seq, n)
        if not self.allocator.can_allocate(need):
            return False
        seq.pages += self.allocator.allocate(need)
        return True

    @staticmethod
    def _rank(seq: Sequence) -> tuple:
        """Smaller is worse: lower priority, then newer."""
        return (seq.priority, -seq.request.arrival, -seq.id)

    def _victim(self, worse_than: Sequence, keep: list[Sequence]) -> Sequence | None:
        idle = [s for s in self.running
                if not s.in_flight and s is not worse_than and s not in keep and s.pages
                and self._rank(s) < self._rank(worse_than)]
        return min(idle, key=self._rank, default=None)

    def pick_victim(self) -> Sequence | None:
        """The worst idle running sequence, whatever it is compared with."""
        idle = [s for s in self.running if not s.in_flight and s.pages]
        return min(idle, key=self._rank, default=None)

    def preempt(self, seq: Sequence, out: Schedule) -> None:
        """Park `seq` if the store has room, else drop it to recompute."""
        self.running.remove(seq)
        seq.preemptions += 1
        if self.park_slots.can_allocate(len(seq.pages)):
            slots = self.park_slots.allocate(len(seq.pages))
            out.parks.append(Move(seq, list(seq.pages), list(slots)))
            self.allocator.free(seq.pages)
            seq.pages, seq.pages_sent, seq.park_slots = [], 0, slots
            self.parked.append(seq)
        else:
            self._drop_to_recompute(seq)
            out.recomputed.append(seq)

    def recompute(self, seq: Sequence) -> None:
        """Preempt by recompute: drop its pages (or park slots); it re-runs its tokens when
        readmitted."""
        for queue in (self.running, self.parked):
            if seq in queue:
                queue.remove(seq)
        seq.preemptions += 1
        self._drop_to_recompute(seq)

    def _drop_to_recompute(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        self.park_slots.free(seq.park_slots)
        seq.pages, seq.park_slots = [], []
        seq.n_computed = 0
        seq.pages_sent = 0
        seq.announced = False
        self.waiting.appendleft(seq)
