"""The paged KV pool of one worker's layers, with page ids shared across workers.

Layout [n_layers, n_pages, page_size, KVH, D] keeps each layer's pages one contiguous run, so a
layer's window can be moved in few large copies. The buffers hold one page more, no sequence's:
a captured step (worker/cuda_graphs.py) writes its padding rows there.
"""

from __future__ import annotations

import torch

from ..attention import PagedAttention
from ..batch import BatchMeta


class KVPool:
    """A `Pool` (worker/kv/pool.py) whose pages live on the device."""

    def __init__(
        self, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, attention: PagedAttention,
    ):
        shape = (n_layers, n_pages + 1, page_size, n_kv_heads, head_dim)
        self.k_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = self.k_buf[:, :n_pages], self.v_buf[:, :n_pages]  # the pages
        self.page_size = page_size
        self.n_pages = n_pages
        self.scale = head_dim**-0.5
        self.attention = attention
        self.layers = [LayerView(self, i) for i in range(n_layers)]
        self._bases = [0] * n_layers

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    # The runner's step hooks; device pages need nothing.
    def settle(self) -> None:
        pass

    def begin_step(self, meta: BatchMeta, seq_ids: list[int]) -> BatchMeta:
        return meta

    def end_step(self) -> None:
        pass

    # What a captured step needs: a step is one graph, and writes no rows but its own.
    piece_layers = 0
    carries = False
    carried = None

    def graph_key(self) -> int:
        return 0  # the pages are never replaced

    def spare_page(self) -> int:
        return self.n_pages

    def page_bases(self) -> list[int]:
        return self._bases


class LayerView:
    """One layer of a KVPool: its pages, and hooks that need nothing."""

    def __init__(self, pool: KVPool, layer: int):
        self.pool = pool
        self.layer = layer

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.k_buf[self.layer], self.pool.v_buf[self.layer]

    def enter(self) -> None:
        pass

    def leave(self, k: torch.Tensor, v: torch.Tensor) -> None:
        pass
