"""The host park store: where a parked sequence's pages wait, for this worker's layers.

Slots are slot-major ([n_slots, n_layers, page, KVH, D]) in host memory (pinned when the pool is
on a GPU), so a run of slots is one contiguous block: a park gathers the sequence's pages of every
layer on the pool's device into that order and copies the block out in one transfer per tensor;
a restore copies it back in one transfer and scatters it into whatever pages the coordinator
chose. (Pool-major slots made every park smaller than the whole store a strided copy, which the
driver moves at a few GB/s instead of the link's 55.) Every park is recorded, so a restore of
slots that do not hold that sequence is refused instead of silently loading someone else's KV.
"""

from __future__ import annotations

import torch

from protocol.errors import ProtocolError

from .pool import Pool


class ParkStore:
    def __init__(self, pool: Pool, n_slots: int):
        self.pool = pool
        self.n_slots = n_slots
        shape = (n_slots, pool.k.shape[0], *pool.k.shape[2:])
        pin = pool.k.device.type == "cuda"
        # empty, not zeros: host pages are only touched when something is parked in them
        self.k = torch.empty(shape, dtype=pool.k.dtype, pin_memory=pin)
        self.v = torch.empty(shape, dtype=pool.k.dtype, pin_memory=pin)
        self.records: dict[int, list[int]] = {}
        self.bytes_per_slot = pool.bytes_per_page

    def park(self, seq_id: int, pages: list[int], slots: list[int]) -> int:
        """Copy `pages` out to `slots`; returns bytes moved."""
        self._check(seq_id, pages, slots)
        idx = torch.tensor(pages, device=self.pool.k.device)
        for src, dst in ((self.pool.k, self.k), (self.pool.v, self.v)):
            block = src.index_select(1, idx).transpose(0, 1).contiguous()  # [n, L, page, KVH, D]
            self._write(dst, slots, block)
        self.records[seq_id] = list(slots)
        return len(pages) * self.bytes_per_slot

    def restore(self, seq_id: int, slots: list[int], pages: list[int]) -> int:
        """Copy `slots`, the last of those the sequence's park filled (its leading pages may
        have been found elsewhere since), back into `pages`; returns bytes moved. No slots and
        no pages: every page stayed resident or was found cached, and the park is forgotten."""
        if not slots and not pages:
            self.drop(seq_id)
            return 0
        record = self.records.get(seq_id)
        if record is None or not slots or record[len(record) - len(slots):] != list(slots):
            raise ProtocolError(f"sequence {seq_id}: the park store does not hold slots {slots}")
        self._check(seq_id, pages, slots)
        idx = torch.tensor(pages, device=self.pool.k.device)
        for src, dst in ((self.k, self.pool.k), (self.v, self.pool.v)):
            block = self._read(src, slots).to(dst.device, non_blocking=True)  # [n, L, ...]
            dst.index_copy_(1, idx, block.transpose(0, 1))
        del self.records[seq_id]
        return len(pages) * self.bytes_per_slot

    def drop(self, seq_id: int) -> None:
        self.records.pop(seq_id, None)

    def _check(self, seq_id: int, pages: list[int], slots: list[int]) -> None:
        if len(pages) != len(slots) or not pages:
            raise ProtocolError(f"sequence {seq_id}: {len(pages)} pages for {len(slots)} slots")
        if any(not 0 <= p < self.pool.n_pages for p in pages):
            raise ProtocolError(f"sequence {seq_id}: page id out of range")
        if any(not 0 <= s < self.n_slots for s in slots):
            raise ProtocolError(f"sequence {seq_id}: park slot out of range")

    def _write(self, dst: torch.Tensor, slots: list[int], block: torch.Tensor) -> None:
        s0 = _run_start(slots)
        if s0 is not None:
            dst[s0:s0 + len(slots)].copy_(block, non_blocking=True)
        else:
            dst.index_copy_(0, torch.tensor(slots), block.cpu())

    def _read(self, src: torch.Tensor, slots: list[int]) -> torch.Tensor:
        s0 = _run_start(slots)
        if s0 is not None:
            return src[s0:s0 + len(slots)]
        return src.index_select(0, torch.tensor(slots))


def _run_start(slots: list[int]) -> int | None:
    """The first slot if `slots` is one contiguous ascending run (one large copy), else None."""
    s0 = slots[0]
    return s0 if slots == list(range(s0, s0 + len(slots))) else None
