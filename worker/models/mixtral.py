"""Mixtral: the Llama block with a sparse mixture of experts (top 2 of 8) for its feed-forward."""

from __future__ import annotations

from . import llama
from .moe import SparseMoE


class Block(llama.Block):
    feed_forward_type = SparseMoE
