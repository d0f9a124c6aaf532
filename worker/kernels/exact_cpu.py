"""Batch-invariant kernels for the CPU: each row's bits depend on that row alone.

Measured on the x86 build of torch (MKL sgemm): with AVX2 kernels a row of `x @ w.T` gets the
same bits in every launch whose row count is a multiple of 4, but with AVX-512 ones (seen on a
Xeon with AMX) a row changes bits from 9-13 rows on; on both, one row alone takes gemv and two
or three rows a small-matrix path, each summing in another order. So every product here is
launched in blocks of exactly `ROW_BLOCK` rows (the last padded with zeros), as the CUDA kernels
are: one shape per weight, whatever the batch. `check_row_invariance` re-checks the property
when exact mode is switched on, so another BLAS fails at start-up instead of serving inexactly.
Elementwise ops, RMSNorm's row reduction and softmax-free max/exp are row-local on the CPU
already.

Attention splits each sequence's keys, in logical order, into splits of `SPLIT` positions:
scores are one product per launch (inner size D fixed), each split's P @ V has inner size SPLIT
fixed, and splits are summed in order by a sequential scan. Masked keys give exact zeros, so a
row's result does not depend on keys past its own position, on the padding of its launch, on
other rows, or on where its pages live.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_BLOCK = 16  # rows of every launch
SPLIT = 64  # keys per split: fixed, whatever the page size, query count or context
MAX_ROWS = 128  # query rows of one sequence per attention launch, to bound the score tensor


def _pad(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """x with zeros appended along `dim` up to size n."""
    extra = n - x.shape[dim]
    return x if extra == 0 else F.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, extra))


def _round_up(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] @ weight[N, K].T (+ bias) -> [..., N], every row as in any other launch.

    Half-precision weights are multiplied in float32 (cast per call): the property above was
    measured for MKL's sgemm, not for oneDNN's half-precision kernels."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    padded, w = _pad(rows, 0, _round_up(m, ROW_BLOCK)).float(), weight.float()
    out = torch.cat([F.linear(padded[i:i + ROW_BLOCK], w)
                     for i in range(0, padded.shape[0], ROW_BLOCK)])[:m].to(x.dtype)
    if bias is not None:
        out = out + bias  # added apart: addmm's fused bias is one more path to keep invariant
    return out.reshape(*x.shape[:-1], weight.shape[0])


def check_row_invariance(weight: torch.Tensor) -> None:
    """Raise if this BLAS gives a row other bits beside other rows (see the module doc)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, weight.shape[1], generator=g).to(weight.dtype)
    alone = linear(x[:1], weight)
    for m in (2, 5, 8, 17, 70):
        if not torch.equal(linear(x[:m], weight)[:1], alone):
            raise ValueError(
                f"exact mode: this CPU's BLAS computes a row of a [{m}, {weight.shape[1]}] x "
                f"[{weight.shape[1]}, {weight.shape[0]}] product with other bits than the row "
                "alone, so exact mode cannot be honoured on this machine"
            )


def paged_attention(q, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
    """`worker.attention.PagedAttention.attend`'s contract.

    Decode rows (one per sequence) of a step share one launch; a sequence with several rows
    gets launches of its own, in blocks of at most MAX_ROWS rows. Neither choice changes bits.
    """
    out = torch.empty_like(q)
    starts, lens = meta.query_starts, meta.context_lens
    decodes = [b for b in range(meta.n_seqs) if starts[b + 1] - starts[b] == 1]
    if decodes:
        rows = torch.tensor([starts[b] for b in decodes], device=q.device)
        out[rows] = _attend(
            q[rows][:, None], *_gather(k_pool, v_pool, meta, decodes),
            meta.positions[rows][:, None], scale,
        )[:, 0]
    for b in range(meta.n_seqs):
        lo, hi = starts[b], starts[b + 1]
        if hi - lo == 1:
            continue
        k, v = _gather(k_pool, v_pool, meta, [b])
        for r in range(lo, hi, MAX_ROWS):
            e = min(r + MAX_ROWS, hi)
            keys = _round_up(lens[b] - (hi - e), SPLIT)  # the block's last row sees no further
            out[r:e] = _attend(q[None, r:e], k[:, :keys], v[:, :keys],
                               meta.positions[None, r:e], scale)[0]
    return out


def _gather(k_pool, v_pool, meta, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `seqs` in logical order: [B, L, KVH, D], L a multiple of SPLIT. Values
    past each sequence's context are zeroed, so that whatever those pages hold (another
    sequence's rows) meets only zero weights; scores there are masked whatever the keys."""
    length = _round_up(max(meta.context_lens[b] for b in seqs), SPLIT)
    n_pages = -(-length // k_pool.shape[1])
    tables = torch.zeros(len(seqs), n_pages, dtype=torch.int64, device=k_pool.device)
    for i, b in enumerate(seqs):
        tables[i, : meta.page_tables[b].numel()] = meta.page_tables[b]
    lens = torch.tensor([meta.context_lens[b] for b in seqs], device=k_pool.device)
    past = torch.arange(length, device=k_pool.device)[None, :] >= lens[:, None]  # [B, L]
    k = k_pool[tables].flatten(1, 2)[:, :length]
    v = v_pool[tables].flatten(1, 2)[:, :length].masked_fill(past[:, :, None, None], 0)
    return k, v


def _attend(q, k, v, qpos, scale: float) -> torch.Tensor:
    """q: [B, n, H, D]; k, v: [B, L, KVH, D], L a multiple of SPLIT; qpos: [B, n] -> [B, n, H, D].

    Row i of sequence b attends keys [0, qpos[b, i]]."""
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()  # as linear: float32 products only
    b, n, h, d = q.shape
    kvh, length = k.shape[2], k.shape[1]
    rep, rows, splits = h // kvh, _round_up(n, ROW_BLOCK), length // SPLIT
    # padded query rows sit at position 0, so every row sees at least one key
    q, qpos = _pad(q, 1, rows), _pad(qpos, 1, rows)
    # qg: [B, KVH, rep * rows, D], a multiple of ROW_BLOCK rows for every launch
    qg = q.view(b, rows, kvh, rep, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, rep * rows, d)
    s = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [B, KVH, rep * rows, L]
    hidden = torch.arange(length, device=q.device)[None, None, :] > qpos[:, :, None]  # [B, rows, L]
    s = s.view(b, kvh, rep, rows, length).masked_fill(hidden[:, None, None], float("-inf"))
    s = s.view(b, kvh, rep * rows, length)
    p = torch.exp(s - s.amax(-1, keepdim=True))  # max is order-free; masked keys give 0
    p = p.view(b, kvh, rep * rows, splits, SPLIT)
    vs = v.view(b, splits, SPLIT, kvh, d).permute(0, 3, 1, 2, 4)  # [B, KVH, J, SPLIT, D]
    o = torch.matmul(p.transpose(2, 3), vs)  # [B, KVH, J, rep * rows, D], inner size SPLIT
    l_split = p.sum(-1)  # [B, KVH, rep * rows, J], inner size SPLIT
    # splits summed in logical order (cumsum is a sequential scan), trailing splits add zeros
    o = o.cumsum(2)[:, :, -1]
    denom = l_split.cumsum(-1)[..., -1:]
    out = (o / denom).view(b, kvh, rep, rows, d).permute(0, 3, 1, 2, 4).reshape(b, rows, h, d)
    return out[:, :n].to(dtype)
