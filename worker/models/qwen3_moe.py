"""Qwen3-MoE: the Qwen3 block with a sparse mixture of experts for its feed-forward."""

from __future__ import annotations

from . import qwen3
from .moe import SparseMoE


class Block(qwen3.Block):
    feed_forward_type = SparseMoE
