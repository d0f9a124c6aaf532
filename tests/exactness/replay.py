"""Continuous batching replayed in-process, to compare a sequence's logits bit for bit.

Tokens are all a cluster shows, and on the CPU in float32 the default kernels' differences (a
few ulps) almost never flip one (docs/exact-mode.md), so tokens cannot tell exact mode from the
default there. Here the model's stages, KV pools and kernels run as a worker runs them, under a
small scheduler of their own, and every sampled row's logits are kept.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from worker.batch import build_meta
from worker.build import load_stage, make_pool
from worker.loaders import resolve
from worker.step import run_eagerly


class Stages:
    """A model cut at `cuts` (layer split), each stage with its own pool of `n_pages` pages."""

    def __init__(self, model: str, cuts: list[int], n_pages: int, page: int, exact: bool,
                 device: str, dtype: torch.dtype):
        source = resolve(model)
        bounds = [0, *cuts, source.args.n_layers]
        self.stages = [load_stage(source, dtype, device, layers=layers, exact=exact)
                       for layers in zip(bounds, bounds[1:])]
        self.pools = [make_pool(stage, n_pages, page, device, exact=exact)
                      for stage in self.stages]
        self.page, self.device = page, device

    @torch.inference_mode()
    def step(self, rows: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """rows: (token ids, first position, page table) per sequence -> logits of each last row."""
        meta = build_meta([s for _, s, _ in rows], [len(t) for t, _, _ in rows],
                          [table for _, _, table in rows], [True] * len(rows), self.page,
                          self.device)
        x = torch.tensor([t for ids, _, _ in rows for t in ids], device=self.device)
        for stage, pool in zip(self.stages, self.pools):
            x = run_eagerly(stage, pool, meta, x)
        return self.stages[-1].logits(x[meta.sample_rows])

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy pages to other physical pages, as parking and restoring does."""
        for pool in self.pools:
            pool.k[:, dst] = pool.k[:, src]
            pool.v[:, dst] = pool.v[:, src]


@dataclass
class Seq:
    prompt: list[int]
    max_tokens: int
    arrival: int  # step at which it is admitted
    done: int = 0  # positions whose K/V the pools hold
    table: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


def replay(stages: Stages, seqs: list[Seq], chunk: int, move_every: int = 0,
           recompute_every: int = 0, seed: int = 0) -> list[list[torch.Tensor]]:
    """Greedy decode of every sequence; returns each one's logits per generated token.

    Each step: one row per sequence past its prompt, plus up to `chunk` prompt (or recompute)
    rows of the others, oldest first. Every `move_every` steps all pages move; every
    `recompute_every` steps the oldest decoding sequence loses its pages and recomputes them.
    """
    free = list(range(stages.pools[0].n_pages))
    random.Random(seed).shuffle(free)
    step = 0
    while any(len(s.generated) < s.max_tokens for s in seqs):
        assert step < 10_000, "the replay stopped making progress"
        live = [s for s in seqs if s.arrival <= step and len(s.generated) < s.max_tokens]
        if move_every and step % move_every == move_every - 1:
            for s in live:
                new = [free.pop() for _ in s.table]
                stages.move(s.table, new)
                free[:0], s.table = s.table, new
        decoding = [s for s in live if s.done == len(s.tokens) - 1]
        if recompute_every and step % recompute_every == recompute_every - 1 and decoding:
            victim = decoding[0]
            free[:0], victim.table, victim.done = victim.table, [], 0
        rows, owners, budget = [], [], chunk
        for s in live:
            n = len(s.tokens) - s.done
            if n > 1:  # prompt or recompute rows take the step's budget; a decode row does not
                n = min(n, budget)
                budget -= n
            if n == 0:
                continue
            while len(s.table) * stages.page < s.done + n:
                s.table.append(free.pop())
            rows.append((s.tokens[s.done : s.done + n], s.done, s.table))
            owners.append(s)
        if rows:
            logits = stages.step(rows)
            for s, (ids, start, _), row in zip(owners, rows, logits):
                s.done = start + len(ids)
                if s.done == len(s.tokens):  # the row that samples the next token
                    s.logits.append(row)
                    s.generated.append(int(row.argmax()))
        for s in seqs:
            if len(s.generated) == s.max_tokens and s.table:
                free[:0], s.table = s.table, []
        step += 1
    return [s.logits for s in seqs]
