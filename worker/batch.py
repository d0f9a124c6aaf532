"""Per-step tensors, built once from a StepPlan and passed explicitly to every layer."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

import torch

from .uploads import upload


class StepInts:
    """A step's per-row ints and page tables, moved to the device in one copy on first use: a
    captured step reads its own buffers instead (worker/cuda_graphs.py) and never needs
    them."""

    def __init__(self, groups: list[list[int]], device: torch.device | str):
        self.groups, self.device = groups, device
        self._tensors: list[torch.Tensor] | None = None

    def get(self) -> list[torch.Tensor]:
        if self._tensors is None:
            self._tensors = device_ints(self.groups, self.device)
        return self._tensors


@dataclass
class BatchMeta:
    query_starts: list[int]  # [B + 1] row offsets of each sequence in T
    context_lens: list[int]  # [B] positions held after this step
    decode_only: bool  # every sequence contributes exactly one row
    # What the tensors below are built from, as ints in the pool's page ids (a meta renumbered
    # into a staging slot keeps these: its host pool reads them)
    used_pages: list[list[int]]  # B x [n_pages]
    row_positions: list[int]  # [T]
    row_pages: list[int]  # [T]
    row_offsets: list[int]  # [T]
    sample_at: list[int]  # [N] the rows whose logits are sampled, in the batch's order
    ints: StepInts  # positions, write pages and offsets, sample rows, page tables
    # in place of the page tables and write pages of `ints` (a staging slot's numbering)
    tables: list[torch.Tensor] | None = None
    writes: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:  # [T] int64, absolute position of each row
        return self.ints.get()[0]

    @property
    def write_pages(self) -> torch.Tensor:  # [T] int64, page that receives each row's K/V
        return self.ints.get()[1] if self.writes is None else self.writes

    @property
    def write_offsets(self) -> torch.Tensor:  # [T] int64, offset of the row inside that page
        return self.ints.get()[2]

    @property
    def sample_rows(self) -> torch.Tensor:  # [N] int64, rows whose logits are sampled
        return self.ints.get()[3]

    @property
    def page_tables(self) -> list[torch.Tensor]:  # B x [n_pages] int64, logical order
        return self.ints.get()[4:] if self.tables is None else self.tables

    @property
    def n_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def n_rows(self) -> int:  # T
        return self.query_starts[-1]

    def decode_padding(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded page tables [B, P] (page 0 past each end) and the key mask [B, P * page] of a
        batched decode: the same for every layer, so built on the first layer's call only. A
        `replace()`d meta (other tables) starts without it."""
        cache = self.__dict__.setdefault("_decode_padding", {})
        cached = cache.get(page_size)
        if cached is None:
            device = self.positions.device
            n_pages = max(t.numel() for t in self.page_tables)
            tables = torch.zeros(self.n_seqs, n_pages, dtype=torch.int64, device=device)
            for b, t in enumerate(self.page_tables):
                tables[b, : t.numel()] = t
            lens = torch.tensor(self.context_lens, device=device)
            mask = torch.arange(n_pages * page_size, device=device)[None, :] < lens[:, None]
            cached = cache[page_size] = (tables, mask)
        return cached


def device_ints(groups: list[list[int]], device: torch.device | str) -> list[torch.Tensor]:
    """Lists of ints -> int64 tensors on `device`, moved in one copy."""
    return to_device(int64s(chain.from_iterable(groups)), [len(g) for g in groups], device)


def int64s(values: Iterable[int]) -> torch.Tensor:
    """Python ints -> a host int64 tensor, through an array: `torch.tensor` takes about 70 ns an
    element from a list, which is a millisecond for the page tables of a long batch."""
    a = array("q", values)
    return torch.frombuffer(a, dtype=torch.int64) if a else torch.empty(0, dtype=torch.int64)


def ints_into(values: Iterable[int], out: torch.Tensor) -> None:
    """Python ints into the front of `out` (int64, on any device), as `to_device` moves them."""
    flat = int64s(values)
    if out.device.type == "cuda":
        upload(flat, out.device, out[:flat.numel()])
    else:
        out[:flat.numel()].copy_(flat)


def to_device(flat: torch.Tensor, sizes: list[int], device: torch.device | str
              ) -> list[torch.Tensor]:
    """A host int64 tensor -> pieces of `sizes` on `device`, moved at once. For CUDA through
    pinned memory, without blocking the host or waiting for a copy engine (`worker/uploads.py`;
    a `torch.tensor(..., device=cuda)` per list would be a pageable copy each, which waits for
    the stream)."""
    device = torch.device(device)
    flat = upload(flat, device) if device.type == "cuda" else flat.to(device)
    return list(flat.split(sizes))


def build_meta(
    starts: list[int], counts: list[int], tables: list[list[int]], samples: list[bool],
    page_size: int, device: torch.device | str,
) -> BatchMeta:
    """starts[b]: position of sequence b's first row; counts[b]: its rows this step."""
    positions, pages, offsets, sample_rows, query_starts = [], [], [], [], [0]
    for start, n, table, sample in zip(starts, counts, tables, samples):
        pos = range(start, start + n)
        positions.extend(pos)
        pages.extend(table[p // page_size] for p in pos)
        offsets.extend(p % page_size for p in pos)
        query_starts.append(query_starts[-1] + n)
        if sample:
            sample_rows.append(query_starts[-1] - 1)

    context_lens = [s + n for s, n in zip(starts, counts)]
    used = [table[: -(-c // page_size)] for table, c in zip(tables, context_lens)]
    return BatchMeta(
        query_starts=query_starts,
        context_lens=context_lens,
        decode_only=all(n == 1 for n in counts),
        used_pages=used,
        row_positions=positions,
        row_pages=pages,
        row_offsets=offsets,
        sample_at=sample_rows,
        ints=StepInts([positions, pages, offsets, sample_rows, *used], device),
    )
