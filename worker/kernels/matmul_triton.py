"""Exact mode's matmul for CUDA, in Triton: each row's bits depend on that row alone.

One arithmetic for every launch (BLOCK_M-row output tiles, the K loop in BLOCK_K steps), so a row
meets the same instructions in the same order whatever the row count; padded rows load zeros and
only feed rows that are dropped. K is split (partial sums added in split order) by a count
chosen from the weight's shape and the GPU, never from the row count, so that one decode row
still keeps every SM streaming weights; a launch of few rows spreads the splits over programs
(and the last of a tile's programs to finish, or a second kernel, adds them), a larger one sums
them in each program, with the same additions.

Imported on CUDA only, on first use (`worker.kernels.triton_module`), so CPU installs never need
Triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import FUSION, launch_counts, sm_count
from .counting import last_to_finish

# The matmul's arithmetic: 64-row tiles, the K loop in steps of BLOCK_K, K cut into splits (each
# summed from zero, then added in split order) by a count of the weight's and the GPU's.
BLOCK_M, BLOCK_K = 64, 128
MIN_SPLIT_K = 512  # the fewest K positions a split sums
# (tile width, warps, stages) of a launch of up to BLOCK_M rows and of a larger one, kept apart
# so that each can be tuned alone. Three stages let two programs share an SM, so a one-row launch's
# splits run as one wave (4 stages: 0.85 of cuBLAS at 1-32 rows on an H200, 3: 0.94-0.95;
# docs/bench/probes/matmul-sweep-h200.txt).
SMALL_LAUNCH, LARGE_LAUNCH = (64, 4, 3), (64, 4, 3)
# Rows up to which a spread launch's last program to finish a tile adds its splits, saving the
# second kernel's launch: on an H100 llama-1b's step products 1-2% faster at 1 to 16 rows; added
# that way at 32 rows they cost `siding bench exact` 1% at 32 sequences, and at 128 rows the
# products were 2% slower, one program's sum trailing the rest (docs/exact-mode.md, "Cost")
SUM_LAST_ROWS = 16


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, out_ptr, parts_ptr, counts_ptr, M, N, K, K_SPLIT, stride_xm,
                   stride_wn, stride_om, stride_ps, SPLITS: tl.constexpr, SPREAD: tl.constexpr,
                   SUM_LAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    # x[M, K] @ w[N, K].T as the sum, in split order, of each split's product (Ks = [s * K_SPLIT,
    # ...)), in float32, into out [M, N] in the output dtype. SPREAD: this program sums split
    # program_id(2) alone and stores it in float32 at parts[s] ([SPLITS, M, N]); SUM_LAST: the
    # tile's last program to finish (its count in counts_ptr: `launch_counts`) adds the splits
    # in order, else `_sum_splits_kernel` does. Else one program sums all of them, in order: the
    # same additions every way.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if SPREAD:
        first = tl.program_id(2)
        k_end = tl.minimum(K, (first + 1) * K_SPLIT)
    else:
        first = 0
        k_end = K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one loop over every split's K tiles (K_SPLIT is a multiple of BLOCK_K), so that loads run
    # ahead across the splits' ends
    for k0 in range(first * K_SPLIT, k_end, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0.0)
        acc = tl.dot(x, w, acc)
        if (k0 + BLOCK_K) % K_SPLIT == 0 or k0 + BLOCK_K >= k_end:  # a split's last tile
            total = tl.where(k0 // K_SPLIT == first, acc, total + acc)  # the first as it is
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    at = rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPREAD and SPLITS > 1:
        tl.store(parts_ptr + first.to(tl.int64) * stride_ps + at, total, mask=mask)
        if SUM_LAST:
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if last_to_finish(counts_ptr + tile, SPLITS):  # the others' partials from L2
                total = tl.load(parts_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, SPLITS):
                    total += tl.load(parts_ptr + s * stride_ps + at, mask=mask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["MN"])
def _sum_splits_kernel(parts_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = parts[0, i] + parts[1, i] + ..., in this order
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(parts_ptr + i, mask=i < MN, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(parts_ptr + s * MN + i, mask=i < MN, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=i < MN)


@functools.cache
def split_size(n: int, k: int, device: torch.device) -> int:
    """K positions a split of a weight [n, k] sums (a multiple of BLOCK_K; all of K unsplit):
    enough splits to fill the GPU at one row. A property of the weight and the device, never of
    the row count, so every row sums in the same order."""
    sms, tiles = sm_count(device), triton.cdiv(n, SMALL_LAUNCH[0])
    count = 1
    if 2 * tiles < sms:  # else a launch more (the sum) costs more than it gains
        count = max(1, min(triton.cdiv(2 * sms, tiles), k // MIN_SPLIT_K))
    return triton.cdiv(triton.cdiv(k, count), BLOCK_K) * BLOCK_K


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] @ weight[N, K].T (+ bias) -> [..., N]. A launch with too few row tiles to fill
    the GPU spreads K's splits over programs of their own, and the last of a tile's to finish (up
    to SUM_LAST_ROWS rows) or a second kernel adds them; a larger one sums them inside each
    program: the same bits, without the float32 partials."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.contiguous()
    (m, k), n = rows.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_split = split_size(n, k, x.device)
    splits = triton.cdiv(k, k_split)
    block_n, warps, stages = SMALL_LAUNCH if m <= BLOCK_M else LARGE_LAUNCH
    tiles = triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n)
    spread = splits > 1 and tiles[0] * tiles[1] < sm_count(x.device)
    if m:
        parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if spread else out
        sum_last = spread and m <= SUM_LAST_ROWS
        counts = launch_counts(x.device) if sum_last else out
        _linear_kernel[(*tiles, splits if spread else 1)](
            rows, weight, out, parts, counts, m, n, k, k_split, rows.stride(0), weight.stride(0),
            n, m * n, SPLITS=splits, SPREAD=spread, SUM_LAST=sum_last, BLOCK_M=BLOCK_M,
            BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=warps, num_stages=stages, **FUSION)
        if spread and not sum_last:
            _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLITS=splits,
                                                            BLOCK=1024, **FUSION)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)
