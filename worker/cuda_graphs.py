"""Decode steps replayed from CUDA graphs, in pieces around attention.

Eager PyTorch launches some fifty kernels a layer from Python; at decode sizes the GPU finishes
each one long before the host has issued the next, so a step costs host time, not device time
(about 12 ms for `synthetic:llama-1b` at batch 1 on an H200, against about 1 ms of kernels).
Outside attention a decode step has the same shapes every step for a given row count, so that
part is captured once per row-count bucket and replayed:

    piece 0:      embedding (or the incoming hidden rows), RoPE tables, layer 0 up to q, k, v
    piece i:      layer i-1 after its attention, layer i up to q, k, v      (0 < i < L)
    piece L:      layer L-1 after its attention

Attention runs eagerly between pieces, on the step's real rows: it reads page tables and context
lengths that change every step, and with host KV it waits on the staging ring's deliveries,
events that a captured graph cannot wait on. Each layer so costs two or three launches from the
host instead of fifty.

Rows are padded up to the bucket (a power of two); padded rows carry stale but finite inputs,
never reach attention and are dropped from the result. The pieces run the same modules as the
eager path (`Block.before_attention` / `after_attention`), so a device pool and a host pool, one
worker or several, exact mode or not, all see the same kernels for the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from .model import LayerKV, StageModel

log = logging.getLogger("siding.worker")

MAX_ROWS = 256  # decode steps with more rows run eagerly


class Bucket:
    """The static buffers and pieces of one padded row count."""

    def __init__(self, stage: StageModel, rows: int, device: torch.device, dtype: torch.dtype):
        a = stage.args
        if stage.embed is not None:
            self.inputs = torch.zeros(rows, dtype=torch.int64, device=device)
        else:
            self.inputs = torch.zeros(rows, a.dim, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.attn = torch.zeros(rows, a.n_heads, a.head_dim, dtype=dtype, device=device)
        self.x: torch.Tensor | None = None  # hidden rows between pieces
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.keep: list[Any] = []  # every piece's outputs: memory no later capture may reuse
        # each piece runs and returns the q, k, v it left for the next attention (the last: ())
        self.pieces: list[Callable[[], tuple[torch.Tensor, ...]]] = []
        layers = stage.layers
        n = len(layers)

        def first() -> tuple[torch.Tensor, ...]:
            self.x = stage.embed_inputs(self.inputs)
            self.rope = stage.rope(self.positions, dtype)
            return layers[0].before_attention(self.x, *self.rope)

        def after(i: int) -> Callable[[], tuple[torch.Tensor, ...]]:
            def piece() -> tuple[torch.Tensor, ...]:
                self.x = layers[i - 1].after_attention(self.x, self.attn)
                return layers[i].before_attention(self.x, *self.rope) if i < n else ()
            return piece

        self.fns = [first, *(after(i) for i in range(1, n + 1))]


class DecodeGraphs:
    """`StageModel.forward` for decode steps of up to MAX_ROWS rows, from captured pieces.

    capture False runs the same pieces eagerly over the same padded buffers: what the CPU tests
    exercise, and what a CUDA capture replays.
    """

    def __init__(self, stage: StageModel, device: torch.device | str, capture: bool = True):
        self.stage = stage
        self.device = torch.device(device)
        self.dtype = next(stage.parameters()).dtype
        self.capture = capture
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cuda device, not {self.device}")
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.buckets: dict[int, Bucket] = {}

    @staticmethod
    def bucket_rows(n: int) -> int | None:
        """The padded row count of a step of n rows, or None when it runs eagerly."""
        return 1 << (n - 1).bit_length() if 0 < n <= MAX_ROWS else None

    def prepare(self, max_rows: int) -> None:
        """Build every bucket a decode step of up to `max_rows` rows can use, now rather than on
        the first step that needs it."""
        top, rows = self.bucket_rows(min(max_rows, MAX_ROWS)), 1
        while rows <= top:
            if rows not in self.buckets:
                self._build(rows)
            rows *= 2

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, kvs: Sequence[LayerKV],
                meta: Any) -> torch.Tensor:
        """As `StageModel.forward`; the caller checks `bucket_rows` first."""
        n = positions.shape[0]
        b = self.buckets.get(self.bucket_rows(n)) or self._build(n)
        b.inputs[:n].copy_(inputs)
        b.positions[:n].copy_(positions)
        qkv = b.pieces[0]()
        for kv, piece in zip(kvs, b.pieces[1:], strict=True):
            q, k, v = qkv
            b.attn[:n].copy_(kv.attend(q[:n], k[:n], v[:n], meta))
            qkv = piece()
        return b.x[:n].clone()  # the next replay overwrites b.x

    def _build(self, n: int) -> Bucket:
        rows = self.bucket_rows(n)
        b = Bucket(self.stage, rows, self.device, self.dtype)
        if not self.capture:
            b.pieces = b.fns
        else:
            t0 = time.perf_counter()
            b.pieces = self._capture(b)
            log.info("captured decode graphs for %d rows (%d pieces) in %.2fs", rows,
                     len(b.pieces), time.perf_counter() - t0)
        self.buckets[rows] = b
        return b

    def _capture(self, b: Bucket) -> list[Callable[[], tuple[torch.Tensor, ...]]]:
        # Warm-up on a side stream, as torch.cuda.graphs asks: cuBLAS workspaces, Triton
        # compilation and the allocator's first blocks all happen outside the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for fn in b.fns:
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        pieces = []
        for fn in b.fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                qkv = fn()
            # a replay rewrites these tensors in place; the attributes fn set are not reset
            b.keep.append((b.x, qkv, b.rope))
            pieces.append(partial(_replay, g, qkv))
        return pieces


def _replay(graph: torch.cuda.CUDAGraph, outputs: tuple[torch.Tensor, ...]
            ) -> tuple[torch.Tensor, ...]:
    graph.replay()
    return outputs
