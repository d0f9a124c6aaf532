"""Exact mode's paged attention for CUDA, in Triton, the pieces every paged kernel shares, and the
row writes of the step graphs. Exact mode attends with `paged_attention` here; default mode with
`flash_triton`'s kernels, which read pages through the same helpers.

- `paged_attention`: each row's keys are cut into tiles of TILE positions, aligned to absolute
  positions; a tile's softmax state (max, sum, unnormalised output) is computed for the row
  alone, and the states are merged in order, tile 0 first, by one arithmetic (`_merge`). Tile
  rows are (position, query head) pairs, so tensor cores do both products and a tensor-core
  row's result depends on that row alone; a tile past a row's position leaves its state exactly
  as it was. So neither the query count, the context of the launch, the chunking of a prompt nor
  the physical pages change a bit.

  Where the tiles are computed does not change a bit either, which is what lets a decode step
  use the GPU: one program per (block of query positions of one sequence, KV head) walks its
  tiles and merges them as it goes (prompt rows, and every row of a launch with programs
  enough), or, for a block of one position in a launch of few rows (`spread`), one program per
  tile writes that tile's state and the last of a row's programs to finish merges its states
  in the same order with the same arithmetic.
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

from . import FUSION, Scratch, launch_counts, sm_count, states_bytes
from .counting import last_to_finish

TILE = 64  # key positions a row's state is computed over alone, then merged in order
# (query position, head) rows per attention program, the fewest a tensor-core product takes: a
# decode row (a block of one position) computes 16 tile rows, of which rep are its own. At 64 a
# decode step's attention cost twice default mode's on an H100; at 16 a long prompt's costs more
# (its keys read once per 16 rows): docs/exact-mode.md, "Cost"
BLOCK_ROWS = 16
# Warps per attention program, one number in every launch (a row's bits depend on it): two make
# prompts 1.2-1.3x faster and batch-32 decode 1.15x, but batch-1 and -4 decode 7% slower on an
# H100 (docs/exact-mode.md, "Cost")
WARPS = 4
# BLOCK_ROWS-row tiles a program computes against each key tile it loads for a block of more
# than one tile's positions (a prompt's): its keys read once per GROUP tiles, each tile's rows
# computed as a lone tile's (`_attention_kernel` unrolls the four)
GROUP = 4
# Rows from which an eager launch groups its prompts' tiles (a captured step's launch never does:
# `StepAttention`). On an H100 grouped launches of 4,096 rows and more and 8 x 512 run 1.25-1.5x
# faster; grouped launches of up to 288 rows (decode rows, a 256-row chunk beside 32 of them) ran
# 1.0-1.5x slower: a grouped program's registers, and a short prompt's fewer programs
# (docs/exact-mode.md, "Cost")
GROUP_FROM_ROWS = 1024
MERGE_CHUNK = 8  # spread tile states loaded before any of them is merged
# Spread where a launch has fewer (block, KV head) programs than SMs / SPREAD_BELOW: on an H200
# a spread tile costs more than a walked one, so spreading pays only where most SMs would idle
SPREAD_BELOW = 2
SPREAD_SCRATCH_BYTES = 64 << 20  # the most the spread tiles' states may take
# No fused multiply-adds but the written ones: a walked row's merges and a spread row's must
# round alike
NO_FUSION = {"enable_fp_fusion": False}


@triton.jit
def tile_pages(tables_ptr, table, page_base, offs, end, page_size):
    # the page ids of key positions offs [n] (0 at and past end)
    return page_base + tl.load(tables_ptr + table + offs // page_size, mask=offs < end, other=0)


@triton.jit
def tile_kv(k_ptr, v_ptr, pages, offs, end, kvh, d, stride_kp, stride_ks, stride_kh,
            page_size):
    # K and V [n, D] of key positions offs in pages (zeros at and past end)
    at = pages.to(tl.int64) * stride_kp + (offs % page_size) * stride_ks + kvh * stride_kh
    mask = (offs < end)[:, None]
    return (tl.load(k_ptr + at[:, None] + d[None, :], mask=mask, other=0.0),
            tl.load(v_ptr + at[:, None] + d[None, :], mask=mask, other=0.0))


@triton.jit
def block_tile_rows(blocks_ptr, pos_ptr, qb, kvh, REP: tl.constexpr, REP_P2: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    # Block qb's (where its sequence's pages start in the flat tables, first row, rows) and its
    # first tile's rows (`tile_rows`)
    table = tl.load(blocks_ptr + 3 * qb)
    row0 = tl.load(blocks_ptr + 3 * qb + 1)
    n = tl.load(blocks_ptr + 3 * qb + 2)
    valid, t, h, pos = tile_rows(pos_ptr, row0, n, 0, kvh, REP, REP_P2, BLOCK_P)
    return table, row0, n, valid, t, h, pos


@triton.jit
def tile_rows(pos_ptr, row0, n, sub, kvh, REP: tl.constexpr, REP_P2: tl.constexpr,
              BLOCK_P: tl.constexpr):
    # The rows of tile `sub` (positions sub * BLOCK_P ..) of a block of n rows from row0,
    # (position, head) pairs of KV head kvh: whether each is one, its row t, query head h and
    # position (-1 for none: row i attends keys [0, pos[i]])
    r = tl.arange(0, BLOCK_P * REP_P2)
    i = sub * BLOCK_P + r // REP_P2
    valid = (i < n) & (r % REP_P2 < REP)
    t = (row0 + i).to(tl.int64)
    h = kvh * REP + r % REP_P2
    pos = tl.load(pos_ptr + t, mask=valid, other=-1)
    return valid, t, h, pos


@triton.jit
def _merge(m_i, l_i, acc, m, l, o, live):
    # A row's state (max m_i, sum l_i, unnormalised output acc) followed by a tile's (m, l, o),
    # where live (else the state as it was, bit for bit); a row's first tile is taken as it is.
    # A walked row's merges and a spread row's run this, so they meet the same roundings.
    first = m_i == float("-inf")
    m_new = tl.maximum(m_i, m)
    a = tl.exp(m_i - m_new)
    b = tl.exp(m - m_new)
    l_new = tl.where(first, l, tl.fma(l_i, a, l * b))
    acc_new = tl.where(first[:, None], o, tl.fma(acc, a[:, None], o * b[:, None]))
    return (tl.where(live, m_new, m_i), tl.where(live, l_new, l_i),
            tl.where(live[:, None], acc_new, acc))


@triton.jit
def _normalised(l_i, acc):
    # the output of a row's merged state (zeros where it saw no key: a padding row)
    return tl.where((l_i > 0)[:, None], acc / l_i[:, None], 0.0)


@triton.jit
def _tile_state(q, k, v, offs, s0, pos, scale, m_i, l_i, acc):
    # a key tile's state for each of q's rows alone (keys offs, the first s0), merged into the
    # row's state where the row sees the tile
    seen = offs[None, :] <= pos[:, None]
    s = tl.where(seen, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
    m = tl.max(s, axis=1)
    p = tl.where(seen, tl.exp(s - m[:, None]), 0.0)
    return _merge(m_i, l_i, acc, m, tl.sum(p, axis=1), tl.dot(p.to(v.dtype), v), pos >= s0)


@triton.jit
def _tile_q(q_ptr, t, h, d, valid, stride_qt, stride_qh):
    return tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                   mask=valid[:, None], other=0.0)


@triton.jit
def _store_rows(out_ptr, t, h, d, valid, l_i, acc, stride_ot, stride_oh):
    tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
             _normalised(l_i, acc).to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["max_tiles"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, base_ptr, blocks_ptr, pos_ptr, m_ptr, l_ptr, o_ptr,
    counts_ptr, out_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks,
    stride_kh, page_size, max_tiles, scale, H: tl.constexpr, REP: tl.constexpr,
    REP_P2: tl.constexpr, BLOCK_P: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
    SPREAD: tl.constexpr, GROUPED: tl.constexpr, CHUNK: tl.constexpr,
):
    # One program: a block of one sequence x the REP query heads of one KV head, in tiles of
    # BLOCK_P query positions (16 tile rows, (position, head) pairs): one tile for a block of
    # up to BLOCK_P positions, and where GROUPED, GROUP tiles for a longer one (a prompt's),
    # each tile's rows computed alone against every key tile the program loads, so a row gets
    # the same bits in either.
    # A block is (where its sequence's pages start in the flat tables, first row, rows); a
    # page id read there is offset by *base_ptr (the layer's slot in a staging ring, else 0).
    # It merges key tiles lo .. hi - 1 and writes the rows' outputs; SPREAD, a block of one
    # position: program_id(2)'s key tile alone, its state into m, l, o ([T, max_tiles, H]
    # (x D)); the row's last program to finish (its count in counts_ptr: `launch_counts`)
    # merges them (`_merge_spread`).
    qb, kvh, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    table, row0, n, valid, t, h, pos = block_tile_rows(blocks_ptr, pos_ptr, qb, kvh, REP,
                                                       REP_P2, BLOCK_P)
    last = tl.max(pos, axis=0)
    if GROUPED:
        # a group's later tiles: rows of none (position -1) where the block lacks them
        valid1, t1, h1, pos1 = tile_rows(pos_ptr, row0, n, 1, kvh, REP, REP_P2, BLOCK_P)
        valid2, t2, h2, pos2 = tile_rows(pos_ptr, row0, n, 2, kvh, REP, REP_P2, BLOCK_P)
        valid3, t3, h3, pos3 = tile_rows(pos_ptr, row0, n, 3, kvh, REP, REP_P2, BLOCK_P)
        last = tl.maximum(tl.maximum(last, tl.max(pos1, axis=0)),
                          tl.maximum(tl.max(pos2, axis=0), tl.max(pos3, axis=0)))
    page_base = tl.load(base_ptr)
    tiles = tl.where(last < 0, 0, last // TILE + 1)
    spread = SPREAD and n == 1
    if spread:
        lo, hi = j, tl.minimum(j + 1, tiles)
    else:
        lo, hi = 0, tl.where(j == 0, tiles, 0)
    d = tl.arange(0, D)
    if lo < hi:
        q = _tile_q(q_ptr, t, h, d, valid, stride_qt, stride_qh)
        m_i = tl.full((BLOCK_P * REP_P2,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_P * REP_P2,), tl.float32)
        acc = tl.zeros((BLOCK_P * REP_P2, D), tl.float32)
        if GROUPED:
            q1 = _tile_q(q_ptr, t1, h1, d, valid1, stride_qt, stride_qh)
            q2 = _tile_q(q_ptr, t2, h2, d, valid2, stride_qt, stride_qh)
            q3 = _tile_q(q_ptr, t3, h3, d, valid3, stride_qt, stride_qh)
            m1, l1, acc1 = m_i, l_i, acc
            m2, l2, acc2 = m_i, l_i, acc
            m3, l3, acc3 = m_i, l_i, acc
        # Loads run ahead of the arithmetic, which they do not change: a tile's keys and values
        # one tile ahead, its page ids two, none past the program's tiles
        end = tl.minimum(last + 1, hi * TILE)
        tile = tl.arange(0, TILE)
        pages = tile_pages(tables_ptr, table, page_base, lo * TILE + tile, end, page_size)
        k_next, v_next = tile_kv(k_ptr, v_ptr, pages, lo * TILE + tile, end, kvh, d, stride_kp,
                                 stride_ks, stride_kh, page_size)
        pages = tile_pages(tables_ptr, table, page_base, (lo + 1) * TILE + tile, end, page_size)
        for s0 in range(lo * TILE, hi * TILE, TILE):
            k, v = k_next, v_next
            offs = s0 + tile
            k_next, v_next = tile_kv(k_ptr, v_ptr, pages, offs + TILE, end, kvh, d, stride_kp,
                                     stride_ks, stride_kh, page_size)
            pages = tile_pages(tables_ptr, table, page_base, offs + 2 * TILE, end, page_size)
            m_i, l_i, acc = _tile_state(q, k, v, offs, s0, pos, scale, m_i, l_i, acc)
            if GROUPED:
                if n > BLOCK_P:
                    m1, l1, acc1 = _tile_state(q1, k, v, offs, s0, pos1, scale, m1, l1, acc1)
                    m2, l2, acc2 = _tile_state(q2, k, v, offs, s0, pos2, scale, m2, l2, acc2)
                    m3, l3, acc3 = _tile_state(q3, k, v, offs, s0, pos3, scale, m3, l3, acc3)
        if spread:
            at = (t * max_tiles + j) * H + h
            tl.store(m_ptr + at, m_i, mask=valid)
            tl.store(l_ptr + at, l_i, mask=valid)
            tl.store(o_ptr + at[:, None] * D + d[None, :], acc, mask=valid[:, None])
            count = counts_ptr + qb * tl.num_programs(1) + kvh
            if last_to_finish(count, tl.minimum(tiles, max_tiles)):
                _merge_spread(row0.to(tl.int64), kvh, last, m_ptr, l_ptr, o_ptr, out_ptr,
                              stride_ot, stride_oh, max_tiles, H, REP, REP_P2, D, TILE, CHUNK)
        else:
            _store_rows(out_ptr, t, h, d, valid, l_i, acc, stride_ot, stride_oh)
            if GROUPED:  # a block of BLOCK_P rows or fewer stores nothing more: its rows are none
                _store_rows(out_ptr, t1, h1, d, valid1, l1, acc1, stride_ot, stride_oh)
                _store_rows(out_ptr, t2, h2, d, valid2, l2, acc2, stride_ot, stride_oh)
                _store_rows(out_ptr, t3, h3, d, valid3, l3, acc3, stride_ot, stride_oh)


@triton.jit
def _merge_spread(t, kvh, pos, m_ptr, l_ptr, o_ptr, out_ptr, stride_ot, stride_oh, max_tiles,
                  H: tl.constexpr, REP: tl.constexpr, REP_P2: tl.constexpr, D: tl.constexpr,
                  TILE: tl.constexpr, CHUNK: tl.constexpr):
    # Spread row t's output (one position pos x the REP query heads of KV head kvh): its tiles'
    # states merged in order by `_merge`, as `_attention_kernel` merges a walked row's; CHUNK
    # states loaded before any of them is merged, past the cache of this program's SM (other
    # programs wrote them)
    r = tl.arange(0, REP_P2)
    h = kvh * REP + r
    d = tl.arange(0, D)
    tiles = pos // TILE + 1
    m_i = tl.full((REP_P2,), float("-inf"), tl.float32)
    l_i = tl.zeros((REP_P2,), tl.float32)
    acc = tl.zeros((REP_P2, D), tl.float32)
    for j0 in range(0, tiles, CHUNK):
        for i in tl.static_range(CHUNK):
            # (r * 0: Triton's interpreter cannot mask with a scalar and a tensor together)
            live = (r < REP) & (j0 + i + r * 0 < tiles)
            at = (t * max_tiles + j0 + i) * H + h
            m_i, l_i, acc = _merge(
                m_i, l_i, acc,
                tl.load(m_ptr + at, mask=live, other=float("-inf"), cache_modifier=".cg"),
                tl.load(l_ptr + at, mask=live, other=0.0, cache_modifier=".cg"),
                tl.load(o_ptr + at[:, None] * D + d[None, :], mask=live[:, None], other=0.0,
                        cache_modifier=".cg"), live)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
             _normalised(l_i, acc).to(out_ptr.dtype.element_ty), mask=(r < REP)[:, None])


def block_rows(q_heads: int, kv_heads: int) -> int:
    """Query positions per attention program (a decode row is a block of one of them)."""
    return max(1, BLOCK_ROWS // triton.next_power_of_2(q_heads // kv_heads))


def block_spans(lo: int, hi: int, block: int, prompt_block: int) -> list[tuple[int, int]]:
    """(first row, rows) of the attention blocks of one sequence's rows lo .. hi - 1: blocks
    of `block` positions, or of `prompt_block` where the sequence has more rows than `block`."""
    size = block if hi - lo <= block else prompt_block
    return [(r, min(size, hi - r)) for r in range(lo, hi, size)]


def step_blocks(meta, block_p: int, skip: set[int] = frozenset(), group: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of one sequence's rows (none of the sequences in `skip`) as `block_spans` cuts
    them, of `block_p` positions or `group` times that, [n_blocks, 3] (start of the sequence's
    pages in the flat tables, first row, rows), and the flat tables (every sequence's page
    table end to end): built once a step and kept on its meta, since every layer's launches
    read the same."""
    cache = meta.__dict__.setdefault("_exact_blocks", {})
    key = (block_p, group, tuple(sorted(skip)))
    if key not in cache:
        starts, table_starts = meta.query_starts, [0]
        for t in meta.page_tables:
            table_starts.append(table_starts[-1] + t.numel())
        blocks = [(table_starts[b], r, n) for b in range(meta.n_seqs) if b not in skip
                  for r, n in block_spans(starts[b], starts[b + 1], block_p, block_p * group)]
        dev = meta.positions.device
        cache[key] = (torch.tensor(blocks, dtype=torch.int64, device=dev).view(-1, 3),
                      torch.cat(meta.page_tables))
    return cache[key]


def spread(rows: int, keys: int, q_heads: int, kv_heads: int, head_dim: int,
           device: torch.device) -> bool:
    """Whether a launch of up to `rows` rows over up to `keys` keys spreads its one-position
    blocks' tiles over programs of their own: where its (block, KV head) programs would leave
    SMs idle, and the tiles' states fit SPREAD_SCRATCH_BYTES. The bits are the same either way."""
    few = rows * kv_heads * SPREAD_BELOW < sm_count(device)
    return few and states_bytes(tile_shape(rows, keys, q_heads), head_dim) <= SPREAD_SCRATCH_BYTES


def tile_shape(rows: int, keys: int, q_heads: int) -> tuple[int, int, int]:
    """The spread tiles' states of a launch: [rows, tiles, H] (`Scratch.states`)."""
    return rows, triton.cdiv(keys, TILE), q_heads


def paged_attention(q, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
    """`worker.attention.PagedAttention.attend`'s contract; q: [T, H, D], D a power of two."""
    t, h, d = q.shape
    kvh = k_pool.shape[2]
    out = torch.empty_like(q)
    if t:
        group = GROUP if t >= GROUP_FROM_ROWS else 1
        blocks, tables = step_blocks(meta, block_rows(h, kvh), group=group)
        keys = max(meta.context_lens)
        states = None
        if spread(t, keys, h, kvh, d, q.device):
            cache = meta.__dict__.setdefault("_tile_states", {})
            if (h, d) not in cache:
                cache[h, d] = Scratch(q.device).states(tile_shape(t, keys, h), d)
            states = cache[h, d]
        launch(q.contiguous(), k_pool, v_pool, tables, zero_base(q.device), blocks, meta.positions,
               states, out, scale, grouped=group > 1)
    return out


class StepAttention:
    """What a captured step of up to `rows` rows over up to `keys` keys launches for its
    attention (worker/cuda_graphs.py): `launch` over the step's fixed buffers, with tile states
    of its own where that bucket spreads."""

    def __init__(self, rows: int, keys: int, q_heads: int, kv_heads: int, head_dim: int,
                 scratch: Scratch):
        self.block_rows = block_rows(q_heads, kv_heads)
        self.states = None
        if spread(rows, keys, q_heads, kv_heads, head_dim, scratch.device):
            self.states = scratch.states(tile_shape(rows, keys, q_heads), head_dim)

    def __call__(self, q, k_pool, v_pool, tables, base, blocks, positions, out, scale: float
                 ) -> None:
        launch(q, k_pool, v_pool, tables, base, blocks, positions, self.states, out, scale)


def launch(q, k_pool, v_pool, tables, base, blocks, positions, states, out, scale: float,
           grouped: bool = False) -> None:
    """The launch of a paged attention over explicit buffers, each sized by the caller. q,
    out: [T, H, D]; tables: flat page ids, each offset by base [1]; blocks: [n, 3] as
    `step_blocks`, of `block_rows` positions (`grouped`: a prompt's of GROUP times that);
    positions: [T] (-1: a padding row); states: `Scratch.states` of a `tile_shape` covering
    every key to spread one-position blocks' tiles, None not to."""
    h, d = q.shape[1:]
    kvh = k_pool.shape[2]
    rep = h // kvh
    rep_p2 = triton.next_power_of_2(rep)
    m, l_tile, o = states if states is not None else (out, out, out)
    max_tiles = m.shape[1] if states is not None else 1
    counts = launch_counts(q.device) if states is not None else out
    assert states is None or blocks.shape[0] * kvh <= counts.numel(), "a count for each row"
    _attention_kernel[(blocks.shape[0], kvh, max_tiles)](
        q, k_pool, v_pool, tables, base, blocks, positions, m, l_tile, o, counts, out, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), k_pool.stride(0), k_pool.stride(1),
        k_pool.stride(2), k_pool.shape[1], max_tiles, scale, H=h, REP=rep, REP_P2=rep_p2,
        BLOCK_P=block_rows(h, kvh), D=d, TILE=TILE, SPREAD=states is not None, GROUPED=grouped,
        CHUNK=MERGE_CHUNK, num_warps=WARPS, **NO_FUSION)


@functools.cache
def zero_base(dev: torch.device) -> torch.Tensor:
    """The page base of pages in place (not in a staging ring's slot): [1] zeros."""
    return torch.zeros(1, dtype=torch.int64, device=dev)


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
        BLOCK=triton.next_power_of_2(kvh * d), **FUSION,
    )
