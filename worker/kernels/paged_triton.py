"""Paged attention for CUDA, in Triton, and the row writes of the step graphs: each row's bits
depend on that row alone. Exact mode attends with it; default mode decodes with its split
kernels and writes rows with `write_rows` (its prompts' attention is `flash_triton`'s). The
per-row elementwise kernels every mode shares (RMSNorm, RoPE, ...) are `rowwise_triton`'s,
exact mode's matmul `matmul_triton`'s.

- `paged_attention`: one program per (block of query positions of one sequence, KV head, split
  of SPLIT key positions); its tile rows are (position, query head) pairs, so tensor cores do
  both products, and a tensor-core row's result depends on that row alone. A program walks the
  sequence's page table in logical order, BLOCK_KV keys at a time, with an online softmax; a
  second kernel combines a row's splits, COMBINE_CHUNK at a time in logical order. Tiles and
  splits are aligned to absolute positions, and tiles past a row's position leave its state
  exactly unchanged, so neither the query count, the context of the launch, nor the physical
  pages change a bit: a decode row is a block of one position and gets the bits it gets inside
  a prompt chunk.
- `write_rows`: a step graph's new K and V rows into their pages, and a host pool's carried
  rows with them, in one launch (a copy: no arithmetic, so no bit to keep).

Imported on CUDA only, on first use (`worker.kernels.triton_kernels`), so CPU installs never
need Triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import ATTENTION_SPLIT

SPLIT = ATTENTION_SPLIT  # key positions per attention split
BLOCK_KV = 32  # key positions per tile inside a split; divides SPLIT
BLOCK_ROWS = 64  # (query position, head) rows per attention program
COMBINE_CHUNK = 32  # splits a combine program loads at once


@triton.jit
def _tile_pages(tables_ptr, table, page_base, offs, end, page_size):
    # the page ids of key positions offs [BLOCK_KV] (0 at and past end)
    return page_base + tl.load(tables_ptr + table + offs // page_size, mask=offs < end, other=0)


@triton.jit
def _tile_kv(k_ptr, v_ptr, pages, offs, end, kvh, d, stride_kp, stride_ks, stride_kh,
             page_size):
    # K and V [BLOCK_KV, D] of key positions offs in pages (zeros at and past end)
    at = pages.to(tl.int64) * stride_kp + (offs % page_size) * stride_ks + kvh * stride_kh
    mask = (offs < end)[:, None]
    return (tl.load(k_ptr + at[:, None] + d[None, :], mask=mask, other=0.0),
            tl.load(v_ptr + at[:, None] + d[None, :], mask=mask, other=0.0))


@triton.jit(do_not_specialize=["max_splits"])
def _attention_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, base_ptr, blocks_ptr, pos_ptr, m_ptr, l_ptr, o_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, page_size, max_splits,
    scale, H: tl.constexpr, REP: tl.constexpr, REP_P2: tl.constexpr, BLOCK_P: tl.constexpr,
    D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_KV: tl.constexpr,
):
    # One program: up to BLOCK_P query positions of one sequence (a block) x the REP query heads
    # of one KV head, over split j of the keys. Tile rows are (position, head) pairs. A block is
    # (where its sequence's pages start in the flat tables, first row, rows); a page id read
    # there is offset by *base_ptr (the layer's slot in a staging ring, else 0).
    qb, kvh, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    table = tl.load(blocks_ptr + 3 * qb)
    page_base = tl.load(base_ptr)
    row0 = tl.load(blocks_ptr + 3 * qb + 1)
    n = tl.load(blocks_ptr + 3 * qb + 2)
    r = tl.arange(0, BLOCK_P * REP_P2)
    valid = (r // REP_P2 < n) & (r % REP_P2 < REP)
    t = (row0 + r // REP_P2).to(tl.int64)
    h = kvh * REP + r % REP_P2
    pos = tl.load(pos_ptr + t, mask=valid, other=-1)  # row i attends keys [0, pos[i]]
    last = tl.max(pos, axis=0)
    start = j * SPLIT
    if start <= last:
        d = tl.arange(0, D)
        q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=valid[:, None], other=0.0)
        m_i = tl.full((BLOCK_P * REP_P2,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_P * REP_P2,), tl.float32)
        acc = tl.zeros((BLOCK_P * REP_P2, D), tl.float32)
        # Tiles past a row's own position are wholly masked for it and leave its state exactly
        # as it was (alpha = 1, p = 0), so a row gets the bits it gets alone in a block of one.
        # Loads run ahead of the arithmetic, which they do not change: a tile's keys and values
        # one tile ahead, its page ids two (on an H200, 32 decode rows at 2,048 keys: 93 against
        # 105 us a layer; at one row little, the chain being the arithmetic's).
        end = tl.minimum(start + SPLIT, last + 1)
        tile = tl.arange(0, BLOCK_KV)
        pages = _tile_pages(tables_ptr, table, page_base, start + tile, end, page_size)
        k_next, v_next = _tile_kv(k_ptr, v_ptr, pages, start + tile, end, kvh, d, stride_kp,
                                  stride_ks, stride_kh, page_size)
        pages = _tile_pages(tables_ptr, table, page_base, start + BLOCK_KV + tile, end,
                            page_size)
        for s0 in range(start, end, BLOCK_KV):
            k, v = k_next, v_next
            offs = s0 + tile
            k_next, v_next = _tile_kv(k_ptr, v_ptr, pages, offs + BLOCK_KV, end, kvh, d,
                                      stride_kp, stride_ks, stride_kh, page_size)
            pages = _tile_pages(tables_ptr, table, page_base, offs + 2 * BLOCK_KV, end,
                                page_size)
            seen = offs[None, :] <= pos[:, None]  # [rows, BLOCK_KV]
            s = tl.where(seen, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
            p = tl.where(seen, tl.exp(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        idx = (t * H + h) * max_splits + j
        keep = valid & (pos >= start)
        tl.store(m_ptr + idx, m_i, mask=keep)
        tl.store(l_ptr + idx, l_i, mask=keep)
        tl.store(o_ptr + idx[:, None] * D + d[None, :], acc, mask=keep[:, None])


@triton.jit(do_not_specialize=["max_splits"])
def _attention_combine_kernel(m_ptr, l_ptr, o_ptr, row_pos_ptr, out_ptr, stride_ot, stride_oh,
                              max_splits, H: tl.constexpr, D: tl.constexpr,
                              SPLIT: tl.constexpr, CHUNK: tl.constexpr):
    # A row's splits, CHUNK at a time in logical order: each chunk's loads are issued together
    # (split by split, a 4,096-key decode row waited on 2 x 128 loads in turn), and the order of
    # the sums depends on the row's own split count alone
    t, h = tl.program_id(0), tl.program_id(1)
    pos = tl.load(row_pos_ptr + t)  # -1: a padding row (its output is zeros)
    n = tl.where(pos < 0, 0, pos // SPLIT + 1)  # this row's splits
    base = (t.to(tl.int64) * H + h) * max_splits
    d = tl.arange(0, D)
    c = tl.arange(0, CHUNK)
    m = tl.full((), float("-inf"), tl.float32)
    for j in range(0, n, CHUNK):
        m = tl.maximum(m, tl.max(tl.load(m_ptr + base + j + c, mask=j + c < n,
                                         other=float("-inf")), axis=0))
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for j in range(0, n, CHUNK):
        live = j + c < n
        w = tl.where(live, tl.exp(tl.load(m_ptr + base + j + c, mask=live, other=0.0) - m), 0.0)
        l_sum += tl.sum(tl.load(l_ptr + base + j + c, mask=live, other=0.0) * w, axis=0)
        o = tl.load(o_ptr + (base + j + c)[:, None] * D + d[None, :], mask=live[:, None],
                    other=0.0)
        acc += tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
             tl.where(l_sum > 0, acc / l_sum, 0.0).to(out_ptr.dtype.element_ty))


def step_blocks(meta, block_p: int, skip: set[int] = frozenset()
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of at most `block_p` rows of one sequence (none of the sequences in `skip`),
    [n_blocks, 3] (start of the sequence's pages in the flat tables, first row, rows), and the
    flat tables (every sequence's page table end to end): built once a step and kept on its
    meta, since every layer's launches read the same."""
    cache = meta.__dict__.setdefault("_exact_blocks", {})
    key = (block_p, tuple(sorted(skip)))
    if key not in cache:
        starts, table_starts = meta.query_starts, [0]
        for t in meta.page_tables:
            table_starts.append(table_starts[-1] + t.numel())
        blocks = [(table_starts[b], r, min(block_p, starts[b + 1] - r))
                  for b in range(meta.n_seqs) if b not in skip
                  for r in range(starts[b], starts[b + 1], block_p)]
        dev = meta.positions.device
        cache[key] = (torch.tensor(blocks, dtype=torch.int64, device=dev).view(-1, 3),
                      torch.cat(meta.page_tables))
    return cache[key]


def _split_scratch(meta, t: int, h: int, d: int, max_splits: int, dev: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split maxima, sums and partial outputs: one set a step, kept on its meta, since every
    layer's launches have the same shape and run one after another on one stream."""
    cache = meta.__dict__.setdefault("_exact_scratch", {})
    key = (t, h, d, max_splits, dev)
    if key not in cache:
        cache[key] = split_scratch(t, h, d, max_splits, dev)
    return cache[key]


def split_scratch(t: int, h: int, d: int, max_splits: int, dev: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = torch.empty(t, h, max_splits, dtype=torch.float32, device=dev)
    return m, torch.empty_like(m), torch.empty(t, h, max_splits, d, dtype=torch.float32,
                                               device=dev)


@functools.cache
def _zero(dev: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=dev)


def block_rows(q_heads: int, kv_heads: int) -> int:
    """Query positions per attention program (a decode row is a block of one of them)."""
    return max(1, BLOCK_ROWS // triton.next_power_of_2(q_heads // kv_heads))


def paged_attention(q, k_pool, v_pool, meta, scale: float, split: int = SPLIT,
                    block_p: int | None = None) -> torch.Tensor:
    """`worker.attention.PagedAttention.attend`'s contract; q: [T, H, D], D a power of two.
    split: keys per split (a multiple of BLOCK_KV); block_p: query positions a program takes
    (`block_rows`, unless given). Exact mode keeps both at their defaults: a row's bits depend
    on them."""
    t, h, d = q.shape
    q = q.contiguous()
    block_p = block_p or block_rows(h, k_pool.shape[2])
    blocks, tables = step_blocks(meta, block_p)
    max_splits = triton.cdiv(max(meta.context_lens), split)
    scratch = _split_scratch(meta, t, h, d, max_splits, q.device)
    out = torch.empty_like(q)
    if t:
        launch(q, k_pool, v_pool, tables, _zero(q.device), blocks, meta.positions, scratch,
               out, scale, split, block_p)
    return out


def launch(q, k_pool, v_pool, tables, base, blocks, positions, scratch, out, scale: float,
           split: int = SPLIT, block_p: int | None = None) -> None:
    """The two launches of a paged attention over explicit buffers, each sized by the caller:
    what a captured step graph replays (worker/cuda_graphs.py). q, out: [T, H, D]; tables:
    flat page ids, each offset by base [1]; blocks: [n, 3] as `step_blocks`; positions: [T]
    (-1: a padding row); scratch: `split_scratch(T, H, D, splits)`, splits of `split` keys
    covering every key; block_p as `paged_attention`'s."""
    t, h, d = q.shape
    rep = h // k_pool.shape[2]
    m, l_split, o = scratch
    max_splits = m.shape[2]
    _attention_split_kernel[(blocks.shape[0], k_pool.shape[2], max_splits)](
        q, k_pool, v_pool, tables, base, blocks, positions, m, l_split, o,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        k_pool.shape[1], max_splits, scale, H=h, REP=rep, REP_P2=triton.next_power_of_2(rep),
        BLOCK_P=block_p or block_rows(h, k_pool.shape[2]), D=d, SPLIT=split, BLOCK_KV=BLOCK_KV,
    )
    _attention_combine_kernel[(t, h)](m, l_split, o, positions, out, out.stride(0),
                                      out.stride(1), max_splits, H=h, D=d, SPLIT=split,
                                      CHUNK=COMBINE_CHUNK)


@triton.jit
def _write_rows_kernel(k_pages, v_pages, k, v, pages, offsets, carry, carry_pages, carry_offsets,
                       s_page, s_off, sk_row, sk_head, sk_dim, sv_row, sv_head, sv_dim, s_kv,
                       KVH: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    row, which, src = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = tl.arange(0, BLOCK)
    mask = i < KVH * D
    if src == 0:  # the step's own row: from k or v [rows, KVH, D], strided
        page, off = tl.load(pages + row), tl.load(offsets + row)
        h, d = i // D, i % D
        if which == 0:
            x = tl.load(k + row * sk_row + h * sk_head + d * sk_dim, mask=mask)
        else:
            x = tl.load(v + row * sv_row + h * sv_head + d * sv_dim, mask=mask)
    else:  # a carried row: from carry [2, rows, KVH, D], contiguous
        page, off = tl.load(carry_pages + row), tl.load(carry_offsets + row)
        x = tl.load(carry + which * s_kv + row * KVH * D + i, mask=mask)
    dst = page * s_page + off * s_off + i
    if which == 0:
        tl.store(k_pages + dst, x, mask=mask)
    else:
        tl.store(v_pages + dst, x, mask=mask)


def write_rows(k_pages, v_pages, k, v, pages, offsets, carried=None) -> None:
    """k, v [rows, KVH, D] into k_pages, v_pages [n, page, KVH, D] (KVH and D contiguous) at
    (pages, offsets) [rows], page ids final (base added, padding on the spare page); carried:
    (rows [2, rows, KVH, D] contiguous, pages, offsets), in the same launch, in no order: a
    carried row never shares a place with a new one (but on the spare page)."""
    rows, kvh, d = k.shape
    assert k.dtype == v.dtype == k_pages.dtype, "rows and pages of one dtype"
    assert k_pages.stride() == v_pages.stride() and k_pages.stride()[2:] == (d, 1), \
        "K and V pages laid out alike, each row's heads contiguous"
    carry, carry_pages, carry_offsets = carried if carried is not None else (k, pages, offsets)
    _write_rows_kernel[(rows, 2, 1 if carried is None else 2)](
        k_pages, v_pages, k, v, pages, offsets, carry, carry_pages, carry_offsets,
        k_pages.stride(0), k_pages.stride(1), *k.stride(), *v.stride(),
        carry.stride(0) if carried is not None else 0, KVH=kvh, D=d,
        BLOCK=triton.next_power_of_2(kvh * d),
    )
