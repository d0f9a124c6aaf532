"""Default mode's paged attention on CUDA, in Triton: flash attention for prompts, split keys for
decode steps. Neither keeps a row's bits across batch shapes (exact mode's `paged_triton` does);
both read the pages in place, through the sequence's page table, with grouped KV heads.

- A step with prompt rows (`flash`): one program per (block of query positions of one sequence,
  KV head), its tile rows (position, query head) pairs, so the REP query heads of a KV head share
  each key tile. It walks the keys from the first to its block's last position in BLOCK_N tiles
  with an online softmax in registers, and writes its rows: no partial results in memory, no
  second kernel (the decode splits write 4(D + 2) bytes per row, head and split, which at
  16k keys is more than the keys themselves). The heaviest blocks (a prompt's last) start first.
  A whole prompt of WHOLE_PROMPT_ROWS or more (from position 0, so its keys are its own rows) goes
  to PyTorch's fused SDPA instead (`whole_prompt`), which is faster there than this kernel.
- A decode-only step (`decode`): one program per (block of positions, KV head, split of the
  keys), each walking its split in BLOCK_KV tiles with an online softmax and writing the split's
  max, sum and partial output, with splits as small as one tile while their partial outputs
  stay small (`decode_split`): the more programs, the more loads in flight; a second kernel
  combines a row's splits, COMBINE_CHUNK at a time. A captured step (worker/cuda_graphs.py,
  `StepAttention`) splits as an eager decode step of its bucket does, so it gets its bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import ATTENTION_SPLIT, FUSION, Scratch, splits_bucket, states_bytes
from . import paged_triton as paged
from .paged_triton import block_tile_rows, tile_kv, tile_pages

# (query position, head) rows per program, keys per tile, warps, by head size: the fastest of a
# sweep on an H200 at 1 x 16k and 8 x 512 tokens (docs/benchmarks.md)
TILES = {64: (128, 64, 8), 128: (256, 64, 8)}
LOG2E = 1.4426950408889634
BLOCK_KV = 64  # key positions per tile of a decode split; divides every split
# what a launch's partial outputs may take before its splits grow: one buffer a worker holds
# (`kernels.Scratch`), 0.7% of an H200's memory
SPLIT_SCRATCH_BYTES = 1 << 30
COMBINE_CHUNK = 32  # splits a combine program loads at once
WHOLE_PROMPT_ROWS = 2048  # a whole prompt this long goes to `whole_prompt`


@triton.jit
def _tile(q, k_ptr, v_ptr, tables_ptr, table, s0, last, pos, m_i, l_i, acc, kvh, d, stride_kp,
          stride_ks, stride_kh, page_size, qk_scale, BLOCK_N: tl.constexpr,
          MASKED: tl.constexpr):
    # keys s0 .. s0 + BLOCK_N - 1 into the online softmax; MASKED: some row of the block may not
    # see some key of the tile (else every row sees every key, and nothing is masked)
    offs = s0 + tl.arange(0, BLOCK_N)
    if MASKED:
        in_context = offs <= last
        page = tl.load(tables_ptr + table + offs // page_size, mask=in_context, other=0)
    else:
        page = tl.load(tables_ptr + table + offs // page_size)
    at = page.to(tl.int64) * stride_kp + (offs % page_size) * stride_ks + kvh * stride_kh
    if MASKED:
        k = tl.load(k_ptr + at[:, None] + d[None, :], mask=in_context[:, None], other=0.0)
        v = tl.load(v_ptr + at[:, None] + d[None, :], mask=in_context[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + at[:, None] + d[None, :])
        v = tl.load(v_ptr + at[:, None] + d[None, :])
    s = tl.dot(q, tl.trans(k)) * qk_scale  # in log2 units
    if MASKED:
        s = tl.where(offs[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _flash_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, blocks_ptr, pos_ptr, out_ptr,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
                  page_size, n_blocks, qk_scale, REP: tl.constexpr, REP_P2: tl.constexpr,
                  BLOCK_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    qb = n_blocks - 1 - tl.program_id(0)  # a sequence's last block, the most keys, first
    kvh = tl.program_id(1)
    table, row0, _, valid, t, h, pos = block_tile_rows(blocks_ptr, pos_ptr, qb, kvh, REP,
                                                       REP_P2, BLOCK_P)
    last = tl.max(pos, axis=0)
    first = tl.load(pos_ptr + row0)  # a block's rows are consecutive positions
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    m_i = tl.full((BLOCK_P * REP_P2,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_P * REP_P2,), tl.float32)
    acc = tl.zeros((BLOCK_P * REP_P2, D), tl.float32)
    seen_by_all = (first + 1) // BLOCK_N * BLOCK_N  # tiles every row of the block sees whole
    for s0 in range(0, seen_by_all, BLOCK_N):
        m_i, l_i, acc = _tile(q, k_ptr, v_ptr, tables_ptr, table, s0, last, pos, m_i, l_i, acc,
                              kvh, d, stride_kp, stride_ks, stride_kh, page_size, qk_scale,
                              BLOCK_N, False)
    for s0 in range(seen_by_all, last + 1, BLOCK_N):
        m_i, l_i, acc = _tile(q, k_ptr, v_ptr, tables_ptr, table, s0, last, pos, m_i, l_i, acc,
                              kvh, d, stride_kp, stride_ks, stride_kh, page_size, qk_scale,
                              BLOCK_N, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


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
    table, _, _, valid, t, h, pos = block_tile_rows(blocks_ptr, pos_ptr, qb, kvh, REP, REP_P2,
                                                    BLOCK_P)
    page_base = tl.load(base_ptr)
    last = tl.max(pos, axis=0)
    start = j * SPLIT
    if start <= last:
        d = tl.arange(0, D)
        q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=valid[:, None], other=0.0)
        m_i = tl.full((BLOCK_P * REP_P2,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_P * REP_P2,), tl.float32)
        acc = tl.zeros((BLOCK_P * REP_P2, D), tl.float32)
        # loads run ahead of the arithmetic: a tile's keys and values one tile ahead, its page
        # ids two
        end = tl.minimum(start + SPLIT, last + 1)
        tile = tl.arange(0, BLOCK_KV)
        pages = tile_pages(tables_ptr, table, page_base, start + tile, end, page_size)
        k_next, v_next = tile_kv(k_ptr, v_ptr, pages, start + tile, end, kvh, d, stride_kp,
                                 stride_ks, stride_kh, page_size)
        pages = tile_pages(tables_ptr, table, page_base, start + BLOCK_KV + tile, end,
                           page_size)
        for s0 in range(start, end, BLOCK_KV):
            k, v = k_next, v_next
            offs = s0 + tile
            k_next, v_next = tile_kv(k_ptr, v_ptr, pages, offs + BLOCK_KV, end, kvh, d,
                                     stride_kp, stride_ks, stride_kh, page_size)
            pages = tile_pages(tables_ptr, table, page_base, offs + 2 * BLOCK_KV, end,
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


def flash(q, k_pool, v_pool, meta, scale: float, tiles: tuple[int, int, int] | None = None,
          stages: int = 2, skip: set[int] = frozenset()) -> torch.Tensor:
    """Every row of the step but those of the sequences in `skip` (left unwritten): q [T, H, D]
    -> [T, H, D]. tiles: (rows, keys, warps), TILES' for the head size (or (128, 64, 4)) unless
    given."""
    t, h, d = q.shape
    block_m, block_n, warps = tiles or TILES.get(d, (128, 64, 4))
    kvh = k_pool.shape[2]
    q = q.contiguous()
    rep_p2 = triton.next_power_of_2(h // kvh)
    block_p = max(1, block_m // rep_p2)
    blocks, tables = paged.step_blocks(meta, block_p, skip)
    out = torch.empty_like(q)
    n_blocks = blocks.shape[0]
    if n_blocks:
        _flash_kernel[(n_blocks, kvh)](
            q, k_pool, v_pool, tables, blocks, meta.positions, out, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            k_pool.shape[1], n_blocks, scale * LOG2E, REP=h // kvh, REP_P2=rep_p2,
            BLOCK_P=block_p, D=d, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **FUSION)
    return out


def decode_split(rows: int, keys: int, q_heads: int, head_dim: int) -> int:
    """Keys per split of a decode step of `rows` rows (a bucket) over up to `keys` keys (a
    multiple of ATTENTION_SPLIT): one tile (BLOCK_KV), doubled while the splits' partial
    outputs would pass SPLIT_SCRATCH_BYTES, up to ATTENTION_SPLIT. On an H200 one-tile splits
    were the fastest of splits of 64, 128 and 256 keys in tiles of 32 and 64 keys at every
    shape measured, from one decode row to 256 and prompt chunks of 24 to 512 rows, over 512 to
    16k keys (docs/benchmarks.md): more programs keep more loads in flight, which outweighs
    their partial outputs' traffic (6% of the keys' bytes)."""
    split = BLOCK_KV
    while split < ATTENTION_SPLIT and \
            states_bytes((rows, q_heads, keys // split), head_dim) > SPLIT_SCRATCH_BYTES:
        split *= 2
    return split


def decode_block(q_heads: int, kv_heads: int) -> int:
    """Query positions a decode program's tile holds (one is used): the fewest a tensor-core
    product takes (16 tile rows)."""
    return max(1, 16 // triton.next_power_of_2(q_heads // kv_heads))


def decode(q, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
    """A decode step's rows, split as a captured step of its bucket splits them
    (`StepAttention`), so that both give the same bits."""
    t, h, d = q.shape
    kvh = k_pool.shape[2]
    rows = 1 << (meta.n_seqs - 1).bit_length()
    keys = splits_bucket(max(meta.context_lens)) * ATTENTION_SPLIT
    split, block_p = decode_split(rows, keys, h, d), decode_block(h, kvh)
    blocks, tables = paged.step_blocks(meta, block_p)
    out = torch.empty_like(q)
    # one scratch a step, kept on its meta: every layer's launches have its shape and run one
    # after another on one stream
    cache = meta.__dict__.setdefault("_split_scratch", {})
    if (h, d, split) not in cache:
        cache[h, d, split] = Scratch(q.device).states(
            (t, h, triton.cdiv(max(meta.context_lens), split)), d)
    scratch = cache[h, d, split]
    launch_decode(q.contiguous(), k_pool, v_pool, tables, paged.zero_base(q.device), blocks,
                  meta.positions, scratch, out, scale, split, block_p)
    return out


class StepAttention:
    """What a captured step of up to `rows` rows over up to `keys` keys launches for its
    attention (worker/cuda_graphs.py): the split kernels, split as an eager decode step of that
    bucket (`decode`), whatever the step's rows, their partial results in `scratch`."""

    def __init__(self, rows: int, keys: int, q_heads: int, kv_heads: int, head_dim: int,
                 scratch: Scratch):
        self.split = decode_split(rows, keys, q_heads, head_dim)
        self.block_rows = decode_block(q_heads, kv_heads)
        self.scratch = scratch.states((rows, q_heads, keys // self.split), head_dim)

    def __call__(self, q, k_pool, v_pool, tables, base, blocks, positions, out, scale: float
                 ) -> None:
        launch_decode(q, k_pool, v_pool, tables, base, blocks, positions, self.scratch, out,
                      scale, self.split, self.block_rows)


def launch_decode(q, k_pool, v_pool, tables, base, blocks, positions, scratch, out,
                  scale: float, split: int, block_p: int) -> None:
    """The split kernels over explicit buffers, each sized by the caller. q, out: [T, H, D];
    tables: flat page ids, each offset by base [1]; blocks: [n, 3] as `paged.step_blocks`, of
    block_p positions; positions: [T] (-1: a padding row); scratch: `Scratch.states((T, H,
    splits), D)`, splits of `split` keys (a multiple of BLOCK_KV) covering every key."""
    t, h, d = q.shape
    rep = h // k_pool.shape[2]
    m, l_split, o = scratch
    max_splits = m.shape[2]
    _attention_split_kernel[(blocks.shape[0], k_pool.shape[2], max_splits)](
        q, k_pool, v_pool, tables, base, blocks, positions, m, l_split, o,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        k_pool.shape[1], max_splits, scale, H=h, REP=rep, REP_P2=triton.next_power_of_2(rep),
        BLOCK_P=block_p, D=d, SPLIT=split, BLOCK_KV=BLOCK_KV, **FUSION,
    )
    _attention_combine_kernel[(t, h)](m, l_split, o, positions, out, out.stride(0),
                                      out.stride(1), max_splits, H=h, D=d, SPLIT=split,
                                      CHUNK=COMBINE_CHUNK, **FUSION)


def whole_prompt(q, k_pool, v_pool, meta, b: int, scale: float) -> torch.Tensor:
    """Sequence b's rows, a whole prompt from position 0, attended by PyTorch's fused SDPA
    (flash or cuDNN, with grouped heads) over its keys gathered from its pages in order: on an
    H200 1.6 to 1.7 times this module's kernel at 16k keys (docs/benchmarks.md), for a gather
    of its keys (a few percent of the attention's time)."""
    lo, hi = meta.query_starts[b], meta.query_starts[b + 1]
    table = meta.page_tables[b]
    # [1, heads, keys, D], keys contiguous: what SDPA's fused kernels take (measured: a 3-D or
    # key-strided input falls to its math path, which stores every score)
    k, v = (pool[table].flatten(0, 1)[:hi - lo].transpose(0, 1).contiguous()[None]
            for pool in (k_pool, v_pool))
    o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], k, v, is_causal=True,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def paged_attention(q, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
    """`worker.attention.PagedAttention.attend`'s contract, in default mode."""
    if not meta.decode_only:
        long = [b for b in range(meta.n_seqs) if meta.context_lens[b] >= WHOLE_PROMPT_ROWS
                and meta.query_starts[b + 1] - meta.query_starts[b] == meta.context_lens[b]]
        if not long:
            return flash(q, k_pool, v_pool, meta, scale)
        out = flash(q, k_pool, v_pool, meta, scale, skip=set(long))
        for b in long:
            out[meta.query_starts[b]:meta.query_starts[b + 1]] = whole_prompt(
                q, k_pool, v_pool, meta, b, scale)
        return out
    return decode(q, k_pool, v_pool, meta, scale)
