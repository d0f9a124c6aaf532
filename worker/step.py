"""A step as its layers see it: `PagedStep`, the one per-step structure every forward pass
uses, eager or replayed from CUDA graphs (worker/cuda_graphs.py), with the one `attend(layer, q,
k, v)` that writes a layer's new rows into its pages and attends over them; and `StepPass`, the
stage's forward pass over a step cut where the pool's hooks run.

Where each row goes (its page and offset) is computed once, on the host, by `batch.build_meta`
(a host pool renumbers the pages into its staging slot). An eager step reads the meta's tensors
and a layer's pages from its base in the pool's buffers. A bucket step (the step graphs') holds
the same in fixed buffers that captured kernels read by address, filled by one upload before a
replay, its rows padded to the bucket: a padding row writes its K and V into the pool's spare
page, attends to nothing and is dropped. Its attention is the pool's `PagedAttention.
step_attention`; `captured=False` attends through the pool's eager attention over the step's
real rows instead (the CPU tests of the bucket path).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain, repeat

import torch

from .batch import BatchMeta, ints_into
from .kernels import ATTENTION_SPLIT, Scratch
from .kv.pool import Pool
from .kv.rows import write_rows
from .model import StageModel


class PagedStep:
    """The rows of one step over `pool`'s layers; `fill` before each step."""

    def __init__(self, pool: Pool, rows: int | None = None, splits: int = 0,
                 heads: tuple[int, int, int] | None = None, device: torch.device | None = None,
                 captured: bool = False, scratch: Scratch | None = None):
        """rows None: an eager step, sized to each step's rows. Else a bucket of up to `rows`
        rows over up to `splits` attention splits of keys; heads (query heads, KV heads, head
        size) and scratch (the attention's partial results, every bucket's) for its captured
        attention."""
        self.pool, self.rows = pool, rows
        self.meta: BatchMeta | None = None
        self.positions: torch.Tensor | None = None  # [T] int64
        # each layer's new rows k, v [T, KVH, D] as written, for the pool's `leave`
        self.new_rows: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(pool.layers)
        self.page_bases: list[int] = []  # an eager step's layers' bases, this step
        self.ints = None
        if rows is not None:
            self._buffers(rows, splits, heads, device, captured, scratch)

    def _buffers(self, rows: int, splits: int, heads: tuple[int, int, int] | None,
                 device: torch.device, captured: bool, scratch: Scratch | None) -> None:
        pool, n_layers = self.pool, len(self.pool.layers)
        # positions [rows] | attention positions [rows], -1 past the batch | blocks [rows, 3]
        # (no more blocks than rows) | where each row's table starts [rows] | the rows that
        # sample [rows] | page bases [layers] | write offsets [rows] | write pages [rows], -1
        # past the batch | the flat page tables (no more sequences than rows): one buffer, so
        # one upload a step
        pages_per_row = -(-splits * ATTENTION_SPLIT // pool.page_size)
        self.ints = torch.zeros(9 * rows + n_layers + rows * pages_per_row, dtype=torch.int64,
                                device=device)
        (self.positions, self.attn_positions, blocks, self.row_tables, self.head_rows,
         self.bases, self.write_offset, self.write_pages, self.tables) = self.ints.split(
            [rows, rows, 3 * rows, rows, rows, n_layers, rows, rows, rows * pages_per_row])
        self.blocks = blocks.view(rows, 3)
        # captured: the Triton kernels, launched over these buffers; else the pool's eager paths
        self.kernels = pool.attention.kernels if captured else None
        self.attention = None  # what the captured kernels attend with
        self.block_rows = 1  # positions of one sequence an attention block holds
        if captured:
            self.attention = pool.attention.step_attention(
                rows, splits * ATTENTION_SPLIT, *heads, scratch)
            self.block_rows = self.attention.block_rows
        self._copied: tuple | None = None  # the device tensors the tables and writes hold
        self.write_page = None  # [layers, rows], each layer's base added (`place_rows`)
        # the carried rows, their pages (-1: none) and offsets, and their pages with each
        # layer's base [layers, rows] (`place_rows`); only for a pool that carries
        self.carry_rows = self.carry_at = self.carry_pages = None
        if pool.carries:
            kvh, d = pool.k.shape[-2:]
            self.carry_rows = torch.zeros(n_layers, 2, rows, kvh, d, dtype=pool.k.dtype,
                                          device=device)
            self.carry_at = torch.zeros(2, rows, dtype=torch.int64, device=device)
        self.clear()

    def clear(self) -> None:
        """A bucket step with no rows: what a capture runs, writing only the spare page."""
        self.ints.zero_()
        self.attn_positions.fill_(-1)
        self.write_pages.fill_(-1)
        self._copied = None
        if self.carry_at is not None:
            self._fill_carried(None)

    def fill(self, meta: BatchMeta) -> None:
        """meta: what the pool's begin_step returned."""
        self.meta = meta
        if self.ints is None:
            self.positions = meta.positions
            self.page_bases = self.pool.page_bases()
            return
        self._fill_buffers(meta)

    def _fill_buffers(self, meta: BatchMeta) -> None:
        """The pool's own page ids (a device pool) go up with the rest, from the host; tables
        and write pages renumbered into a staging ring's buffers (before each layer's base) are
        on the device already, and the same tensors again mean the same pages (never modified
        in place): they are copied only when they change."""
        rows, block, qs, n = self.rows, self.block_rows, meta.query_starts, meta.n_rows
        pad = rows - n
        starts = [0]  # where each sequence's pages start in the flat tables
        for t in meta.used_pages:
            starts.append(starts[-1] + len(t))
        positions, row_tables, blocks = meta.row_positions, [], []
        for b in range(meta.n_seqs):
            lo, hi = qs[b], qs[b + 1]
            row_tables.extend(repeat(starts[b], hi - lo))
            for r in range(lo, hi, block):
                blocks += (starts[b], r, min(block, hi - r))
        before_pages = chain(positions, repeat(0, pad), positions, repeat(-1, pad), blocks,
                             repeat(0, 3 * rows - len(blocks)), row_tables, repeat(0, pad),
                             meta.sample_at, repeat(0, rows - len(meta.sample_at)),
                             self.pool.page_bases(), meta.row_offsets, repeat(0, pad))
        if meta.tables is None:
            ints_into(chain(before_pages, meta.row_pages, repeat(-1, pad),
                            chain.from_iterable(meta.used_pages)), self.ints)
            self._copied = None
        else:
            ints_into(before_pages, self.ints)
            copied = self._copied
            if copied is None or copied[0] is not meta.tables or copied[1] is not meta.writes:
                self.write_pages[:n].copy_(meta.writes)  # a host pool hands the same while
                self.write_pages[n:].fill_(-1)  # they hold
                self.tables[:starts[-1]].copy_(torch.cat(meta.tables))
                self._copied = (meta.tables, meta.writes)
        if self.carry_at is not None:
            self._fill_carried(self.pool.carried)

    def _fill_carried(self, carried) -> None:
        if carried is None:
            self.carry_at[0].fill_(-1)
            return
        rows, pages, offsets = carried
        t = rows.shape[2]
        self.carry_rows[:, :, :t].copy_(rows)
        self.carry_at[:, :t].copy_(torch.stack((pages, offsets)))
        if t < self.rows:
            self.carry_at[0, t:].fill_(-1)

    def place_rows(self) -> None:
        """A bucket step's write pages, and its carried rows', in each layer's place in the
        buffers: [layers, rows], the spare page for none."""
        if self.ints is None:
            return
        self.write_page = self._with_bases(self.write_pages)
        if self.carry_at is not None:
            self.carry_pages = self._with_bases(self.carry_at[0])

    def _with_bases(self, pages: torch.Tensor) -> torch.Tensor:
        return torch.where(pages >= 0, pages + self.bases[:, None], self.pool.spare_page())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """Layer `layer`'s new rows k, v [T, KVH, D] (RoPE applied) into its pages, after the
        rows a host pool's step carries, then its attention: q [T, H, D] -> [T, H, D], softmax
        scale head_dim ** -0.5."""
        pool = self.pool
        k_pages, v_pages = pool.layers[layer].buffers()
        k, v = k.to(k_pages.dtype), v.to(v_pages.dtype)  # the write-back's rows too
        self.new_rows[layer] = (k, v)
        meta = self.meta
        if self.ints is None:  # eager: the layer's pages from its base, the step's rows
            base = self.page_bases[layer]
            k_pages, v_pages = k_pages[base:], v_pages[base:]
            carried = pool.carried
            if carried is not None:
                carried = (carried[0][layer], *carried[1:])
            write_rows(k_pages, v_pages, k, v, meta.write_pages, meta.write_offsets, carried)
            return pool.attention(q, k_pages, v_pages, meta, pool.scale)
        carried = None
        if self.carry_pages is not None:
            carried = (self.carry_rows[layer], self.carry_pages[layer], self.carry_at[1])
        write_rows(k_pages, v_pages, k, v, self.write_page[layer], self.write_offset, carried,
                   self.kernels)  # captured: one launch writes them all
        if self.attention is not None:
            out = torch.empty_like(q)
            self.attention(q, k_pages, v_pages, self.tables, self.bases[layer:layer + 1],
                           self.blocks, self.attn_positions, out, pool.scale)
            return out
        # the bucket run eagerly: the pool's own attention over the real rows
        base, n = pool.page_bases()[layer], meta.n_rows
        out = torch.zeros_like(q)
        out[:n] = pool.attention(q[:n], k_pages[base:], v_pages[base:], meta, pool.scale)
        return out


def layer_groups(n: int, size: int) -> list[range]:
    """The layers of a step's pieces, `size` of n a piece (a ring slot's; the ring may change
    its slot size from step to step), or all of them in one (size 0: a pool without hooks)."""
    size = size or n
    return [range(a, min(a + size, n)) for a in range(0, n, size)]


class StepPass:
    """The stage's forward pass over a `PagedStep`, in pieces: piece j runs the layers of group j
    through `StageModel.run` (the first piece also the embedding and RoPE; on the last stage the
    last piece also the head into `logits`, and its argmax). An eager step runs the pieces;
    the step graphs capture them and replay. Either way `run` calls the pool's `enter` for a
    group's layers before its piece and `leave` after it."""

    def __init__(self, stage: StageModel, step: PagedStep, inputs: torch.Tensor | None = None,
                 logits: torch.Tensor | None = None):
        """inputs: a bucket's fixed input buffer (None: each eager step's own). logits: on the
        last stage, [rows, vocab] of the graphs' shared logits buffer."""
        self.stage, self.step, self.inputs, self.logits = stage, step, inputs, logits
        self.x: torch.Tensor | None = None  # the hidden rows between pieces
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.greedy: torch.Tensor | None = None  # [rows] the logits' argmax, on the last stage

    def pieces(self, groups: list[range]) -> list[Callable[[], None]]:
        return [self._piece(g, first=j == 0) for j, g in enumerate(groups)]

    def _piece(self, group: range, first: bool) -> Callable[[], None]:
        stage, step = self.stage, self.step
        last = group.stop == len(stage.layers)

        def piece() -> None:
            if first:
                step.place_rows()
                self.x, self.rope = stage.begin(self.inputs, step.positions)
            self.x = stage.run(self.x, self.rope, step, group)
            if last and self.logits is not None:  # `StageModel.logits` before .float()
                out = stage.head(self.x.index_select(0, step.head_rows))
                self.logits.copy_(out)
                self.greedy = out.argmax(dim=-1)  # the same index as in float32
        return piece

    def run(self, pieces: list[Callable[[], None]], groups: list[range], n: int) -> None:
        """The step's pieces with the pool's hooks around each; n: the step's real rows."""
        pool = self.step.pool
        if not pool.piece_layers:  # hooks that do nothing: one piece
            for piece in pieces:
                piece()
            return
        for piece, group in zip(pieces, groups, strict=True):
            for i in group:
                pool.layers[i].enter()
            piece()
            for i in group:
                k, v = self.step.new_rows[i]
                pool.layers[i].leave(*((k, v) if n == len(k) else (k[:n], v[:n])))


def run_eagerly(stage: StageModel, pool: Pool, meta: BatchMeta, inputs: torch.Tensor,
                step: PagedStep | None = None) -> torch.Tensor:
    """One eager step over `pool` (between its begin_step, which returned `meta`, and its
    end_step): the pieces a replay would run, uncaptured, with the pool's hooks."""
    step = step or PagedStep(pool)
    step.fill(meta)
    p = StepPass(stage, step, inputs)
    groups = layer_groups(len(pool.layers), pool.piece_layers)
    p.run(p.pieces(groups), groups, meta.n_rows)
    return p.x

