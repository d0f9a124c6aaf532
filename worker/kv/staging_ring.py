"""The staging ring: each layer's window of host KV pages, delivered into a device slot ahead of
the layer that reads it.

The host pool is [n_layers, n_pages, 2, page, KVH, D]. A step's window (its batch's pages) is
packed into runs (host start page, count, slot offset), so one layer moves in one copy per run.
A slot is the window packed, [n, 2, page, KVH, D]. The buffer is sized for this step's window
(to a power of two, so a growing context reallocates rarely) and shared out evenly among the
slots: a slot starts every `stride` pages, so a window that grows keeps its slots in place.

Ring path, for layer l and m = l + depth (issued once layer l's attention is enqueued):

    transfer:  wait release[s(m)]; copy layer m's runs into slot s(m); record ready[s(m)]
    compute:   wait ready[s(l)]; write the step's rows; attend; record release[s(l)]

With depth + 2 slots, layer m recycles the slot of layer l - 2, so a delivery never queues
behind the layer just enqueued or the one before it, which a device may still be running.
Recycling is ordered stream to stream; the host never blocks on a slot. Slots are numbered across
steps, so deliveries past the last layer can be the next step's first layers (priming, one per
slot): for the same window, issued after this step's write-back, used if the next step's batch
continues this one on the same pages. The ring only copies pages as the host holds them: its
owner sees to it that they are up to date but for the last step's rows, and that a step which
reads them writes those rows into each slot itself (`HostKVPool`: a continuing step carries
them), so neither a prime nor an own delivery waits on the host for them.
Everything the compute side does to a slot follows a wait on a delivery queued after any prime
still landing, except on the ordered path, which drains the primes first.

A slot may hold a group of consecutive layers: the above with groups for layers, each layer's
window at its place in the slot (`layer_stride`); the compute side waits at a group's first layer
and releases after its last, so a captured step needs a graph a group, not a layer. Each step
takes the largest group up to `max_group` whose ring fits (SLOT_LAYERS by default, fewer where
that would leave less than depth + 2 slots); a smaller one before declining. When the slots move
(a new group, or the step before took the ordered path), the first deliveries wait for all the
compute enqueued before the step: every release event is recorded again at its start.

Ordered path (depth 0, or a declined step): copy then attend, one slot, on the compute side.
A step declines when its ring would pass the budget or its device lacks headroom for it, for
that step only: the decision is remade every step and costs a few integer comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..metrics import DECLINE_REASONS, TRANSFER_PATHS, WorkerMetrics
from .transport import Transport

HEADROOM_BYTES = 512 << 20  # device memory a ring must leave free for everything else
# A gap of unused pages up to this size is copied along with its neighbours: on a PCIe-class
# link a copy costs about as much as 256 KiB of bytes, so bridging is cheaper than splitting.
BRIDGE_BYTES = 256 << 10
SHRINK = 4  # give memory back once the buffer is this many times what the ring needs
# Layers a slot holds by default: a captured step launches 1 + ceil(L / 4) graphs rather than
# 1 + L, and each launch costs more while the link is busy (docs/kv-pipelining.md, "Slots of
# several layers").
SLOT_LAYERS = 4

Run = tuple[int, int, int]  # (host start page, page count, slot offset)


def pack(pages: list[int] | torch.Tensor, bridge: int = 0) -> list[Run]:
    """Sorted, distinct page ids -> runs; a gap of at most `bridge` pages joins its neighbours."""
    return pack_places(torch.as_tensor(pages, dtype=torch.int64), bridge)[0]


def pack_places(pages: torch.Tensor, bridge: int = 0) -> tuple[list[Run], torch.Tensor]:
    """`pack`, and each page's place in the slot. Vectorised: a window of thousands of pages (a
    batch at long contexts) is packed again whenever a sequence takes a page."""
    if not pages.numel():
        return [], pages
    first = torch.ones(pages.numel(), dtype=torch.bool)  # a page that starts a run
    first[1:] = pages[1:] - pages[:-1] - 1 > bridge
    last = first.roll(-1)  # a page that ends one
    starts = pages[first]
    counts = pages[last] + 1 - starts
    offsets = counts.cumsum(0) - counts
    run = first.cumsum(0) - 1
    places = offsets[run] + pages - starts[run]
    return list(zip(starts.tolist(), counts.tolist(), offsets.tolist(), strict=True)), places


def keeps_places(old: list[Run], new: list[Run]) -> bool:
    """Whether every page of window `old` has the same slot offset in window `new`: the same
    runs, but that the last may have grown and more may follow (pages added after them)."""
    *head, (start, count, off) = old
    k = len(head)
    return (len(new) > k and new[:k] == head and new[k][0] == start and new[k][2] == off
            and new[k][1] >= count)


def device_free_bytes(device: torch.device) -> int:
    """What a new allocation on `device` can use: free to the driver plus torch's idle cache."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


@dataclass
class RingStats:
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_PATHS, 0))
    copies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_PATHS, 0))
    declines: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DECLINE_REASONS, 0))
    ring_steps: int = 0
    ordered_steps: int = 0
    primed_steps: int = 0  # ring steps whose first layers were delivered during the last step
    wait_seconds: float = 0.0
    reallocations: int = 0


class StagingRing:
    def __init__(
        self, host: torch.Tensor, transport: Transport | None, device: torch.device | str,
        depth: int, budget_bytes: int = 0, free_bytes: Callable[[], int] | None = None,
        metrics: WorkerMetrics | None = None, group: int | None = None,
    ):
        """host: [L, n_pages, 2, page, KVH, D]; budget_bytes 0: no cap; free_bytes: the
        device's free memory (None: not checked); group: the most layers a slot holds (None:
        SLOT_LAYERS, or fewer to keep depth + 2 slots; the ordered path takes one at a time)."""
        self.host = host
        self.transport = transport
        self.device = torch.device(device)
        self.n_layers = host.shape[0]
        self.page_bytes = host[0, 0].numel() * host.element_size()  # one layer's K+V of a page
        self.depth = depth
        # A slot holds `group` consecutive layers' windows, delivered together, waited for at the
        # group's first layer and released after its last: a captured step launches a graph a
        # group, not a layer. depth and n_slots count groups; the group is chosen every step.
        if not depth:
            self.max_group = 1
        elif group:
            self.max_group = max(1, min(group, self.n_layers))
        else:
            self.max_group = max(1, min(SLOT_LAYERS, self.n_layers // (depth + 2)))
        self._shape(1)
        self.budget = budget_bytes
        self.free_bytes = free_bytes
        self.metrics = metrics
        self.stats = RingStats()
        # [capacity + 1, 2, page, KVH, D]; the last page is no slot's (spare_page)
        self.buf: torch.Tensor | None = None
        events = depth > 0 and transport is not None
        self.ready = [transport.event() for _ in range(depth + 2)] if events else []
        self.release = [transport.event() for _ in range(depth + 2)] if events else []
        self.ahead = False
        self.laid_out: tuple[bool, int] | None = None  # the last step's (ahead, group)
        self.prime_next = False
        # the window the next step's first layers hold, and the group they were delivered in
        self.primed: tuple[list[Run], int] | None = None
        # Slots are numbered across steps (group g of a step takes slot (base + g) % n_slots), so
        # a group primed for the next step follows the same ring order as any other delivery.
        self.base = 0
        self.issued = 0  # groups of this step below it are delivered or delivering
        self._windows = 0  # layer windows moved this step
        self.runs: list[Run] = []
        self.n = 0
        self.slots: list[torch.Tensor] = []
        # (buffer, n, slots, group) self.slots were cut for
        self._cut: tuple[int, int, int, int] | None = None
        # (group, slot) -> the (dst, src) pairs of its delivery, for this step's runs and slots
        self._pairs: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.shape[0] - 1

    @property
    def spare_page(self) -> int:
        """A page of the buffer in no slot: a captured step's padding rows write there."""
        return self.capacity

    @property
    def stride(self) -> int:
        """Pages from one slot to the next: the buffer shared out evenly, not cut to the
        window, so that a window that grows (a sequence's new page) keeps its slots where they
        are, and the layers primed for it with them, until the buffer itself must grow."""
        return self.capacity // self.n_slots

    @property
    def layer_stride(self) -> int:
        """Pages from one layer's window to the next inside a slot: on the ring path the
        slot's stride shared out among its layers, so that a growing window keeps them in place
        as the slots do; on the ordered path, packed."""
        return self.stride // self.group if self.ahead else self.n

    def page_bases(self) -> list[int]:
        """Where each layer's window starts in the buffer this step, in pages."""
        g, at = self.group, self.layer_stride
        if not self.ahead:
            return [layer % g * at for layer in range(self.n_layers)]
        stride = self.stride
        return [(self.base + layer // g) % self.n_slots * stride + layer % g * at
                for layer in range(self.n_layers)]

    # ---- per step ---------------------------------------------------------------------------

    def begin_step(self, runs: list[Run], reuse: bool = False, prime_next: bool = False) -> None:
        """Stage a step whose window is `runs`; on the ring path, deliver the first layers.

        reuse: the caller vouches that the bytes primed during the last step are still this
        step's (same sequences, continuing, on the same pages and maybe new ones after them),
        but for the last step's rows, which the step writes in; they are used if every page
        primed keeps its place in the window (the pages added are only read where the step
        writes them). prime_next: let `prime` deliver the next step's first layers for this
        window."""
        in_flight = self.primed is not None  # primes may still be landing
        primed = reuse and in_flight and keeps_places(self.primed[0], runs)
        primed_group = self.primed[1] if in_flight else 0
        self.primed = None
        self._windows = 0
        if runs != self.runs:
            self._pairs = {}
        self.runs = runs
        self.n = n = runs[-1][1] + runs[-1][2]
        group = self._take_ring()
        self.ahead = group > 0
        self._shape(group or 1)
        if in_flight and not self.ahead:
            # the ordered path writes its slot on the compute side, without waiting for events
            self.transport.synchronize()
        slots = self.n_slots if self.ahead else 1
        moved = self.stats.reallocations
        self._fit(n * self.group * slots)
        primed = (primed and self.ahead and primed_group == self.group
                  and moved == self.stats.reallocations)
        cut = (self.buf.data_ptr(), n, slots, self.group)
        if self._cut != cut:  # slicing is host time before the step
            self._cut = cut
            stride, size = self.stride, (self.group - 1) * self.layer_stride + n
            self.slots = [self.buf[i * stride:i * stride + size] for i in range(slots)]
            self._pairs = {}
        self.prime_next = prime_next and self.ahead and self.depth < self.n_groups
        laid_out, self.laid_out = self.laid_out, (self.ahead, self.group)
        if not self.ahead:
            self.stats.ordered_steps += 1
            return
        if laid_out != self.laid_out:
            self._fence()
        self.stats.ring_steps += 1
        self.stats.primed_steps += primed
        first = self.n_slots if primed else 0  # only a depth below n_groups is ever primed
        for m in range(first, min(self.depth, self.n_groups)):
            self._deliver(m)
        self.issued = max(first, self.depth)

    def acquire(self, layer: int) -> None:
        """Layer `layer`'s window in its slot (from its page base, `page_bases`) before what the
        compute side enqueues next: on the ordered path copied now, on the ring path waited for,
        at a group's first layer for the whole group."""
        g, i = divmod(layer, self.group)
        if not self.ahead:
            slot, host, at = self.slots[0], self.host[layer], i * self.layer_stride
            for start, count, off in self.runs:
                slot[at + off:at + off + count].copy_(host[start:start + count],
                                                      non_blocking=True)
            self._windows += 1
        elif not i:
            self.transport.wait(self.ready[(self.base + g) % self.n_slots])

    def release_slot(self, layer: int) -> None:
        """Layer `layer`'s attention is enqueued: after its group's last layer, free the slot and
        deliver the group `depth` on."""
        if not self.ahead:
            return
        g, i = divmod(layer, self.group)
        if i + 1 < self.group and layer + 1 < self.n_layers:
            return
        self.transport.record(self.release[(self.base + g) % self.n_slots])
        if self.issued <= g + self.depth < self.n_groups:
            self._deliver(g + self.depth)

    def prime(self) -> None:
        """After the step's last layer: deliver the next step's first layers for this window,
        one per slot, if `begin_step` was asked to. They land while the host finishes this step
        and plans the next, the link's time between steps; nothing waits for them but the
        layers that use them, each for its own. The pages lack this step's rows, which the
        next step writes into each slot before it reads it."""
        if not self.prime_next:
            return
        for m in range(self.n_groups, self.n_groups + self.n_slots):
            self._deliver(m)
        self.primed = (self.runs, self.group)

    def end_step(self) -> None:
        path = "ahead" if self.ahead else "ordered"
        self.count(path, self._windows * self.n * self.page_bytes, self._windows * len(self.runs))
        self._windows = 0
        if self.ahead:
            self.base = (self.base + self.n_groups) % self.n_slots
        if self.metrics is not None:
            self.metrics.ring(self.capacity * self.page_bytes, self.n_slots if self.ahead else 0)

    def settle(self, ev=None) -> None:
        """Block the host until `ev` (the step's write-back) has landed; without one (a step
        that stopped half-way), until every copy issued so far has."""
        if self.transport is None:
            return
        if ev is None:
            self.transport.synchronize()
        else:
            self.transport.host_wait(ev)
        waited = self.transport.wait_seconds()
        self.stats.wait_seconds += waited
        if self.metrics is not None and waited:
            self.metrics.wait(waited)

    def count(self, path: str, nbytes: int, copies: int) -> None:
        self.stats.bytes[path] += nbytes
        self.stats.copies[path] += copies
        if self.metrics is not None:
            self.metrics.transfer(path, nbytes, copies)

    # ---- internals --------------------------------------------------------------------------

    def _deliver(self, m: int) -> None:
        """Group m of this step into its slot; m >= n_groups: group m - n_groups of the next,
        a prime."""
        g, s = m % self.n_groups, (self.base + m) % self.n_slots
        layers = range(g * self.group, min((g + 1) * self.group, self.n_layers))
        pairs = self._pairs.get((g, s))
        if pairs is None:
            slot, at = self.slots[s], self.layer_stride
            pairs = self._pairs[g, s] = [
                (slot[i * at + off:i * at + off + count], self.host[layer][start:start + count])
                for i, layer in enumerate(layers) for start, count, off in self.runs]
        self._windows += len(layers)
        self.transport.copy(pairs, after=(self.release[s],), then=self.ready[s])

    def _shape(self, group: int) -> None:
        self.group = group
        self.n_groups = -(-self.n_layers // group)
        self.n_slots = self._slots(group)

    def _slots(self, group: int) -> int:
        """Slots of a ring whose slots hold `group` layers: depth + 2, or one per group."""
        return min(self.depth + 2, -(-self.n_layers // group))

    def _fence(self) -> None:
        """The slots moved since the last ring step: record every release again, after all the
        compute enqueued so far (the readers of whatever each slot now overlaps)."""
        for ev in self.release:
            self.transport.record(ev)

    def _take_ring(self) -> int:
        """The layers a slot holds this step, the most whose ring fits; 0: the ordered path."""
        if self.depth == 0:
            return 0
        if self.transport is None:
            return self._decline("unsupported")
        group = self.max_group
        while reason := self._misfit(group):
            if group == 1:
                return self._decline(reason)
            group //= 2
        return group

    def _misfit(self, group: int) -> str | None:
        """Why a ring of slots of `group` layers would not fit this step, or None."""
        need = self._slots(group) * group * self.n * self.page_bytes
        if self.budget and need > self.budget:
            return "budget"
        grow = need - self.capacity * self.page_bytes
        if grow > 0 and self.free_bytes is not None and self.free_bytes() - grow < HEADROOM_BYTES:
            return "headroom"
        return None

    def _decline(self, reason: str) -> int:
        self.stats.declines[reason] += 1
        if self.metrics is not None:
            self.metrics.decline(reason)
        return 0

    def _fit(self, need: int) -> None:
        """Make the buffer hold `need` pages. It grows to a power of two (within the budget and
        the headroom), so a growing context reallocates rarely, and shrinks when it holds SHRINK
        times what this window's ring would need."""
        cap = self.capacity
        ring = self.n * self.group * (self.n_slots if self.depth else 1)
        if need <= cap <= SHRINK * ring:
            return
        if self.buf is not None and self.transport is not None:
            self.transport.synchronize()  # no copy may still be landing in the old buffer
        target = 1 << (need - 1).bit_length()
        if self.budget:
            target = min(target, max(need, self.budget // self.page_bytes))
        if target > need and self.free_bytes is not None:
            spare = self.free_bytes() + cap * self.page_bytes - HEADROOM_BYTES
            if target * self.page_bytes > spare:
                target = need
        self.buf, self.slots, self._cut = None, [], None  # the old buffer goes before the new
        # zeros, not empty: no slot ever holds NaN garbage, not even where a mask hides it
        self.buf = torch.zeros((target + 1, *self.host.shape[2:]), dtype=self.host.dtype,
                               device=self.device)
        if self.transport is not None:
            # the zeros are written on the compute side, into memory the allocator may hand
            # over from work still running there: no delivery may land in it before
            self.transport.synchronize()
        self.stats.reallocations += 1
