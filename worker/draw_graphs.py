"""The draws of a replayed step's sampled rows, from captured graphs.

A replayed step leaves its sampled rows' logits in the step graphs' shared logits buffer and
their argmax in its graph (`cuda_graphs.Head`): a greedy step needs nothing more. Where some of
those rows draw (a temperature, top-k, top-p), the eager `sampler.sample_tokens` launches some
thirty kernels from Python, several tens of microseconds of host time each step. Here one
upload fills a graph's fixed inputs (which rows draw, their keys and parameters), one replay
draws them (`sampler.draw`, the function the eager path runs, over the same rows padded to the
graph's), and one launch puts the draws among the greedy tokens. A row's token depends on that
row's inputs alone, so an eager step and a replayed one draw alike.

Graphs are kept per (rows that draw, padded to a power of two; the largest top-k, padded to a
power of two, or 0; whether any row cuts by top-p): `sampler.draw`'s shapes and branches, each
captured on first use. Their memory is one pool: they never run at once, and each keeps only
its output alive. More than MAX_DRAW_ROWS drawing rows are drawn eagerly: a graph holds its
[rows, vocab] intermediates for good, and past a few dozen rows the launches are a small share
of the work.
"""

from __future__ import annotations

import torch

from protocol.sampling import SamplingParams

from .batch import ints_into
from .sampler import KEEP_ALL, Draws, draw, float_bits, sample_tokens

MAX_DRAW_ROWS = 64
_ONE_BITS, _ALL_BITS = float_bits([1.0, KEEP_ALL])  # what padding rows draw with


class DrawGraph:
    """`sampler.draw` over up to `rows` rows of the shared logits, from fixed buffers."""

    def __init__(self, logits: torch.Tensor, rows: int, k_max: int, top_p: bool,
                 capture: bool, pool):
        self.rows, self.logits, self.k_max, self.top_p = rows, logits, k_max, top_p
        # which sampled rows draw | keys | top-k | temperature, top-p (float64 bits): one upload
        self.ints = torch.zeros(5 * rows, dtype=torch.int64, device=logits.device)
        self.at, self.keys, self.top_ks, self.temperatures, self.top_ps = self.ints.split(rows)
        self.out: torch.Tensor | None = None  # [rows] the draws
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            self.clear()
            stream, side = torch.cuda.current_stream(), torch.cuda.Stream(logits.device)
            side.wait_stream(stream)
            with torch.cuda.stream(side):  # warm-up: the allocator's and the kernels' first use
                self.run()
            stream.wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.run()

    def clear(self) -> None:
        """Every row a padding row."""
        self._fill(Draws([], [], [], [], []))

    def _fill(self, d: Draws) -> None:
        """d's rows, then padding rows: row 0 drawn at temperature 1, nothing cut."""
        pad = self.rows - len(d.rows)
        ints_into([*d.rows, *[0] * pad, *d.keys, *[0] * pad, *d.top_ks, *[0] * pad,
                   *d.temperatures, *[_ONE_BITS] * pad, *d.top_ps, *[_ALL_BITS] * pad],
                  self.ints)

    def run(self) -> None:
        self.out = draw(self.logits.index_select(0, self.at), self.keys, self.top_ks,
                        self.temperatures, self.top_ps, self.k_max, self.top_p)

    def __call__(self, d: Draws) -> torch.Tensor:
        self._fill(d)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()
        return self.out


class DrawGraphs:
    """The draws of the rows a replay sampled, through `DrawGraph`s over `logits`, the step
    graphs' shared [rows, vocab] buffer. capture False runs the same functions eagerly over the
    same buffers (the CPU tests)."""

    def __init__(self, logits: torch.Tensor, capture: bool):
        self.logits, self.capture = logits, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[int, int, bool], DrawGraph] = {}

    def tokens(self, greedy: torch.Tensor, params: list[SamplingParams], positions: list[int]
               ) -> torch.Tensor:
        """`sampler.sample_tokens` of a replay's sampled rows, the first len(params) rows of
        the logits, whose argmax is `greedy`: [N] int64 on the device."""
        vocab = self.logits.shape[1]
        d = Draws.of(params, positions, vocab)
        n = len(d.rows)
        if n > MAX_DRAW_ROWS:
            return sample_tokens(self.logits[:len(params)], params, positions, greedy)
        tokens = greedy.clone()
        if n:
            key = (_pow2(n), min(_pow2(d.k_max), vocab) if d.k_max else 0, d.top_p)
            g = self.graphs.get(key)
            if g is None:
                g = self.graphs[key] = DrawGraph(self.logits, *key, self.capture, self.pool)
            tokens.index_copy_(0, g.at[:n], g(d)[:n])
        return tokens


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
