"""The paged KV pool of one worker's layers, with page ids shared across workers.

Layout [n_layers, n_pages, page_size, KVH, D] keeps each layer's pages one contiguous run, so a
layer's window can be moved in few large copies. The buffers hold one page more, no sequence's:
a captured decode step (worker/cuda_graphs.py) writes its padding rows there.
"""

from __future__ import annotations

import torch

from .attention import paged_attention
from .batch import BatchMeta
from .exact import exact_paged_attention


def attention_for(exact: bool):
    """The paged attention a pool attends with; every pool, device or host, picks it here."""
    return exact_paged_attention if exact else paged_attention


class KVPool:
    def __init__(
        self, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, exact: bool = False,
    ):
        shape = (n_layers, n_pages + 1, page_size, n_kv_heads, head_dim)
        self.k_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = self.k_buf[:, :n_pages], self.v_buf[:, :n_pages]  # the pages
        self.page_size = page_size
        self.n_pages = n_pages
        self.scale = head_dim**-0.5
        self.attention = attention_for(exact)
        self.layers = [LayerView(self, i) for i in range(n_layers)]
        self.meta: BatchMeta | None = None  # the step's, between begin_step and end_step
        self._bases = [0] * n_layers

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    # The runner's step hooks (worker/host_kv.py's pool needs them); device pages need nothing.
    def settle(self) -> None:
        """Before the host touches the pool's pages (park, restore, copies)."""

    def begin_step(self, meta: BatchMeta, tables: dict[int, list[int]]) -> None:
        """Before the step's forward pass; tables: sequence id -> its page ids, logical order,
        in the batch's order."""
        self.meta = meta

    def end_step(self) -> None:
        """After the step's forward pass is enqueued."""

    # What a captured decode step needs (worker/cuda_graphs.py's GraphPool).
    hooks = False  # its layers need nothing between pieces: a step is one graph
    carries = False  # its pages are current: a step writes no rows but its own

    def graph_key(self) -> int:
        return 0  # the pages are never replaced

    def spare_page(self) -> int:
        return self.n_pages

    def step_tables(self) -> list[torch.Tensor]:
        return self.meta.page_tables

    def page_bases(self) -> list[int]:
        return self._bases


class LayerView:
    """The LayerKV one Attention module sees: store this step's rows, then attend."""

    def __init__(self, pool: KVPool, layer: int):
        self.pool = pool
        self.layer = layer

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta
    ) -> torch.Tensor:
        k_pool, v_pool = self.buffers()
        k_pool[meta.write_pages, meta.write_offsets] = k.to(k_pool.dtype)
        v_pool[meta.write_pages, meta.write_offsets] = v.to(v_pool.dtype)
        return self.pool.attention(q, k_pool, v_pool, meta, self.pool.scale)

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.k_buf[self.layer], self.pool.v_buf[self.layer]

    def enter(self) -> None:
        pass

    def leave(self, k: torch.Tensor, v: torch.Tensor) -> None:
        pass
