"""Paged attention: each sequence attends over its pages in logical order.

Pages are gathered by the sequence's page table, so the result depends only on the contents of
its positions, never on which physical pages hold them.

A worker's paged attention is chosen once at load (`choose_attention`) and handed to its KV
pool, whose layers and step graphs attend through it. On CUDA, where Triton is installed and
the head size is a power of two, Triton kernels read the pages in place: exact mode's
batch-invariant kernel (worker/kernels/paged_triton.py), default mode's flash attention for
prompts and split keys for decode steps (worker/kernels/flash_triton.py). A gather and
`scaled_dot_product_attention` with grouped KV heads falls to PyTorch's math backend there
(about ten kernels and 0.3 ms of host time a layer, measured on an H200). Elsewhere default
mode gathers for SDPA (below) and exact mode runs `exact_cpu`'s kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from .batch import BatchMeta
from .exact import exact_attention
from .kernels import Scratch, triton_kernels, triton_module

# q: [T, H, D]; K and V pages: [n_pages, page, KVH, D] already holding this step's rows; the
# step's meta; the softmax scale -> [T, H, D]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BatchMeta, float], torch.Tensor]
# (row bucket, keys bucket, query heads, KV heads, head size, the worker's shared
# `kernels.Scratch`) -> what a captured step of that bucket launches for its attention
# (`paged_triton.StepAttention`, `flash_triton.StepAttention`): called with (q, K pages,
# V pages, flat tables, page base, blocks, positions, out, scale), blocks of its `block_rows`
# positions
StepAttentionFn = Callable[[int, int, int, int, int, Scratch], Any]


@dataclass(frozen=True)
class PagedAttention:
    """The paged attention of one worker, exact or default mode, for its device."""

    attend: AttendFn  # what an eager step attends with
    # The Triton kernels (worker/kernels/paged_triton.py) where the device runs them: what a
    # captured step writes its rows with; None: no capture.
    kernels: ModuleType | None
    # What a captured step launches for its attention: for a decode step the bits of the eager
    # attention of the same bucket (in exact mode of any step)
    step_attention: StepAttentionFn | None = None

    def __call__(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 meta: BatchMeta, scale: float) -> torch.Tensor:
        return self.attend(q, k_pages, v_pages, meta, scale)


def choose_attention(exact: bool, device: torch.device | str, head_dim: int) -> PagedAttention:
    """Exact mode's (`worker/exact.py`) or default mode's paged attention on `device`. Raises
    ValueError where exact mode needs Triton on CUDA and it is not installed."""
    device = torch.device(device)
    kernels = None
    if device.type == "cuda" and not head_dim & (head_dim - 1):
        kernels = triton_kernels()
    if exact:
        return PagedAttention(exact_attention(device), kernels,
                              kernels.StepAttention if kernels else None)
    if kernels is None:
        return PagedAttention(gather_attention, None)
    flash = triton_module("flash_triton")
    return PagedAttention(flash.paged_attention, kernels, flash.StepAttention)


def gather(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """pool: [n_pages, page, KVH, D], table: [n] -> [length, KVH, D] in logical order."""
    return pool[table].flatten(0, 1)[:length]


def gather_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: BatchMeta, scale: float
) -> torch.Tensor:
    """Default mode's paged attention without Triton: each sequence's pages gathered for
    PyTorch's SDPA."""
    if meta.decode_only and meta.n_seqs > 1:
        return _decode_batched(q, k_pool, v_pool, meta, scale)
    out = torch.empty_like(q)
    for b in range(meta.n_seqs):
        lo, hi = meta.query_starts[b], meta.query_starts[b + 1]
        ctx = meta.context_lens[b]
        k = gather(k_pool, meta.page_tables[b], ctx)
        v = gather(v_pool, meta.page_tables[b], ctx)
        # causal: query row i sits at position ctx - (hi - lo) + i
        n = hi - lo
        mask = None
        if n > 1:
            kpos = torch.arange(ctx, device=q.device)
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]  # [n, ctx]
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # [H, n, D]
        out[lo:hi] = o.transpose(0, 1)
    return out


def _decode_batched(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: BatchMeta, scale: float
) -> torch.Tensor:
    """One row per sequence: pad every table to the longest and mask the tail."""
    tables, mask = meta.decode_padding(k_pool.shape[1])
    k = k_pool[tables].flatten(1, 2)  # [B, L, KVH, D]
    v = v_pool[tables].flatten(1, 2)
    o = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
    )  # [B, H, 1, D]
    return o[:, :, 0, :]
