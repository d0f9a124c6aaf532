"""A model as plain modules, one stage (a contiguous range of layers) at a time: the embedding on
the first stage, the family's layers (worker/models/), the final norm and head on the last.

Tokens of every sequence in a step are concatenated (varlen layout): activations are [T, dim] and
the step's `positions` [T] hold each token's absolute position. Each block hands its q, k, v to
the step the caller passes in (`StepKV`: worker/step.py's `PagedStep`), which stores the new
rows and attends, so paging and kernels live outside. `StageModel.run` is the one layer loop:
an eager step runs it, and the step graphs capture it (worker/cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor, nn

from worker.model_args import ModelArgs
from worker.models import block_type
from worker.norm import RMSNorm
from worker.rope import Rope


class StepKV(Protocol):
    positions: Tensor  # [T] int64

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Layer `layer` (of the stage) stores its new rows k/v [T, KVH, D] (RoPE applied) and
        attends: q [T, H, D] -> [T, H, D], softmax scale head_dim ** -0.5."""
        ...


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
        block = block_type(args)
        self.layers = nn.ModuleList(block(args) for _ in range(layer_start, layer_end))
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
