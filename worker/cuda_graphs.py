"""Steps of up to the step budget's rows (at most MAX_ROWS) replayed from CUDA graphs.

Eager PyTorch launches some fifty kernels a layer from Python; at these sizes the GPU finishes
each one long before the host has issued the next, so a step costs host time, not device time
(about 12 ms for `synthetic:llama-1b` on an H200, against about 1 ms of kernels). A step has the
same shapes every time for a given row count and context size, so it is captured once per (row
bucket, split bucket) and replayed, attention and the new rows' writes included. What is
captured is the stage's own forward pass over a `PagedStep` (worker/step.py's `StepPass`): the
same `StageModel.run` an eager step runs, in pieces cut where the pool's hooks run,

    piece j:  layers of group j (a ring slot's, or all of them): their new rows into their pages
              (after a host pool's carried rows, the last step's, which its slot was filled
              without), their attention, the rest of each layer; on the first piece before them
              the embedding (or the incoming hidden rows) and the RoPE tables, and on the last
              stage's last piece after them the head: the rows that sample gathered, the final
              norm, the logits (into one buffer all graphs share) and their argmax, the greedy
              tokens

(captured as one graph each). A step that only takes greedy tokens needs nothing after the
replay; one that draws replays a draw graph over the logits (`Head`, worker/draw_graphs.py).

A row is a decode row or one of a prompt chunk's: a sequence's rows are consecutive positions,
each attending to the keys up to its own (its rows are written before any row attends), in
blocks of a few positions of one sequence. So decode steps, prompt chunks and mixed steps alike
are replayed, up to `max_rows` rows in all: a short prompt after a cached prefix costs a replay,
not an eager step. Longer steps run eagerly. In exact mode a row's bits are the eager step's
whatever the step (the kernels are batch-invariant); in default mode a replayed prompt row is
attended by the split kernel where an eager step uses the flash kernel, so its bits may differ,
as those of any two batch shapes may.

What changes from step to step is data in the bucket step's fixed buffers (`PagedStep`),
written by one upload before the replay: positions, where each row is written, each row's
table, the attention blocks, the rows that sample, each layer's page base (the slot a staging
ring gives the layer this step; 0 for device pages) and the flat page tables (a host pool's,
renumbered into its ring and on the device already, copied when they change). Rows are padded
up to the bucket (a power of two up to ROW_STEP rows, then a multiple of it). The attention is
launched as the pool's attention launches it for the bucket (`PagedAttention.step_attention`):
over the bucket's keys (a power of two of 256-key splits), in default mode split as an eager
decode step of the same bucket; grid programs past a row's keys exit at once.

With device KV the pieces are one graph: a step is one replay. With host KV the pool's hooks run
between pieces: before a piece its layers wait for their slot to be delivered, after it the
slot's release is recorded and the next delivery issued, events a captured graph cannot wait on
across steps. A ring whose slots hold several layers (`piece_layers`) has a piece per slot:
fewer launches, each of which costs microseconds of host and device time, more while the link
is busy (docs/kv-pipelining.md). The ring chooses the slot size each step, so graphs are kept
per (row bucket, split bucket, slot size). A pool's buffers are captured by address: when a ring
reallocates its buffer, the graphs are captured again.

The pieces are the eager step's own (`step.run_eagerly`), and so are the kernels (the pool's
`PagedAttention`): a device pool and a host pool, one worker or several, exact mode or not, all
see the same kernels for the same step. `capture=False` runs a bucket's pieces uncaptured over
its buffers (the CPU tests), attention through the pool's eager attention.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from . import cuda_driver
from .batch import BatchMeta
from .draw_graphs import DrawGraphs
from .kernels import Scratch, splits_bucket
from .kv.pool import Pool
from .model import StageModel
from .step import PagedStep, StepPass, layer_groups

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


class BucketGraph:
    """The step, pass and pieces of one (row bucket, split bucket, layers a piece holds)."""

    def __init__(self, stage: StageModel, pool: Pool, rows: int, splits: int,
                 groups: list[range], device: torch.device, dtype: torch.dtype, capture: bool,
                 scratch: Scratch, logits: torch.Tensor | None = None):
        """groups: the layers of each piece. logits: on the last stage, [rows, vocab] of the
        graphs' shared logits buffer."""
        a = stage.args
        self.step = PagedStep(pool, rows, splits, (a.n_heads, a.n_kv_heads, a.head_dim), device,
                         capture, scratch)
        if stage.embed is not None:
            inputs = torch.zeros(rows, dtype=torch.int64, device=device)
        else:
            inputs = torch.zeros(rows, a.dim, dtype=dtype, device=device)
        self.step_pass = StepPass(stage, self.step, inputs, logits)
        self.groups = groups
        self.fns = self.step_pass.pieces(self.groups)
        self.pieces: list[Callable[[], None]] = []
        self.captured: list[torch.cuda.CUDAGraph] = []
        self.keep: list[Any] = []  # every piece's outputs: memory no later capture may reuse

    def release(self) -> None:
        """Free the captured graphs now: the pieces' closures make this object a reference
        cycle, which the garbage collector could otherwise free in the middle of a later capture
        (a graph destroyed during a capture breaks it)."""
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
        held = {type(m).__name__ for m in stage.modules() if not getattr(m, "capturable", True)}
        if capture and held:
            raise ValueError(f"CUDA graphs do not capture {', '.join(sorted(held))} layers, "
                             "which read on the host what a step routes where")
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
        g.step.fill(meta)
        p = g.step_pass
        p.inputs[:n].copy_(inputs)
        p.run(g.pieces, g.groups, n)
        if p.greedy is not None:
            s = len(meta.sample_at)
            self.head = Head(p.greedy[:s], p.logits[:s])
        else:
            self.head = None
        return p.x[:n].clone()  # the next replay overwrites p.x

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
        g = BucketGraph(self.stage, self.kv_pool, rows, splits,
                        layer_groups(len(self.kv_pool.layers), size), self.device, self.dtype,
                        self.capture, self.scratch,
                        None if self.logits is None else self.logits[:rows])
        if not self.capture:
            g.pieces = g.fns
        else:
            t0 = time.perf_counter()
            g.pieces = self._capture(g)
            log.info("captured step graphs for %d rows, %d splits (%d pieces) in %.2fs", rows,
                     splits, len(g.pieces), time.perf_counter() - t0)
        self.graphs[rows, splits, size] = g
        return g

    def _capture(self, g: BucketGraph) -> list[Callable[[], None]]:
        # Warm-up on a side stream, as torch.cuda.graphs asks: cuBLAS workspaces, Triton
        # compilation and the allocator's first blocks all happen outside the capture. The
        # buffers hold a step without rows, which writes only the spare page.
        g.step.clear()
        gc.collect()  # and no collection during the capture: see BucketGraph.release
        gc.disable()
        try:
            return self._capture_pieces(g)
        finally:
            gc.enable()

    def _capture_pieces(self, g: BucketGraph) -> list[Callable[[], None]]:
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for fn in g.fns:
                fn()
        stream.wait_stream(side)
        pieces = []
        p, step = g.step_pass, g.step
        for fn in g.fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory_pool,
                                  capture_error_mode="thread_local"):
                fn()
            # a replay rewrites these tensors in place; the attributes the pieces set are not
            # reset by it
            g.keep.append((p.x, p.rope, p.greedy, list(step.new_rows), step.write_page,
                           step.carry_pages))
            g.captured.append(graph)
            # launched through the driver, on the stream current now (the worker's only
            # compute stream): `replay` costs several microseconds more a piece, 17 a host step
            pieces.append(partial(cuda_driver.launch_graph, graph.raw_cuda_graph_exec(),
                                  stream.cuda_stream))
        return pieces
