"""Host-resident KV: the worker's pages in host memory (pinned when the device is CUDA),
attended through the staging ring.

`HostKVPool` is a `Pool` (worker/kv/pool.py) as `KVPool` is, so the runner, the park store
and the step graphs work on it unchanged. Its layout, [n_layers, n_pages, 2, page,
KVH, D], keeps one layer's K and V of a run of pages in one block: a run is one copy.

A step:
- `begin_step` packs the batch's pages into the window and renumbers the step's page tables and
  write pages into the slot, once (never per layer): the meta it returns, which the layers
  attend with; when the batch continues the last step's on the same pages, the ring's first
  layers were already delivered during the last step (primed);
- each layer's `enter` takes its slot from the ring, the step (worker/step.py) writes the
  step's new rows into it and attends over it with the same paged attention as the device
  pool, and `leave` releases it;
- `end_step` copies every layer's new rows back in one device-to-host copy on the transport's
  write-back side, after the compute side has recorded that they exist (on a side of its own:
  the next step's primes copy on the transfer side while the step's last layers compute);
- those rows are scattered into their pages on the host (`_land`, waiting for that copy) one
  step late: in the next step's `end_step`, once that step's layers are all enqueued, or when
  `settle` is called because something else on the host (a park, a restore, a page copy) is
  about to touch the pages. Until then the host pages lack them, and so do the slots copied from
  those pages (the primes, and the next step's own deliveries): a step that continues the last
  one **carries** its rows, kept on the device, and writes them into each slot before its own
  (`carried`; on the same places, which a continuing window keeps). So a continuing step has
  every layer enqueued before the host waits for the last one's write-back (in its end_step):
  the host can enqueue it while the device still runs the last. A step that does not continue
  lands them in `begin_step`, before the ring reads a page.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from functools import partial
from itertools import chain
from typing import NamedTuple

import torch

from ..attention import PagedAttention
from ..batch import BatchMeta, int64s, to_device
from ..metrics import WorkerMetrics
from .staging_ring import BRIDGE_BYTES, StagingRing, device_free_bytes, keeps_places, pack_places
from .transport import Transport, make_transport

log = logging.getLogger("siding.worker")


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Zeros in host memory, page-locked when `pin`. Registered in place rather than through
    `pin_memory=True`, whose caching allocator rounds a size up to a power of two."""
    t = torch.zeros(shape, dtype=dtype)
    if not pin or not t.numel():
        return t
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
        code = int(getattr(err, "value", err))
    except (AttributeError, RuntimeError) as e:
        code = str(e)
    if code != 0:
        log.warning("cudaHostRegister failed (%s); pinning through the caching allocator", code)
        return t.pin_memory()
    weakref.finalize(t, _unregister, t.data_ptr()).atexit = False  # exit frees it anyway
    return t


class LastStep(NamedTuple):
    """What the next step carries of the last one, if it continues it."""

    rows: torch.Tensor  # [L, 2, T, KVH, D], on the device
    pages: torch.Tensor  # [T], where they went in the last step's slot
    offsets: torch.Tensor  # [T]
    runs: list  # the last step's window: the places must still hold
    decode: bool  # a decode step: a carried row count is the next step's


def _unregister(ptr: int) -> None:
    torch.cuda.synchronize()  # no copy may still read the pages
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostKVPool:
    def __init__(
        self, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, attention: PagedAttention, depth: int = 1,
        ring_budget_mib: int = 0, metrics: WorkerMetrics | None = None,
        transport: Transport | None = None, bridge_bytes: int = BRIDGE_BYTES,
        slot_layers: int | None = None,
    ):
        """ring_budget_mib 0: no cap. transport None: the device's own (`make_transport`).
        slot_layers: the most layers a ring slot holds (`StagingRing`'s group; None: its
        default)."""
        self.device = torch.device(device)
        shape = (n_layers, n_pages, 2, page_size, n_kv_heads, head_dim)
        self.kv = host_zeros(shape, dtype, pin=self.device.type == "cuda")
        self.k, self.v = self.kv[:, :, 0], self.kv[:, :, 1]  # [L, n_pages, page, KVH, D] views
        self.page_size = page_size
        self.n_pages = n_pages
        self.scale = head_dim**-0.5
        self.attention = attention
        self.transport = transport if transport is not None else make_transport(self.device)
        free = partial(device_free_bytes, self.device) if self.device.type == "cuda" else None
        self.ring = StagingRing(self.kv, self.transport, self.device, depth,
                                ring_budget_mib << 20, free, metrics, slot_layers)
        self.bridge = bridge_bytes // self.ring.page_bytes
        self.layers = [HostLayerView(self, i) for i in range(n_layers)]
        self.meta: BatchMeta | None = None  # the step's metadata, renumbered into the slot
        self.rows: list[torch.Tensor] = []  # k, v of each layer so far: [T, KVH, D] each
        self._last: LastStep | None = None
        # this step's carried rows (rows, slot pages, offsets), or None
        self.carried: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # the last step's (pages used, write pages) and what `_pack` made of them: a decode
        # step that adds no page reuses them (read-only on the device)
        self._layout: tuple | None = None
        self._batch: tuple | None = None  # (seq ids, pages used, context lengths) of this step
        self._prev: tuple | None = None  # the same, of the last step that completed
        self._write: tuple[list[int], list[int]] | None = None  # host (pages, offsets)
        self._writeback: tuple | None = None  # the last step's rows, until `_land`
        self._open = False  # a step began and has not ended
        self._wb_event = None if self.transport is None else self.transport.event()
        self._wb_done = None if self.transport is None else self.transport.event()
        self._wb_host: torch.Tensor | None = None
        if self.transport is not None:
            # at exit too: a copy thread still inside torch code while the interpreter tears
            # down aborts the process
            weakref.finalize(self, self.transport.close)

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    # What a captured step needs: the ring buffer by address, each layer's slot as a page
    # base, the ring's events between pieces, and the carried rows.
    carries = True

    @property
    def piece_layers(self) -> int:
        return self.ring.group

    def graph_key(self) -> tuple[int, int] | None:
        buf = self.ring.buf
        return None if buf is None else (buf.data_ptr(), buf.shape[0])

    def spare_page(self) -> int:
        return self.ring.spare_page

    def page_bases(self) -> list[int]:
        return self.ring.page_bases()

    def settle(self) -> None:
        """Bring the host pages up to date: the last step's rows scattered into them. Call it
        before the host reads or writes pages outside a step (park, restore, page copies)."""
        if self._open:  # a step stopped half-way: every copy it issued lands first
            self.ring.settle()
            self._open, self.rows = False, []
        self._land()

    def _land(self) -> None:
        """Wait for the last write-back and scatter its rows into their pages. Deliveries may
        still be reading those pages (primes, a continuing step's own): they are torn at most
        where these rows land, which is where a step that uses them writes its carried rows; a
        step that does not continue lands them before its first delivery."""
        if self._writeback is None:
            return
        self.ring.settle(self._wb_done)
        host, _, pages, offsets = self._writeback  # host: [L, 2, T, KVH, D]
        where = (slice(None), torch.tensor(pages), torch.tensor(offsets))
        self.kv.transpose(2, 3)[where] = host.transpose(1, 2)  # K and V at once
        self._writeback = None

    def begin_step(self, meta: BatchMeta, seq_ids: list[int]) -> BatchMeta:
        if self._open:
            self.settle()
        used, pages = meta.used_pages, meta.row_pages
        if self._layout is None or self._layout[0] != (used, pages):
            self._layout = ((used, pages), self._pack(used, pages))
        runs, slot_tables, slot_writes = self._layout[1]
        self.meta = replace(meta, tables=slot_tables, writes=slot_writes)
        self._write = (pages, meta.row_offsets)
        self.rows = []
        self._open = True
        self._batch = (tuple(seq_ids), used, meta.context_lens)
        reuse = self._continues(meta)
        self._prev = None  # until this step completes
        last = self._last
        self.carried = None
        if reuse and last.decode and keeps_places(last.runs, runs):
            self.carried = (last.rows, last.pages, last.offsets)
        else:  # the ring reads the pages as they are: they must hold the last step's rows
            self._land()
        self.ring.begin_step(runs, reuse and self.carried is not None,
                             prime_next=meta.decode_only)
        return self.meta

    def _pack(self, used: list[list[int]], pages: list[int]) -> tuple:
        """The window's runs, and the step's tables and write pages renumbered into the slot
        (on the device)."""
        flat = int64s(chain(chain.from_iterable(used), pages))
        window, where = flat.unique(return_inverse=True)  # sorted
        runs, places = pack_places(window, self.bridge)
        sizes = [len(table) for table in used] + [len(pages)]
        *slot_tables, slot_writes = to_device(places[where], sizes, self.device)
        return runs, slot_tables, slot_writes

    def _continues(self, meta: BatchMeta) -> bool:
        """Whether this step's batch is the last one's, each sequence going on from where it
        stopped on the pages it had (new pages after them are fine: every position of theirs
        that is read is written this step). Then no byte the last step primed has changed."""
        if self._prev is None:
            return False
        ids, used, _ = self._batch
        last_ids, last_used, last_lens = self._prev
        starts = [c - (meta.query_starts[b + 1] - meta.query_starts[b])
                  for b, c in enumerate(meta.context_lens)]
        return ids == last_ids and all(s == c and u[: len(lu)] == lu
                                       for s, c, u, lu in zip(starts, last_lens, used, last_used))

    def end_step(self) -> None:
        assert len(self.rows) == 2 * len(self.layers), "end_step before every layer attended"
        self._land()  # the last step's rows, which this step carried (the primes need them)
        rows = torch.stack(self.rows)
        rows = rows.view(len(self.layers), 2, *rows.shape[1:])  # [L, 2, T, KVH, D]
        self.rows = []
        if self.transport is None:
            host = rows.cpu()
        else:
            host = self._host_rows(rows.numel()).view(rows.shape)
            self.transport.record(self._wb_event)
            self.transport.copy_back([(host, rows)], after=(self._wb_event,),
                                    then=self._wb_done)
        # rows stays referenced until `_land`: the copy may still be reading it
        self._writeback = (host, rows, *self._write)
        self._open = False
        # rows stays referenced until the next end_step too: the next step's layers read it
        self._last = LastStep(rows, self.meta.write_pages, self.meta.write_offsets,
                              self.ring.runs, self.meta.decode_only)
        self.carried = None
        self._prev = self._batch
        self.ring.prime()
        self.ring.count("writeback", rows.nbytes, 1)
        self.ring.end_step()

    def _host_rows(self, numel: int) -> torch.Tensor:
        """A flat host buffer for the step's rows; replaced only after `_land`, with the
        write-back side idle."""
        if self._wb_host is None or self._wb_host.numel() < numel:
            size = 1 << (numel - 1).bit_length()
            self._wb_host = torch.empty(size, dtype=self.kv.dtype,
                                        pin_memory=self.device.type == "cuda")
        return self._wb_host[:numel]


class HostLayerView:
    """One layer of a HostKVPool: its slot in the ring, delivered before the layer's writes and
    reads and released after them."""

    def __init__(self, pool: HostKVPool, layer: int):
        self.pool = pool
        self.layer = layer

    def enter(self) -> None:
        """The layer's slot delivered (or, on the ordered path, copied) before what follows."""
        self.pool.ring.acquire(self.layer)

    def leave(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The layer's new rows (for the write-back) are written and its attention enqueued."""
        self.pool.rows += (k, v)
        self.pool.ring.release_slot(self.layer)

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ring buffer: a step reads the layer's slot from its page base."""
        buf = self.pool.ring.buf
        return buf[:, 0], buf[:, 1]
