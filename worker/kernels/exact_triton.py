"""Batch-invariant kernels for CUDA, in Triton: each row's bits depend on that row alone.

- `linear`: one tile configuration for every launch (BLOCK_M x BLOCK_N output tiles, the K loop
  in BLOCK_K steps), so a row meets the same instructions in the same order whatever the row
  count; padded rows load zeros and only feed rows that are dropped. K is split (partial sums
  added in split order) by a count chosen from the weight's shape and the GPU, never from the
  row count, so that one decode row still keeps every SM streaming weights.
- `rms_norm`: one program per row, the whole row in one block, one fixed reduction tree
  (torch's CUDA reduction picks its thread layout from the tensor's shape).
- `paged_attention`: one program per (query row, head, split of SPLIT key positions). A program
  walks its sequence's page table in logical order, BLOCK_KV keys at a time, with an online
  softmax; a second kernel combines a row's splits in order. Tiles and splits are aligned to
  absolute positions and stop at the row's own position, so neither the query count, the
  context of the launch, nor the physical pages change a bit.

Imported only when exact mode runs on CUDA (`worker/exact.py`), so CPU installs never need
Triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
MATMUL_WARPS, MATMUL_STAGES = 4, 3
SPLIT = 256  # key positions per attention split
BLOCK_KV = 32  # key positions per tile inside a split; divides SPLIT


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om,
                   stride_os, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    # out[s, M, N] = x[M, Ks] @ w[N, Ks].T over split s of K (Ks = [s * K_SPLIT, ...)), in
    # float32; with one split, out is the [M, N] result in the output dtype
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(K, (split + 1) * K_SPLIT)
    for k0 in range(split * K_SPLIT, k_end, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + rm[:, None].to(tl.int64) * stride_om
             + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["MN"])
def _sum_splits_kernel(parts_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = parts[0, i] + parts[1, i] + ..., in this order
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(parts_ptr + s * MN + i, mask=i < MN, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=i < MN)


@functools.cache
def _k_splits(n: int, k: int, device: torch.device) -> int:
    """Splits of K for a weight [n, k]: enough programs to fill the GPU at one row. A property of
    the weight and the device, never of the row count, so every row sums in the same order."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = triton.cdiv(n, BLOCK_N)
    if 2 * tiles >= sms:  # one launch more (the sum) costs more than it gains
        return 1
    return max(1, min(triton.cdiv(2 * sms, tiles), k // 1024))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] @ weight[N, K].T (+ bias) -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.contiguous()
    (m, k), n = rows.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    splits = _k_splits(n, k, x.device)
    k_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    if m:
        parts = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32,
                                                    device=x.device)
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)
        _linear_kernel[grid](rows, weight, parts, m, n, k, k_split, rows.stride(0),
                             weight.stride(0), n, m * n, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             BLOCK_K=BLOCK_K, num_warps=MATMUL_WARPS, num_stages=MATMUL_STAGES)
        if splits > 1:
            _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLITS=splits,
                                                            BLOCK=1024)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    # as RMSNorm: normalised in float32, cast to the activations' dtype, then times the weight
    h = h.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim] -> [..., dim], `worker.model.RMSNorm`'s arithmetic, one row per program."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0),
                                           rows.shape[1], eps,
                                           BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.reshape(x.shape)


@triton.jit(do_not_specialize=["max_splits"])
def _attention_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, row_seq_ptr, row_pos_ptr, m_ptr, l_ptr, o_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_tb, page_size, max_splits,
    scale, H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):
    t, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = tl.load(row_pos_ptr + t)  # this row attends keys [0, pos]
    start = j * SPLIT
    if start <= pos:
        b = tl.load(row_seq_ptr + t).to(tl.int64)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + h * stride_qh + d).to(tl.float32)
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for s0 in range(start, tl.minimum(start + SPLIT, pos + 1), BLOCK_KV):
            offs = s0 + tl.arange(0, BLOCK_KV)
            valid = offs <= pos
            page = tl.load(tables_ptr + b * stride_tb + offs // page_size, mask=valid, other=0)
            base = page.to(tl.int64) * stride_kp + (offs % page_size) * stride_ks \
                + (h // REP) * stride_kh
            k = tl.load(k_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale  # [BLOCK_KV]
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: a tile's first key is visible
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            m_i = m_new
        idx = (t.to(tl.int64) * H + h) * max_splits + j
        tl.store(m_ptr + idx, m_i)
        tl.store(l_ptr + idx, l_i)
        tl.store(o_ptr + idx * D + d, acc)


@triton.jit(do_not_specialize=["max_splits"])
def _attention_combine_kernel(m_ptr, l_ptr, o_ptr, row_pos_ptr, out_ptr, stride_ot, stride_oh,
                              max_splits, H: tl.constexpr, D: tl.constexpr,
                              SPLIT: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    n = tl.load(row_pos_ptr + t) // SPLIT + 1  # this row's splits, combined in logical order
    base = (t.to(tl.int64) * H + h) * max_splits
    d = tl.arange(0, D)
    m = tl.full((), float("-inf"), tl.float32)
    for j in range(0, n):
        m = tl.maximum(m, tl.load(m_ptr + base + j))
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for j in range(0, n):
        w = tl.exp(tl.load(m_ptr + base + j) - m)
        l_sum += tl.load(l_ptr + base + j) * w
        acc += tl.load(o_ptr + (base + j) * D + d) * w
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
             (acc / l_sum).to(out_ptr.dtype.element_ty))


def _step_tables(meta) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence of each row [T] and the page tables padded to [B, max pages]: built once a
    step and kept on its meta, since every layer's launch reads the same."""
    if not hasattr(meta, "_exact_tables"):
        dev = meta.positions.device
        counts = torch.tensor(
            [hi - lo for lo, hi in zip(meta.query_starts, meta.query_starts[1:])], device=dev)
        meta._exact_tables = (
            torch.repeat_interleave(torch.arange(meta.n_seqs, device=dev), counts),
            torch.nn.utils.rnn.pad_sequence(meta.page_tables, batch_first=True),
        )
    return meta._exact_tables


def paged_attention(q, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
    """Same contract as `worker.attention.paged_attention`; q: [T, H, D], D a power of two."""
    t, h, d = q.shape
    q = q.contiguous()
    dev = q.device
    row_seq, tables = _step_tables(meta)
    max_splits = triton.cdiv(max(meta.context_lens), SPLIT)
    m = torch.empty(t, h, max_splits, dtype=torch.float32, device=dev)
    l_split = torch.empty_like(m)
    o = torch.empty(t, h, max_splits, d, dtype=torch.float32, device=dev)
    out = torch.empty_like(q)
    if t == 0:
        return out
    rep = h // k_pool.shape[2]
    _attention_split_kernel[(t, h, max_splits)](
        q, k_pool, v_pool, tables, row_seq, meta.positions, m, l_split, o,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        tables.stride(0), k_pool.shape[1], max_splits, scale,
        H=h, REP=rep, D=d, SPLIT=SPLIT, BLOCK_KV=BLOCK_KV,
    )
    _attention_combine_kernel[(t, h)](m, l_split, o, meta.positions, out, out.stride(0),
                                      out.stride(1), max_splits, H=h, D=d, SPLIT=SPLIT)
    return out
