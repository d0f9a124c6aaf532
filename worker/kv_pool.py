"""The paged KV pool of one worker's layers, with page ids shared across workers.

Layout [n_layers, n_pages, page_size, KVH, D] keeps each layer's pages one contiguous run, so a
layer's window can be moved in few large copies.
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
        shape = (n_layers, n_pages, page_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.n_pages = n_pages
        self.scale = head_dim**-0.5
        self.attention = attention_for(exact)
        self.layers = [LayerView(self, i) for i in range(n_layers)]

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    # The runner's step hooks (worker/host_kv.py's pool needs them); device pages need nothing.
    def settle(self) -> None:
        """Before the host touches the pool's pages (park, restore, copies)."""

    def begin_step(self, meta: BatchMeta, tables: dict[int, list[int]]) -> None:
        """Before the step's forward pass; tables: sequence id -> its page ids, logical order,
        in the batch's order."""

    def end_step(self) -> None:
        """After the step's forward pass is enqueued."""


class LayerView:
    """The LayerKV one Attention module sees: store this step's rows, then attend."""

    def __init__(self, pool: KVPool, layer: int):
        self.pool = pool
        self.layer = layer

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta
    ) -> torch.Tensor:
        k_pool, v_pool = self.pool.k[self.layer], self.pool.v[self.layer]
        k_pool[meta.write_pages, meta.write_offsets] = k.to(k_pool.dtype)
        v_pool[meta.write_pages, meta.write_offsets] = v.to(v_pool.dtype)
        return self.pool.attention(q, k_pool, v_pool, meta, self.pool.scale)
