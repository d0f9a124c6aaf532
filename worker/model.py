"""The Llama-family model as plain modules, one stage (a contiguous range of layers) at a time.

Tokens of every sequence in a step are concatenated (varlen layout): activations are [T, dim] and
the step's `positions` [T] hold each token's absolute position. Each block hands its q, k, v to
the step the caller passes in (`StepKV`: worker/step.py's `Step`), which stores the new rows and
attends, so paging and kernels live outside. `StageModel.run` is the one layer loop: an eager
step runs it, and the step graphs capture it (worker/cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.kernels import triton_module
from worker.model_args import ModelArgs
from worker.rope import Rope, apply_rope


class StepKV(Protocol):
    positions: Tensor  # [T] int64

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Layer `layer` (of the stage) stores its new rows k/v [T, KVH, D] (RoPE applied) and
        attends: q [T, H, D] -> [T, H, D], softmax scale head_dim ** -0.5."""
        ...


def rowwise(x: Tensor):
    """`worker/kernels/rowwise_triton.py` where x is on CUDA and Triton is installed: one launch
    for each step below that eager PyTorch runs as several, with the same bits; else None."""
    return triton_module("rowwise_triton") if x.is_cuda else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if (kernels := rowwise(x)) is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        # Normalised in float32 and cast back before the weight, as the HF reference does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def after_add(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """(x + y, this norm of it)."""
        if (kernels := rowwise(x)) is not None:
            return kernels.add_rms_norm(x, y, self.weight, self.eps)
        h = x + y
        return h, self(h)


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
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.rms_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.rms_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step: StepKV, layer: int) -> Tensor:
        """x: [T, dim]; layer: this block's index in its stage."""
        q, k, v = self.attention.qkv(self.attention_norm(x), cos, sin)
        attn = step.attend(layer, q, k, v)  # [T, H, D]
        h, normed = self.ffn_norm.after_add(x, self.attention.wo(attn.reshape(x.shape[0], -1)))
        return h + self.feed_forward(normed)


def check_layer_range(args: ModelArgs, layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start < layer_end <= args.n_layers:
        raise ValueError(
            f"layer range [{layer_start}, {layer_end}) is not a non-empty part of "
            f"[0, {args.n_layers})"
        )


class StageModel(nn.Module):
    """Layers [layer_start, layer_end); the embedding if `first`, final norm and head if `last`."""

    def __init__(self, args: ModelArgs, layer_start: int, layer_end: int, first: bool, last: bool):
        super().__init__()
        check_layer_range(args, layer_start, layer_end)
        self.args = args
        self.layer_start, self.layer_end = layer_start, layer_end
        self.first, self.last = first, last
        # Uninitialised: loaders assign the weights, and nn.Embedding's random init on the meta
        # device imports torch._dynamo (~1.5 s on a small CPU).
        empty = torch.empty(args.vocab_size, args.dim)
        self.embed = nn.Embedding.from_pretrained(empty, freeze=True) if first else None
        self.layers = nn.ModuleList(Block(args) for _ in range(layer_start, layer_end))
        self.norm = RMSNorm(args.dim, args.rms_eps) if last else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if last else None
        self.rope = Rope(args.head_dim, args.rope_theta, args.rope_scaling, args.max_context)

    def forward(self, inputs: Tensor, step: StepKV) -> Tensor:
        # inputs: token ids [T] int64 on the first stage, else hidden [T, dim] -> hidden [T, dim]
        x, rope = self.begin(inputs, step.positions)
        return self.run(x, rope, step, range(len(self.layers)))

    def begin(self, inputs: Tensor, positions: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The hidden rows [T, dim] (embedded on the first stage) and the RoPE tables of
        `positions` [T]."""
        x = self.embed(inputs) if self.embed is not None else inputs
        return x, self.rope(positions, x.dtype)

    def run(self, x: Tensor, rope: tuple[Tensor, Tensor], step: StepKV, layers: range
            ) -> Tensor:
        """The stage's layers `layers` (indices within it) over x [T, dim]."""
        for i in layers:
            x = self.layers[i](x, *rope, step, i)
        return x

    def head(self, hidden: Tensor) -> Tensor:
        # hidden: [N, dim] -> [N, vocab] in the model's dtype
        if self.output is None:
            raise RuntimeError("logits are computed by the last stage only")
        return self.output(self.norm(hidden))

    def logits(self, hidden: Tensor) -> Tensor:
        # hidden: [N, dim] -> [N, vocab] float32
        return self.head(hidden).float()


def build_stage(
    args: ModelArgs, layer_start: int, layer_end: int, tensors: Mapping[str, Tensor]
) -> StageModel:
    """A stage whose parameters are exactly `tensors` (state-dict names, layers numbered from 0
    within the stage), frozen and in eval mode. Tensors are used as they are, not copied.

    A tied head may be left out when the stage also holds the embedding: it shares its storage.
    """
    first, last = layer_start == 0, layer_end == args.n_layers
    if first and last and args.tie_embeddings and "output.weight" not in tensors:
        tensors = {**tensors, "output.weight": tensors["embed.weight"]}
    with torch.device("meta"):
        model = StageModel(args, layer_start, layer_end, first, last)
    model.load_state_dict(tensors, strict=True, assign=True)
    device = next(iter(tensors.values())).device
    return model.to(device).requires_grad_(False).eval()
