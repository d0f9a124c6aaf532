"""Qwen3 (dense): the Llama block with an RMSNorm over each head's q and k before RoPE."""

from __future__ import annotations

from torch import Tensor

from worker.model_args import ModelArgs
from worker.norm import RMSNorm
from worker.rope import apply_rope

from . import llama


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, args.rms_eps)
        self.k_norm = RMSNorm(args.head_dim, args.rms_eps)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [T, dim] -> q: [T, H, D], k, v: [T, KVH, D], normed per head, RoPE applied."""
        a = self.args
        t = x.shape[0]
        q, k, v = self.wqkv(x).split([a.q_dim, a.kv_dim, a.kv_dim], dim=-1)
        q = self.q_norm(q.reshape(t * a.n_heads, a.head_dim)).view(t, a.n_heads, a.head_dim)
        k = self.k_norm(k.reshape(t * a.n_kv_heads, a.head_dim)).view(t, a.n_kv_heads, a.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(t, a.n_kv_heads, a.head_dim)


class Block(llama.Block):
    attention_type = Attention
