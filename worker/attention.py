"""Paged attention: each sequence attends over its pages in logical order.

Pages are gathered by the sequence's page table, so the result depends only on the contents of
its positions, never on which physical pages hold them.

On CUDA the paged Triton kernel of exact mode (worker/kernels/exact_triton.py) serves default
mode too, where Triton is installed and the head size is a power of two: it reads the pages in
place, where a gather and `scaled_dot_product_attention` with grouped KV heads falls to PyTorch's
math backend (about ten kernels and 0.3 ms of host time a layer, measured on an H200).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import BatchMeta
from .kernels import triton_kernels


def _cuda_kernel(head_dim: int):
    """The Triton paged attention for this head size, or None (then SDPA serves CUDA too)."""
    kernels = triton_kernels()
    return None if kernels is None or head_dim & (head_dim - 1) else kernels.paged_attention


def gather(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """pool: [n_pages, page, KVH, D], table: [n] -> [length, KVH, D] in logical order."""
    return pool[table].flatten(0, 1)[:length]


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: BatchMeta, scale: float
) -> torch.Tensor:
    """q: [T, H, D]; pools: [n_pages, page, KVH, D] already holding this step's rows."""
    if q.is_cuda and (kernel := _cuda_kernel(q.shape[-1])) is not None:
        return kernel(q, k_pool, v_pool, meta, scale)
    return gather_attention(q, k_pool, v_pool, meta, scale)


def gather_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: BatchMeta, scale: float
) -> torch.Tensor:
    """`paged_attention` by gathering each sequence's pages and PyTorch's SDPA."""
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
