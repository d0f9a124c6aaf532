"""Steps of up to the step budget's rows (at most MAX_ROWS) replayed from CUDA graphs.

Eager PyTorch launches some fifty kernels a layer from Python; at these sizes the GPU finishes
each one long before the host has issued the next, so a step costs host time, not device time
(about 12 ms for `synthetic:llama-1b` on an H200, against about 1 ms of kernels). A step has the
same shapes every time for a given row count and context size, so it is captured once per (row
bucket, split bucket) and replayed, attention and the new rows' writes included:

    piece 0:      embedding (or the incoming hidden rows), RoPE tables, layer 0 up to q, k, v
    piece l + 1:  layer l's new rows into its pages (after a host pool's carried rows, the last
                  step's, which its slot was filled without), its attention, the rest of layer l,
                  layer l + 1 up to q, k, v                              (0 <= l < L)
                  and on the last stage's last piece the head: the rows that sample gathered,
                  the final norm, the logits (into one buffer all graphs share) and their
                  argmax, the greedy tokens

(captured as one graph each, or several layers' pieces to a graph: below). A step that only
takes greedy tokens needs nothing after the replay; one that draws replays a draw graph over
the logits (`Head`, worker/draw_graphs.py).

A row is a decode row or one of a prompt chunk's: a sequence's rows are consecutive positions,
each attending to the keys up to its own (its rows are written before any row attends), in
blocks of a few positions of one sequence. So decode steps, prompt chunks and mixed steps alike
are replayed, up to `max_rows` rows in all: a short prompt after a cached prefix costs a replay,
not an eager step. Longer steps run eagerly. In exact mode a row's bits are the eager step's
whatever the step (the kernels are batch-invariant); in default mode a replayed prompt row is
attended by the split kernel where an eager step uses the flash kernel, so its bits may differ,
as those of any two batch shapes may.

What changes from step to step is data in one fixed buffer (`StepBuffers`), written by one
upload before the replay: positions, each row's table, the attention blocks, the rows that
sample, each layer's page base (the slot a staging ring gives the layer this step; 0 for device
pages) and the flat page tables (a host pool's, renumbered into its ring and on the device
already, copied when they change). Rows are padded up to the bucket (a power of two up to
ROW_STEP rows, then a multiple of it); a padding row writes its K and V into the pool's spare
page, attends to nothing and is dropped. The attention is launched as the pool's attention
launches it for the bucket (`PagedAttention.step_attention`): over the bucket's keys (a power of
two of 256-key splits), in default mode split as an eager decode step of the same bucket; grid
programs past a row's keys exit at once.

With device KV the pieces are one graph: a step is one replay. With host KV the pool's hooks run
between pieces: before layer l's piece waits for its slot to be delivered, after it records
the slot's release and issues the next delivery, events a captured graph cannot wait on across
steps. A ring whose slots hold several layers (`piece_layers`) has a piece per slot's layers,
the hooks run for each of them around it: fewer launches, each of which costs microseconds of
host and device time, more while the link is busy (docs/kv-pipelining.md). The ring chooses the
slot size each step, so graphs are kept per (row bucket, split bucket, slot size). A pool's
buffers are captured by address: when a ring reallocates its buffer, the graphs are captured
again.

The pieces run the same modules as the eager path (`Block.before_attention` /
`after_attention`) and the same attention kernel (the pool's `PagedAttention`), so a device pool
and a host pool, one worker or several, exact mode or not, all see the same kernels for the same
step. `capture=False` runs the pieces eagerly over the same buffers (the CPU tests), attention
through the pool's eager attention and the rows written as an eager step writes them.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from itertools import chain, repeat
from typing import Any

import torch

from . import cuda_driver
from .batch import BatchMeta, ints_into
from .draw_graphs import DrawGraphs
from .kernels import ATTENTION_SPLIT, Scratch, splits_bucket
from .kv.pool import Pool
from .kv.rows import write_rows
from .model import StageModel

log = logging.getLogger("siding.worker")

DEFAULT_ROWS = 512  # the graphs' rows when no step budget is given: launch's default budget
PREPARED_ROWS = 512  # row buckets captured at load; larger ones (a larger budget) on first use
MAX_ROWS = 1024  # at most: steps of more rows run eagerly, their launches a small share of them
# Row buckets: powers of two up to ROW_STEP, then its multiples. A step's matmuls are bound by
# compute past a few hundred rows, so padding costs in proportion there: a step of 128 decode
# rows and a 256-row prompt pads to 384, not 512.
ROW_STEP = 64
PREPARED_SPLITS = 8  # graphs built at load: contexts up to 8 splits (2048 keys)


@dataclass(frozen=True)
class Head:
    """What a replay of the last stage computed past its last layer, for the step's rows that
    sample (`BatchMeta.sample_at`), in their order; valid until the next replay."""

    greedy: torch.Tensor  # [n] int64: the argmax of each sampled row's logits
    logits: torch.Tensor  # [n, vocab] in the model's dtype (`StageModel.logits` before .float())


class StepBuffers:
    """A step of up to `rows` rows, in fixed buffers that the captured kernels read."""

    def __init__(self, rows: int, splits: int, stage: StageModel, pool: Pool,
                 device: torch.device, capture: bool, scratch: Scratch):
        """scratch: the attention's partial results, shared by every graph of the worker."""
        a = stage.args
        self.rows, self.pool = rows, pool
        n_layers = len(pool.layers)
        # positions [rows] | attention positions [rows], -1 past the batch | blocks [rows, 3]
        # (no more blocks than rows) | where each row's table starts [rows] | the rows that
        # sample [rows] | page bases [layers] | the flat page tables (no more sequences than
        # rows): one buffer, so one upload a step
        self.pages_per_row = -(-splits * ATTENTION_SPLIT // pool.page_size)
        self.ints = torch.zeros(7 * rows + n_layers + rows * self.pages_per_row,
                                dtype=torch.int64, device=device)
        (self.positions, self.attn_positions, blocks, self.row_tables, self.head_rows,
         self.bases, self.tables) = self.ints.split(
            [rows, rows, 3 * rows, rows, rows, n_layers, rows * self.pages_per_row])
        self.blocks = blocks.view(rows, 3)
        # captured: the Triton kernels, launched over these buffers; else the pool's eager paths
        self.kernels = pool.attention.kernels if capture else None
        self.attention = None  # what the captured kernels attend with
        self.block_rows = 1  # positions of one sequence an attention block holds
        if self.kernels is not None:
            self.attention = pool.attention.step_attention(
                rows, splits * ATTENTION_SPLIT, a.n_heads, a.n_kv_heads, a.head_dim, scratch)
            self.block_rows = self.attention.block_rows
        self.meta: BatchMeta | None = None  # the step's (for eager pieces' attention)
        self._tables: list[torch.Tensor] | None = None  # the tables `self.tables` holds
        self.write_page = self.write_offset = None  # [layers, rows] and [rows], set by piece 0
        # the carried rows, their pages (-1: none) and offsets, and their pages with each
        # layer's base [layers, rows] (set by piece 0); only for a pool that carries
        self.carry_rows = self.carry_at = self.carry_pages = None
        if pool.carries:
            kvh, d = pool.k.shape[-2:]
            self.carry_rows = torch.zeros(n_layers, 2, rows, kvh, d, dtype=pool.k.dtype,
                                          device=device)
            self.carry_at = torch.zeros(2, rows, dtype=torch.int64, device=device)
        self.clear()

    def clear(self) -> None:
        """A step with no rows: what a capture runs, writing only the spare page."""
        self.ints.zero_()
        self.attn_positions.fill_(-1)
        self._tables = None
        if self.carry_at is not None:
            self._fill_carried(None)

    def fill(self, meta: BatchMeta) -> None:
        """meta: what the pool's begin_step returned. The pool's own page ids (a device pool)
        go up with the rest, from the host; tables renumbered into a staging ring's buffers
        (before each layer's base) are on the device already, and the same list again means the
        same tables (never modified in place): they are copied only when it changes."""
        rows, block, qs = self.rows, self.block_rows, meta.query_starts
        pad = rows - meta.n_rows
        starts = [0]  # where each sequence's pages start in the flat tables
        for t in meta.used_pages:
            starts.append(starts[-1] + len(t))
        positions, row_tables, blocks = meta.row_positions, [], []
        for b in range(meta.n_seqs):
            lo, hi = qs[b], qs[b + 1]
            row_tables.extend(repeat(starts[b], hi - lo))
            for r in range(lo, hi, block):
                blocks += (starts[b], r, min(block, hi - r))
        before_tables = chain(positions, repeat(0, pad), positions, repeat(-1, pad), blocks,
                              repeat(0, 3 * rows - len(blocks)), row_tables, repeat(0, pad),
                              meta.sample_at, repeat(0, rows - len(meta.sample_at)),
                              self.pool.page_bases())
        if meta.tables is None:
            ints_into(chain(before_tables, chain.from_iterable(meta.used_pages)), self.ints)
            self._tables = None
        else:
            ints_into(before_tables, self.ints)
            if meta.tables is not self._tables:  # a host pool hands the same while they hold
                self.tables[:starts[-1]].copy_(torch.cat(meta.tables))
                self._tables = meta.tables
        if self.carry_at is not None:
            self._fill_carried(self.pool.carried)
        self.meta = meta

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

    def locate_rows(self) -> None:
        """Each row's page (with each layer's base: [layers, rows]) and offset, and the same for
        the carried rows."""
        # not meta's write_pages: a replay computes them on the device, from the fixed buffers
        page = self.pool.page_size
        pos = self.attn_positions.clamp(min=0)
        pages = torch.where(self.attn_positions >= 0,
                            self.tables[self.row_tables + pos // page], -1)
        self.write_page = self._with_bases(pages)
        self.write_offset = pos % page
        if self.carry_at is not None:
            self.carry_pages = self._with_bases(self.carry_at[0])

    def _with_bases(self, pages: torch.Tensor) -> torch.Tensor:
        """pages [rows] (-1: none) -> [layers, rows], each layer's base added, none on the spare
        page."""
        return torch.where(pages >= 0, pages + self.bases[:, None], self.pool.spare_page())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """Layer `layer`'s new rows into its pages (after the carried rows), then its
        attention: [rows, H, D]."""
        pool = self.pool
        k_pages, v_pages = pool.layers[layer].buffers()
        carried = None
        if self.carry_pages is not None:
            carried = (self.carry_rows[layer], self.carry_pages[layer], self.carry_at[1])
        # captured (self.kernels), one launch writes them all
        write_rows(k_pages, v_pages, k, v, self.write_page[layer], self.write_offset, carried,
                   self.kernels)
        base = self.bases[layer:layer + 1]
        if self.kernels is not None:
            out = torch.empty_like(q)
            self.attention(q, k_pages, v_pages, self.tables, base, self.blocks,
                           self.attn_positions, out, pool.scale)
            return out
        # eager pieces: the pool's own attention over the real rows, through the same bases
        meta, n = self.meta, self.meta.n_rows
        offset = pool.page_bases()[layer]
        shifted = replace(meta, tables=[t + offset for t in meta.page_tables])
        out = torch.zeros_like(q)
        out[:n] = pool.attention(q[:n], k_pages, v_pages, shifted, pool.scale)
        return out


class BucketGraph:
    """The buffers and pieces of one (row bucket, split bucket)."""

    def __init__(self, stage: StageModel, pool: Pool, rows: int, splits: int,
                 device: torch.device, dtype: torch.dtype, capture: bool, scratch: Scratch,
                 logits: torch.Tensor | None = None):
        """logits: on the last stage, [rows, vocab] of the graphs' shared logits buffer."""
        a = stage.args
        self.buffers = b = StepBuffers(rows, splits, stage, pool, device, capture, scratch)
        if stage.embed is not None:
            self.inputs = torch.zeros(rows, dtype=torch.int64, device=device)
        else:
            self.inputs = torch.zeros(rows, a.dim, dtype=dtype, device=device)
        self.x: torch.Tensor | None = None  # hidden rows between pieces
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.qkv: list[tuple[torch.Tensor, ...]] = []  # each layer's q, k, v
        self.logits = logits
        self.greedy: torch.Tensor | None = None  # [rows] the logits' argmax, on the last stage
        self.keep: list[Any] = []  # every piece's outputs: memory no later capture may reuse
        self.pieces: list[Callable[[], None]] = []
        self.captured: list[torch.cuda.CUDAGraph] = []
        layers = stage.layers
        n = len(layers)

        def first() -> None:
            b.locate_rows()
            self.x = stage.embed_inputs(self.inputs)
            self.rope = stage.rope(b.positions, dtype)
            self.qkv = [layers[0].before_attention(self.x, *self.rope)]

        def layer(i: int) -> Callable[[], None]:
            def piece() -> None:
                attn = b.attend(i, *self.qkv[i])
                self.x = layers[i].after_attention(self.x, attn)
                if i + 1 < n:
                    self.qkv.append(layers[i + 1].before_attention(self.x, *self.rope))
                elif logits is not None:  # the head, as `StageModel.logits` before .float()
                    out = stage.output(stage.norm(self.x.index_select(0, b.head_rows)))
                    logits.copy_(out)
                    self.greedy = out.argmax(dim=-1)  # the same index as in float32
            return piece

        self.fns = [first, *(layer(i) for i in range(n))]

    def run(self) -> None:
        """The whole step: what one graph holds when the pool needs no hooks."""
        for fn in self.fns:
            fn()

    def pieces_of(self, size: int) -> list[Callable[[], None]]:
        """Piece 0's function, then one running `size` layers' each."""
        fns = self.fns

        def joined(group: list[Callable[[], None]]) -> Callable[[], None]:
            if len(group) == 1:
                return group[0]

            def piece() -> None:
                for fn in group:
                    fn()
            return piece
        return [fns[0], *(joined(fns[1 + a:1 + a + size]) for a in range(0, len(fns) - 1, size))]

    def release(self) -> None:
        """Free the captured graphs now: the closures above make this object a reference cycle,
        which the garbage collector could otherwise free in the middle of a later capture (a
        graph destroyed during a capture breaks it)."""
        for graph in self.captured:
            graph.reset()
        self.captured, self.pieces, self.fns, self.keep = [], [], [], []


class StepGraphs:
    """`StageModel.forward` for steps of up to `max_rows` rows over one pool (the step budget,
    at most MAX_ROWS), from captured graphs.

    capture False runs the same pieces eagerly over the same buffers: what the CPU tests
    exercise, and what a CUDA capture replays.
    """

    def __init__(self, stage: StageModel, pool: Pool, device: torch.device | str,
                 capture: bool = True, max_rows: int = DEFAULT_ROWS):
        self.stage = stage
        self.max_rows = min(max_rows, MAX_ROWS)
        self.kv_pool = pool
        self.device = torch.device(device)
        self.dtype = next(stage.parameters()).dtype
        self.capture = capture
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cuda device, not {self.device}")
        head_dim = stage.args.head_dim
        if capture and pool.attention.kernels is None:
            raise ValueError("CUDA graphs capture the Triton paged attention, which needs "
                             f"Triton and a power-of-two head size (not {head_dim})")
        # the captured graphs' memory
        self.memory_pool = torch.cuda.graph_pool_handle() if capture else None
        # (rows, splits, layers a piece holds: 0 for one graph a step) -> graph
        self.graphs: dict[tuple[int, int, int], BucketGraph] = {}
        # On the last stage the graphs end with the head: each replay's logits land here (one
        # buffer for every graph, outside their memory pool), its greedy tokens in the graph's
        self.logits = None
        if stage.output is not None:
            self.logits = torch.empty(self.bucket_rows(self.max_rows),
                                      stage.output.weight.shape[0], dtype=self.dtype,
                                      device=self.device)
        self.head: Head | None = None  # the last replay's, for its n rows
        self.scratch = Scratch(self.device)  # every graph's attention's partial results
        # the draws of a replay's sampled rows, over its logits (worker/draw_graphs.py)
        self.draws = None if self.logits is None else DrawGraphs(self.logits, capture)
        self._key: Any = None  # the pool's graph_key the graphs were captured against

    @property
    def buckets(self) -> set[int]:
        """The row buckets built so far."""
        return {rows for rows, _, _ in self.graphs}

    def bucket_rows(self, n: int) -> int | None:
        """The padded row count of a step of n rows (decode rows and prompt rows together), or
        None when it runs eagerly."""
        if not 0 < n <= self.max_rows:
            return None
        return 1 << (n - 1).bit_length() if n <= ROW_STEP else -(-n // ROW_STEP) * ROW_STEP

    def prepare(self, max_rows: int = PREPARED_ROWS) -> None:
        """Build what a step of up to `max_rows` rows and PREPARED_SPLITS splits can use, now
        rather than on the first step that needs it. A pool without buffers yet (a host pool's
        ring) is captured on its first step."""
        if not self._current():
            return
        top, size = min(max_rows, self.max_rows), self._piece_layers()
        # the largest first: the attention scratch all of them share is allocated once
        for rows in sorted({self.bucket_rows(n) for n in range(1, top + 1)}, reverse=True):
            splits = PREPARED_SPLITS
            while splits:
                if (rows, splits, size) not in self.graphs:
                    self._build(rows, splits, size)
                splits //= 2

    def forward(self, inputs: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        """As `StageModel.forward` over the pool's layers, between its begin_step and end_step;
        meta: what begin_step returned. The caller checks `bucket_rows` first."""
        n = meta.n_rows
        self._current()
        size = self._piece_layers()  # a ring's slot size may change from step to step
        key = (self.bucket_rows(n), splits_bucket(max(meta.context_lens)), size)
        g = self.graphs.get(key) or self._build(*key)
        g.buffers.fill(meta)
        g.inputs[:n].copy_(inputs)
        if not size:
            for piece in g.pieces:
                piece()
        else:
            g.pieces[0]()
            layers = self.kv_pool.layers
            for j, piece in enumerate(g.pieces[1:]):
                group = range(j * size, min((j + 1) * size, len(layers)))
                for i in group:
                    layers[i].enter()
                piece()
                for i in group:
                    _, k, v = g.qkv[i]
                    layers[i].leave(*((k, v) if n == len(k) else (k[:n], v[:n])))
        if g.greedy is not None:
            s = len(meta.sample_at)
            self.head = Head(g.greedy[:s], g.logits[:s])
        else:
            self.head = None
        return g.x[:n].clone()  # the next replay overwrites g.x

    def _current(self) -> bool:
        """Drop graphs captured against buffers the pool has since replaced."""
        key = self.kv_pool.graph_key()
        if key != self._key:
            for g in self.graphs.values():
                g.release()
            self.graphs.clear()
            if self.capture:  # the released graphs' memory pool may not be captured into again
                self.memory_pool = torch.cuda.graph_pool_handle()
            self._key = key
        return key is not None

    def _piece_layers(self) -> int:
        """Layers a piece holds this step; 0: the step is one graph (a pool without hooks)."""
        return self.kv_pool.piece_layers

    def _build(self, rows: int, splits: int, size: int) -> BucketGraph:
        g = BucketGraph(self.stage, self.kv_pool, rows, splits, self.device, self.dtype,
                        self.capture, self.scratch,
                        None if self.logits is None else self.logits[:rows])
        if not self.capture:
            g.pieces = g.pieces_of(size) if size else g.fns
        else:
            t0 = time.perf_counter()
            g.pieces = self._capture(g, size)
            log.info("captured step graphs for %d rows, %d splits (%d pieces) in %.2fs", rows,
                     splits, len(g.pieces), time.perf_counter() - t0)
        self.graphs[rows, splits, size] = g
        return g

    def _capture(self, g: BucketGraph, size: int) -> list[Callable[[], None]]:
        # Warm-up on a side stream, as torch.cuda.graphs asks: cuBLAS workspaces, Triton
        # compilation and the allocator's first blocks all happen outside the capture. The
        # buffers hold a step without rows, which writes only the spare page.
        g.buffers.clear()
        gc.collect()  # and no collection during the capture: see BucketGraph.release
        gc.disable()
        try:
            return self._capture_pieces(g, size)
        finally:
            gc.enable()

    def _capture_pieces(self, g: BucketGraph, size: int) -> list[Callable[[], None]]:
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for fn in g.fns:
                fn()
        stream.wait_stream(side)
        fns = g.pieces_of(size) if size else [g.run]
        pieces = []
        for fn in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory_pool,
                                  capture_error_mode="thread_local"):
                fn()
            # a replay rewrites these tensors in place; the attributes the pieces set are not
            # reset by it
            g.keep.append((g.x, g.rope, list(g.qkv), g.greedy, g.buffers.write_page,
                           g.buffers.write_offset, g.buffers.carry_pages))
            g.captured.append(graph)
            # launched through the driver, on the stream current now (the worker's only
            # compute stream): `replay` costs several microseconds more a piece, 17 a host step
            pieces.append(partial(cuda_driver.launch_graph, graph.raw_cuda_graph_exec(),
                                  stream.cuda_stream))
        return pieces

