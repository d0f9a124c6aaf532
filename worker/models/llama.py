"""The Llama family's layer (Llama, Mistral, Qwen2: the same block, Qwen2 with a q/k/v bias):
attention with grouped KV heads and RoPE, and a SiLU-gated feed-forward, each after an RMSNorm
and added to the residual stream."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

from worker.model_args import ModelArgs
from worker.norm import RMSNorm, rowwise
from worker.rope import apply_rope

if TYPE_CHECKING:
    from worker.model import StepKV


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.wqkv = nn.Linear(args.dim, args.q_dim + 2 * args.kv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.q_dim, args.dim, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [T, dim] -> q: [T, H, D], k, v: [T, KVH, D], RoPE applied."""
        a = self.args
        t = x.shape[0]
        qkv = self.wqkv(x)
        if (kernels := rowwise(x)) is not None and not a.head_dim & (a.head_dim - 1):
            return kernels.rope_qk(qkv, cos, sin, a.n_heads, a.n_kv_heads, a.head_dim)
        q, k, v = qkv.split([a.q_dim, a.kv_dim, a.kv_dim], dim=-1)
        q = apply_rope(q.view(t, a.n_heads, a.head_dim), cos, sin)
        k = apply_rope(k.view(t, a.n_kv_heads, a.head_dim), cos, sin)
        return q, k, v.view(t, a.n_kv_heads, a.head_dim)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False)  # gate rows, then up rows
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.w13(x)
        if (kernels := rowwise(x)) is not None:
            return self.w2(kernels.silu_mul(h))
        gate, up = h.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream. A family that
    differs only in one of the two (worker/models/) names its own here."""

    attention_type: type[nn.Module] = Attention
    feed_forward_type: type[nn.Module] = FeedForward

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.rms_eps)
        self.attention = self.attention_type(args)
        self.ffn_norm = RMSNorm(args.dim, args.rms_eps)
        self.feed_forward = self.feed_forward_type(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: StepKV, layer: int) -> Tensor:
        """x: [T, dim]; layer: this block's index in its stage."""
        q, k, v = self.attention.qkv(self.attention_norm(x), cos, sin)
        attn = step.attend(layer, q, k, v)  # [T, H, D]
        h, normed = self.ffn_norm.after_add(x, self.attention.wo(attn.reshape(x.shape[0], -1)))
        return h + self.feed_forward(normed)
