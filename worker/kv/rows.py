"""A step's new K and V rows into pages: the one place every pool and step graph writes them."""

from __future__ import annotations

from types import ModuleType

import torch


def write_rows(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               pages: torch.Tensor, offsets: torch.Tensor,
               carried: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               kernels: ModuleType | None = None) -> None:
    """k, v [T, KVH, D] into k_pages, v_pages [n, page, KVH, D] at (pages, offsets) [T].

    carried: rows [2, T', KVH, D] with their pages and offsets [T'], written first: the last
    step's rows, which pages filled from a host pool's pages lack. kernels: the Triton kernels
    (`PagedAttention.kernels`), to write both in one launch, as a captured step does;
    None: index_put, as every eager step does."""
    k, v = k.to(k_pages.dtype), v.to(v_pages.dtype)
    if kernels is not None:
        kernels.write_rows(k_pages, v_pages, k, v, pages, offsets, carried)
        return
    if carried is not None:
        rows, at = carried[0], carried[1:]
        k_pages.index_put_(at, rows[0])
        v_pages.index_put_(at, rows[1])
    k_pages.index_put_((pages, offsets), k)
    v_pages.index_put_((pages, offsets), v)
