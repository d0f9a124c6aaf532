"""What a KV pool is to the runner, the park store and the step graphs: `KVPool` (device pages,
device_pool.py) and `HostKVPool` (host pages through a staging ring, host_pool.py) both are one.

A step is `begin_step`, the step's pieces (worker/step.py) over the layers' `buffers`, each
between its layers' `enter` and `leave`, then `end_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..attention import PagedAttention
from ..batch import BatchMeta


class PoolLayer(Protocol):
    """One layer of a pool, as a step (worker/step.py) uses it."""

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pages this layer's attention reads, [pages, page, KVH, D], by address:
        the layer's own from its page base (`page_bases`)."""

    def enter(self) -> None:
        """Before the layer's writes and reads: what must precede them (a slot's delivery)."""

    def leave(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """After them: the step's new rows k, v [T, KVH, D], and freeing what it read."""


class Pool(Protocol):
    k: torch.Tensor  # [L, n_pages, page, KVH, D], the pages (the host's, for a host pool)
    v: torch.Tensor
    n_pages: int
    page_size: int
    scale: float  # the softmax scale
    attention: PagedAttention  # chosen once at load, for every layer and step graph
    layers: Sequence[PoolLayer]
    carries: bool  # whether a step may carry the last step's rows (`carried`)
    # this step's carried rows [L, 2, T, KVH, D], with their pages (before the base) and
    # offsets [T]: a step writes them into its buffers before its own, where its buffers were
    # filled from pages that lack them (None: none this step)
    carried: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    @property
    def bytes_per_page(self) -> int:
        """K and V of one page, every layer."""

    @property
    def piece_layers(self) -> int:
        """Layers a step graph's piece holds this step, the layers' enter/leave run around it
        for each (a ring slot's layers); 0: enter and leave do nothing, a step is one graph."""

    def settle(self) -> None:
        """Before the host touches the pages outside a step (park, restore, page copies)."""

    def begin_step(self, meta: BatchMeta, seq_ids: list[int]) -> BatchMeta:
        """Before the step's forward pass; seq_ids: the batch's sequences, in its order. Returns
        the meta the layers attend with (the step's, renumbered where the pages are staged)."""

    def end_step(self) -> None:
        """After the step's forward pass is enqueued."""

    def graph_key(self) -> Any:
        """Changes whenever a buffer a captured graph holds by address is replaced; None: the
        pool has no buffers yet."""

    def spare_page(self) -> int:
        """A page in every layer's buffers that nothing reads: padding rows write there."""

    def page_bases(self) -> list[int]:
        """Each layer's page base this step: the tables of the meta `begin_step` returned index
        the layer's buffers from there."""
