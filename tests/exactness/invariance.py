"""Kernel checks shared by the CPU tests (tests/unit) and the CUDA ones (tests/gpu).

Each returns the cases that broke its one intent, so a test reads `assert check(...) == []`:
a row computed alone has the same bits as the same row inside any launch.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker.batch import build_meta
from worker.build import load_stage, make_pool
from worker.step import run_eagerly

ROW_COUNTS = [*range(1, 71), 97, 128, 255, 333, 512]


def counts_where_row_differs(fn: Callable, x: torch.Tensor,
                             counts: list[int] = ROW_COUNTS) -> list[int]:
    """Row counts M at which row 0 of fn(x[:M]) differs from fn(x[:1])."""
    alone = fn(x[:1])
    return [m for m in counts if m <= len(x) and not torch.equal(fn(x[:m])[:1], alone)]


def positions_where_row_differs(fn: Callable, x: torch.Tensor, m: int) -> list[int]:
    """Positions p at which x[0], placed at row p of a launch of m other rows, changes bits."""
    alone = fn(x[:1])
    bad = []
    for p in sorted({*range(0, m, max(1, m // 8)), m - 1}):
        batch = x[1 : m + 1].clone()
        batch[p] = x[0]
        if not torch.equal(fn(batch)[p : p + 1], alone):
            bad.append(p)
    return bad


class PagedSequences:
    """Sequences' q, k, v written into a KV pool at a random page placement (`seed`)."""

    def __init__(self, lens: list[int], heads: int, kv_heads: int, head_dim: int, page: int,
                 seed: int, dtype: torch.dtype, device: str):
        g = torch.Generator().manual_seed(1234)  # contents: the same for every placement

        def draw(*shape):
            return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

        self.q = [draw(n, heads, head_dim) for n in lens]
        kv = [(draw(n, kv_heads, head_dim), draw(n, kv_heads, head_dim)) for n in lens]
        n_pages = sum(-(-n // page) for n in lens) + 7
        free = list(range(n_pages))
        random.Random(seed).shuffle(free)
        self.page = page
        self.k_pool = torch.zeros(n_pages, page, kv_heads, head_dim, dtype=dtype, device=device)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.tables = []
        for (k, v), n in zip(kv, lens):
            table = [free.pop() for _ in range(-(-n // page))]
            self.tables.append(table)
            for p in range(n):
                self.k_pool[table[p // page], p % page] = k[p]
                self.v_pool[table[p // page], p % page] = v[p]

    def attend(self, attn: Callable, rows: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """One launch over rows [(sequence, first position, count)]; outputs per entry."""
        meta = build_meta([s for _, s, _ in rows], [n for _, _, n in rows],
                          [self.tables[i] for i, _, _ in rows], [True] * len(rows), self.page,
                          self.k_pool.device)
        q = torch.cat([self.q[i][s : s + n] for i, s, n in rows])
        out = attn(q, self.k_pool, self.v_pool, meta, self.q[0].shape[-1] ** -0.5)
        return [out[meta.query_starts[b] : meta.query_starts[b + 1]] for b in range(len(rows))]

    def dense(self, seq: int, start: int, n: int) -> torch.Tensor:
        """Rows start .. start + n - 1 of sequence `seq` attended in float32 over its pages
        gathered, by PyTorch: the reference an attention kernel is held to."""
        end = start + n
        k, v = (p[self.tables[seq]].flatten(0, 1)[:end].float()
                for p in (self.k_pool, self.v_pool))
        dev = self.k_pool.device
        mask = (torch.arange(end, device=dev)[None, :]
                <= torch.arange(start, end, device=dev)[:, None])
        return F.scaled_dot_product_attention(
            self.q[seq][start:end].float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, enable_gqa=True).transpose(0, 1)

    def alone(self, attn: Callable, seq: int, positions: range) -> torch.Tensor:
        """Each position of `seq` as a decode step of its own."""
        return torch.cat([self.attend(attn, [(seq, p, 1)])[0] for p in positions])


def chunks_that_differ_from_rows(attn: Callable, seqs: PagedSequences, seq: int,
                                 chunks: list[range]) -> list[range]:
    """Prompt chunks whose rows differ from the same positions attended one at a time."""
    return [c for c in chunks
            if not torch.equal(seqs.attend(attn, [(seq, c.start, len(c))])[0],
                               seqs.alone(attn, seq, c))]


def split_chunks(split: int, length: int) -> list[range]:
    """Chunks of several sizes, straddling split boundaries, inside [0, length)."""
    chunks = [range(0, min(40, length)), range(split - 20, split + 20), range(split - 1, split + 2),
              range(2 * split - 3, 2 * split + 33), range(length - 7, length)]
    return [c for c in chunks if 0 <= c.start and c.stop <= length]


def prompt_runs(exact: bool, chunkings: list[list[int]], device: str, dtype: torch.dtype,
                model: str = "synthetic:tiny", length: int = 40
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A `length`-token prompt prefilled in one chunk, then in each chunking: the hidden states
    and the K and V of its pages (every layer) each left."""
    stage = load_stage(model, dtype, device, exact=exact)
    tokens = torch.randint(0, stage.args.vocab_size, (length,),
                           generator=torch.Generator().manual_seed(0))
    n_pages = -(-length // 16)
    tokens = tokens.to(device)

    def run(chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool = make_pool(stage, n_pages + 5, 16, device, exact=exact)
        out, start, table = [], 0, [5, 2, 7, *range(8, n_pages + 5)][:n_pages]
        with torch.inference_mode():
            for n in chunks:
                meta = build_meta([start], [n], [table], [True], pool.page_size, device)
                out.append(run_eagerly(stage, pool, meta, tokens[start : start + n]))
                start += n
        return torch.cat(out), pool.k[:, table].clone(), pool.v[:, table].clone()

    return [run(c) for c in [[length], *chunkings]]


def prompt_bits(exact: bool, chunkings: list[list[int]], device: str,
                dtype: torch.dtype, model: str = "synthetic:tiny", length: int = 40) -> list[bool]:
    """For each chunking of a `length`-token prompt: are its hidden states the one-chunk ones?"""
    (whole, _, _), *runs = prompt_runs(exact, chunkings, device, dtype, model, length)
    return [torch.equal(whole, hidden) for hidden, _, _ in runs]


def prompt_kv_bits(exact: bool, chunkings: list[list[int]], device: str,
                   dtype: torch.dtype, model: str = "synthetic:tiny", length: int = 40
                   ) -> list[bool]:
    """For each chunking: are the K and V its prefill left in the pages the one-chunk ones, bit
    for bit? What a prefix cache hit relies on: a cached page must hold what the request would
    have computed itself."""
    (_, k0, v0), *runs = prompt_runs(exact, chunkings, device, dtype, model, length)
    return [torch.equal(k0, k) and torch.equal(v0, v) for _, k, v in runs]
