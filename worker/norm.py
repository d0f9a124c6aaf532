"""RMSNorm, and the row-wise Triton kernels the model's modules use where they run."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from worker.kernels import triton_module


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
