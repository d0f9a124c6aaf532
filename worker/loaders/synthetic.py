"""Random weights of named model shapes, for tests and for benchmarks without checkpoints.

Each tensor is drawn on the CPU from a generator seeded by (model name, tensor name with its
global layer number), so any layer split yields the same weights on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from torch import Tensor

from worker.loaders.synthetic_shapes import named_shape
from worker.model import StageModel, build_stage, check_layer_range
from worker.tokenizer import TokenizerInfo, byte_level_tokenizer

# Small enough that 30+ residual additions keep activations O(1) in bfloat16.
WEIGHT_STD = 0.02


class SyntheticSource:
    def __init__(self, shape: str):
        self.name = f"synthetic:{shape}"
        self.args = dataclasses.replace(named_shape(shape))
        self._tokenizer: TokenizerInfo | None = None

    @property
    def tokenizer(self) -> TokenizerInfo:
        if self._tokenizer is None:
            self._tokenizer = byte_level_tokenizer(self.args.vocab_size)
        return self._tokenizer

    def _tensor(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
    ) -> Tensor:
        """`name` is the full-model name (global layer number), so splits agree."""
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        digest = hashlib.sha256(f"{self.name}/{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        # drawn in float32 whatever the run dtype, so every dtype rounds the same weights
        w = torch.empty(shape, dtype=torch.float32, device="cpu")
        w.normal_(0.0, WEIGHT_STD, generator=generator)
        return w.to(device=device, dtype=dtype)

    def load_stage(
        self, layer_start: int, layer_end: int, dtype: torch.dtype, device: str | torch.device
    ) -> StageModel:
        a = self.args
        check_layer_range(a, layer_start, layer_end)
        first, last = layer_start == 0, layer_end == a.n_layers
        with torch.device("meta"):  # the family's parameters, by name and shape
            names = StageModel(a, layer_start, layer_end, first, last).state_dict()
        t = {}
        for name, meta in names.items():
            if name.startswith("layers."):  # drawn by the full model's layer number
                i, rest = name.removeprefix("layers.").split(".", 1)
                drawn = f"layers.{int(i) + layer_start}.{rest}"
            elif name == "output.weight" and a.tie_embeddings:
                if first:
                    continue  # build_stage shares the embedding's
                drawn = "embed.weight"
            else:
                drawn = name
            t[name] = self._tensor(drawn, tuple(meta.shape), dtype, device)
        return build_stage(a, layer_start, layer_end, t)
