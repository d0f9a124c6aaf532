"""Continuous batching with chunked prefill and page-counting preemption: the engine core's
`schedule` / `update_from_output` pair. It decides what runs next and applies what the step
produced; it is the only class that changes a sequence's state, and it never moves bytes.

Each step takes, in order: one row for every running sequence that is decoding, then prompt
chunks of running sequences, then parked sequences restored (oldest first), then new sequences
from the queue, within `max_batch_seqs` and `max_batch_tokens`. The queue is fair between
clients: each request is tagged one past the later of its client's last tag and the tag last
admitted (start-time fair queuing), and admitted in tag order, so a client that sends a
thousand requests at once has them interleaved with everyone else's, not ahead of them.
Rows are shared fairly too: when every row is taken and the queue's next request is of a client
running at least two sequences fewer than the client running the most, that client's worst
sequence (lowest priority, then newest; never one above the newcomer's priority) is parked to
make the row, and a parked sequence is not restored past the queue's next request while its
client runs more than that request's. So long requests of one client, filling every row, give
way to another client's within a step instead of when they end.

Pages are counted, not tokens: a partly filled tail page is charged in full and a step that
crosses a page boundary costs a page.
When a running sequence cannot grow, sequences worse than it (lower priority, then newer) are
parked: their pages go to the park store and are freed. With the store full, a victim is
dropped to recompute from its token history instead.

A sequence ends here too: on a stop token or its length (`update_from_output`), or when its
frontend cancels it (a stop string, a client gone) or its step fails.

**Planning ahead** (`plan_ahead`, for a worker that is the whole pipeline): a sequence with rows
in flight may have its next ones planned before their results are back: its prompt's next
chunk, or, where its rows in flight end in a sampled token, a row whose input is the token the
worker drew for it last, on the device (`SeqPlan.after`). The engine core keeps several steps
in flight this way, so the worker has the next step while the device runs this one
(docs/overlap-scheduling.md). A row planned past a token that ends the sequence (a stop token,
which only the result shows) computes for nothing; its result is dropped. Nothing is planned
past a sequence's length, and a sequence with rows in flight is never preempted: one that finds
no page waits for its rows to return.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter, deque

from .page_allocator import PageAllocator, pages_for
from .prefix_cache import PrefixCache
from .schedule import Move, Schedule, StepOutput
from .sequence import Request, Sequence

SEED_STRIDE = 0x9E3779B97F4A7C15  # choice i of a request draws from seed + i * SEED_STRIDE


class Scheduler:
    def __init__(self, allocator: PageAllocator, park_slots: PageAllocator, page_size: int,
                 max_batch_seqs: int, max_batch_tokens: int, preempt_every: int = 0,
                 prefill_hold: float = 0.0, prefix_cache: PrefixCache | None = None,
                 plan_ahead: bool = False):
        self.allocator = allocator
        self.park_slots = park_slots
        self.page_size = page_size
        self.max_batch_seqs = max_batch_seqs
        self.max_batch_tokens = max_batch_tokens
        self.preempt_every = preempt_every  # test knob: park everyone every K decode steps
        self.prefill_hold = prefill_hold  # seconds new prompts may wait while others decode
        self.cache = prefix_cache  # None: every prompt is computed in full
        self.plan_ahead = plan_ahead  # plan rows on tokens still in flight
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: deque[Sequence] = deque()  # oldest parked first
        self.copies: list[tuple[int, int]] = []  # copy-on-write tails for the next step
        self.to_free: list[int] = []  # ended sequences the workers still hold
        self.eos_ids: frozenset[int] = frozenset()
        self.max_context = 1 << 62
        self.steps_in_flight = 0
        self.decode_steps = 0  # since everyone was last parked (preempt_every)
        self.next_id = 0
        self.admitted_tag = 0  # the fair queue's clock: the tag of the last request admitted
        self.client_tags: dict[str, int] = {}  # each client's last tag

    def set_model(self, eos_ids: frozenset[int], max_context: int) -> None:
        self.eos_ids, self.max_context = eos_ids, max_context

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def pages_needed(self, seq: Sequence, n: int) -> int:
        """Pages `seq` lacks for `n` more positions (negative: it holds more)."""
        return pages_for(seq.next_position + n, self.page_size) - len(seq.pages)

    def add_request(self, req: Request) -> None:
        """Queue a request's `n` choices. They compute the prompt once: the first stops before
        its last token and hands its pages to the others (`fork`)."""
        p = req.params.sampling
        tag = max(self.admitted_tag, self.client_tags.get(req.client, 0)) + 1
        self.client_tags[req.client] = tag
        if len(self.client_tags) > 4096:  # clients that are not ahead of the clock need no tag
            self.client_tags = {c: t for c, t in self.client_tags.items()
                                if t > self.admitted_tag}
        seed = p.seed if p.seed is not None else secrets.randbits(62)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        req.stop_ids = frozenset(stops)
        for i in range(p.n):
            req.seqs.append(Sequence(
                id=self.next_id, request=req, index=i, token_ids=list(req.prompt_ids),
                seed=seed if i == 0 else (seed + i * SEED_STRIDE) % (1 << 62), tag=tag))
            self.next_id += 1
        parent = req.seqs[0]
        self.add(parent)
        if p.n > 1 and len(req.prompt_ids) > 1:
            parent.fork_at, parent.children = len(req.prompt_ids) - 1, req.seqs[1:]
        else:
            for seq in req.seqs[1:]:
                self.add(seq)

    def add(self, seq: Sequence) -> None:
        """Queue `seq` after every waiting sequence whose tag is not later than its own."""
        later = 0
        for other in reversed(self.waiting):
            if other.tag <= seq.tag:
                break
            later += 1
        self.waiting.insert(len(self.waiting) - later, seq)

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
        return n if seq.fork_at is None else min(n, seq.fork_at - seq.next_position)

    def next_step(self) -> Schedule:
        """The next step to send (empty: nothing to send now), with the preemption policy
        around `schedule`. Marks what it takes in flight until `update_from_output` or
        `fail_step` gives it back."""
        if self.preempt_every and self.decode_steps >= self.preempt_every:
            # With several stages some step is nearly always in flight, so a due park holds new
            # steps back until none is, rather than waiting for a moment that may not come.
            if self.steps_in_flight:
                return Schedule()
            self.decode_steps = 0
            out = Schedule()
            for seq in [s for s in self.running if s.pages]:
                self.preempt(seq, out)
            if out:
                return self._emit(out)
        out = self.schedule()
        if not out and not self.steps_in_flight:
            # Nothing fits and nothing runs (pages shared between `n` completions do not come
            # back when one holder leaves): preempt the worst sequence so the others can grow.
            victim = self.pick_victim()
            if victim is not None:
                self.preempt(victim, out)
        return self._emit(out) if out else out

    def _emit(self, out: Schedule) -> Schedule:
        sampled = firsts = 0
        for seq, n in out.batch:
            start = seq.next_position
            samples = n == seq.n_remaining
            sampled += samples
            firsts += samples and not (seq.n_generated or seq.tokens_ahead)
            out.starts.append(start)
            out.samples.append(samples)
            out.after.append(start >= len(seq.token_ids))
            out.epochs.append(seq.epoch)
            seq.rows_ahead += n
            seq.tokens_ahead += samples
            if seq.pages_sent < len(seq.pages):
                out.new_pages[seq.id] = seq.pages[seq.pages_sent:]
                seq.pages_sent = len(seq.pages)
            if not seq.announced:
                out.announce.add(seq.id)
                seq.announced = True
        out.only_first_tokens = sampled > 0 and firsts == sampled
        out.free = self.to_free + [seq.id for seq in out.recomputed]
        self.to_free = []
        if out.batch and all(n == 1 for _, n in out.batch):
            self.decode_steps += 1
        self.steps_in_flight += 1
        return out

    def update_from_output(self, sched: Schedule, seq_ids: list[int],
                           tokens: list[int]) -> StepOutput:
        """Apply a step's results: rows computed, forks made, tokens appended, and sequences
        that reached a stop token or their length ended."""
        self.steps_in_flight -= 1
        sampled = dict(zip(seq_ids, tokens))
        out = StepOutput()
        for (seq, n), samples, after, epoch in zip(sched.batch, sched.samples, sched.after,
                                                   sched.epochs):
            if seq.finish_reason is not None or epoch != seq.epoch:
                out.ahead_dropped += after
                continue  # rows planned past its end, or before its KV was dropped
            out.ahead_used += after
            seq.rows_ahead -= n
            seq.tokens_ahead -= samples
            seq.n_computed += n
            if self.cache is not None:
                self.cache.add(seq)
            if seq.fork_at == seq.n_computed:
                self.fork(seq)
            token = sampled.get(seq.id)
            if token is None:
                continue
            seq.token_ids.append(token)
            out.tokens.append((seq, token))
            p = seq.request.params.sampling
            if token in seq.request.stop_ids:
                seq.finish_reason = "stop"
            elif seq.n_generated >= p.max_tokens or len(seq.token_ids) >= self.max_context:
                seq.finish_reason = "length"
            else:
                continue
            self.remove(seq)
            self.to_free.append(seq.id)
            out.finished.append(seq)
        return out

    def finish(self, seq: Sequence, reason: str) -> bool:
        """End a sequence before the workers did (a stop string, an abort, a failure): forget it
        and free its pages. False if it had ended already."""
        if seq.finish_reason is not None:
            return False
        seq.finish_reason = reason
        if seq.pages or seq.park_slots or self.holds(seq):
            self.remove(seq)
            self.to_free.append(seq.id)
        return True

    def fail_step(self, sched: Schedule, seq_ids: list[int]) -> tuple[list[Sequence],
                                                                        list[Sequence]]:
        """A step failed in a worker: the sequences it named fail (all of them if it named
        none); the rest recompute from their tokens, since how far each stage got is unknown.
        Returns (failed, recomputed); the caller ends the failed ones' requests."""
        self.steps_in_flight -= 1
        current = [s for (s, _), epoch in zip(sched.batch, sched.epochs) if epoch == s.epoch]
        involved = current + [m.seq for m in sched.parks + sched.restores]
        failed, recomputed = [], []
        for seq in dict.fromkeys(involved):
            if seq.finish_reason is not None:
                continue
            if not seq_ids or seq.id in seq_ids:
                failed.append(seq)
            else:
                self.recompute(seq)
                self.to_free.append(seq.id)
                recomputed.append(seq)
        return failed, recomputed

    def recompute_all(self) -> int:
        """The workers restarted and every sequence's KV is gone: re-run their tokens from
        scratch, oldest first. Returns how many were preempted."""
        every = list(self.parked) + self.running
        for seq in sorted(every, key=lambda s: (s.request.arrival, s.id), reverse=True):
            self.recompute(seq)  # appendleft: the oldest ends up first
        self.to_free = []  # the new workers start with empty page tables
        self.steps_in_flight = 0
        if self.cache is not None:  # and without any KV
            self.cache.clear()
        return len(every)

    def schedule(self) -> Schedule:
        """The next batch within the limits: decodes, prompt chunks, restores, new sequences;
        pages reserved for it, sequences that had to make room preempted."""
        out = Schedule(copies=self.copies)
        self.copies = []
        self._share_rows(out)
        budget = self.max_batch_tokens
        ready = [s for s in self.running if not s.in_flight or self._follows(s)]
        decoding = [s for s in ready if s.n_remaining == 1]
        for seq in decoding + [s for s in ready if s.n_remaining > 1]:
            if len(out.batch) >= self.max_batch_seqs or budget == 0:
                break
            if (out.parks or out.recomputed) and self._preempted(seq, out):
                continue  # by an earlier sequence of this step
            n = self.rows(seq, budget)
            while (need := self.pages_needed(seq, n)) > 0 and not self.allocator.can_allocate(need):
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
            if self._yields_row(seq):
                break
            n = self.rows(seq, budget)
            hits = self._cached_run(seq)
            idle = sum(1 for p in hits if self.allocator.refs[p] == 0)
            moved = len(seq.park_slots) - len(hits)
            if not self.allocator.can_allocate(moved + idle + 1):
                return out  # restores go first: nothing new is admitted past a parked one
            self.parked.popleft()
            self.allocator.share(hits)
            pages = self.allocator.allocate(moved)
            out.restores.append(Move(seq, list(pages), seq.park_slots[len(hits):],
                                     kept=seq.pages + hits))
            self.park_slots.free(seq.park_slots)
            first = len(seq.pages) + len(hits)
            seq.pages = seq.pages + hits + pages
            seq.pages_sent, seq.park_slots = len(seq.pages), []
            if self.cache is not None:
                self.cache.restored(seq, first)
            self.running.append(seq)
            if self._reserve(seq, n):
                out.batch.append((seq, n))
                budget -= n
        if out.batch and all(n == 1 for _, n in out.batch) and self._hold_prefills():
            return out  # a decode-only step
        while self.waiting and len(out.batch) < self.max_batch_seqs and budget > 0:
            seq = self.waiting[0]
            cached = self._take_cached(seq)
            n = self.rows(seq, budget)
            if not self._reserve(seq, n):
                if cached:
                    self.cache.give_back(seq)
                break
            self.waiting.popleft()
            self.admitted_tag = max(self.admitted_tag, seq.tag)
            self.running.append(seq)
            out.batch.append((seq, n))
            budget -= n
        return out

    def _follows(self, seq: Sequence) -> bool:
        """Whether a sequence with rows in flight may have its next rows planned now: its
        prompt's next chunk (short of a fork point), or a row on the token its rows in flight
        sample, where that token cannot be its last by length."""
        if not self.plan_ahead:
            return False
        if not seq.tokens_ahead:  # prompt chunks in flight: the next one's tokens are known
            return seq.n_remaining > 0 and (seq.fork_at is None
                                            or seq.next_position < seq.fork_at)
        return (seq.n_generated + seq.tokens_ahead < seq.request.params.sampling.max_tokens
                and len(seq.token_ids) + seq.tokens_ahead < self.max_context)

    def _cached_run(self, seq: Sequence) -> list[int]:
        """The pages of the prefix cache holding a parked sequence's next full pages, from its
        first parked one on, as far as they are cached: those need no restore."""
        if self.cache is None:
            return []
        start = len(seq.pages)  # the pages it kept resident
        return self.cache.lookup(seq.page_keys[start:start + len(seq.park_slots)])

    def _take_cached(self, seq: Sequence) -> bool:
        """A sequence about to start from nothing takes the cached pages its tokens begin with;
        it still computes at least one row (its last prompt token, or the one before a fork)."""
        if self.cache is None or seq.pages or seq.n_computed:
            return False
        end = seq.fork_at if seq.fork_at is not None else len(seq.token_ids)
        self.cache.take(seq, end - 1)
        return bool(seq.pages)

    def _clients_running(self) -> Counter[str]:
        return Counter(s.request.client for s in self.running)

    def _share_rows(self, out: Schedule) -> None:
        """Every row taken, and the queue's next sequence of a client running at least two
        fewer than the one running the most: park that one's worst idle sequence (not above the
        newcomer's priority), whose row the newcomer takes next step."""
        if not self.waiting or len(self.running) < self.max_batch_seqs:
            return
        head = self.waiting[0]
        counts = self._clients_running()
        hog, most = counts.most_common(1)[0]
        if counts[head.request.client] + 2 > most:
            return
        idle = [s for s in self.running if s.request.client == hog and not s.in_flight
                and s.pages and s.priority <= head.priority]
        if idle:
            self.preempt(min(idle, key=self._rank), out)

    def _yields_row(self, parked: Sequence) -> bool:
        """Whether a parked sequence waits for the queue's next one: its client runs more
        sequences than that one's (the rows went to it fairly; `_share_rows`)."""
        if not self.waiting:
            return False
        counts = self._clients_running()
        head = self.waiting[0]
        return (parked.request.client != head.request.client and head.priority >= parked.priority
                and counts[parked.request.client] > counts[head.request.client])

    def _hold_prefills(self) -> bool:
        """`prefill_hold`: while sequences decode, keep new prompts back until the oldest has
        waited that long or they would fill half a step's rows, so that most steps decode only
        (and replay CUDA graphs) and prompts prefill together. Costs their first token up to
        `prefill_hold` seconds."""
        if not self.prefill_hold or not self.waiting:
            return False
        if time.monotonic() - self.waiting[0].request.arrival >= self.prefill_hold:
            return False
        return sum(s.n_remaining for s in self.waiting) < self.max_batch_tokens // 2

    @staticmethod
    def _preempted(seq: Sequence, out: Schedule) -> bool:
        return seq in out.recomputed or any(m.seq is seq for m in out.parks)

    def fork(self, parent: Sequence) -> None:
        """n > 1: the parent has computed its prompt but the last token; each child shares the
        full pages read-only and gets its own copy of a partly filled tail page. A child that
        finds no page for its tail recomputes the prompt itself."""
        shared = parent.fork_at // self.page_size
        for child in parent.children:
            child.n_computed = parent.fork_at
            child.pages = parent.pages[:shared]
            child.page_keys = parent.page_keys[:shared]
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
        if need <= 0:  # its pages cover it already (most decode steps)
            return True
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
        """Park `seq` if the store has room, else drop it to recompute. Its leading pages that
        another sequence holds too (a cached prefix, a forked prompt) stay resident and held,
        not copied: parking them would free nothing."""
        self.running.remove(seq)
        seq.preemptions += 1
        shared = 0
        while shared < len(seq.pages) and self.allocator.refs[seq.pages[shared]] > 1:
            shared += 1
        # pages past its computed rows hold nothing yet: freed, not parked
        held = max(shared, pages_for(seq.n_computed, self.page_size))
        self.allocator.free(seq.pages[held:])
        seq.pages = seq.pages[:held]
        moved = seq.pages[shared:]
        if self.park_slots.can_allocate(len(moved)):
            slots = self.park_slots.allocate(len(moved))
            if moved:
                out.parks.append(Move(seq, list(moved), list(slots)))
            self.allocator.free(moved)
            seq.pages, seq.pages_sent, seq.park_slots = seq.pages[:shared], 0, slots
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
        seq.pages, seq.park_slots, seq.page_keys = [], [], []
        seq.n_computed = seq.rows_ahead = seq.tokens_ahead = 0
        seq.epoch += 1
        seq.pages_sent = 0
        seq.announced = False
        self.waiting.appendleft(seq)
