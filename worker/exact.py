"""Exact mode, switched on in one place: batch-invariant kernels around an unchanged model.

`apply_exact(stage, device)` swaps the forward of each module whose arithmetic would depend on
the other rows of its launch (every Linear, and the experts' products of a mixture of experts),
as gpt-fast's `apply_tp` does for tensor parallelism; `exact_attention(device)` is the paged
attention a worker chooses in exact mode (`worker.attention.choose_attention`). On CUDA RMSNorm
(whose reduction torch splits by shape there) needs no swap: every mode runs it as the
row-per-program Triton kernel (worker/norm.py), and default mode attends with the same paged
kernel too, so there exact mode changes only the matmuls.
docs/exact-mode.md says what is guaranteed and how each kernel keeps it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .kernels import exact_cpu, triton_module
from .model import StageModel
from .models.moe import SparseMoE

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def apply_exact(stage: StageModel, device: torch.device | str) -> None:
    """Raises ValueError (with what to change) where exact mode cannot be honoured."""
    device = torch.device(device)
    dtype = next(stage.parameters()).dtype
    if dtype not in DTYPES:
        raise ValueError(f"exact mode supports float32, bfloat16 and float16, not {dtype}")
    linear = exact_linear(device)
    if device.type == "cpu":
        weights = {m.weight.shape: m.weight for m in stage.modules() if isinstance(m, nn.Linear)}
        for m in stage.modules():
            if isinstance(m, SparseMoE):
                weights.update({w.shape[1:]: w[0] for w in (m.w13, m.w2)})
        for w in weights.values():
            exact_cpu.check_row_invariance(w)
    elif stage.args.head_dim & (stage.args.head_dim - 1):
        raise ValueError(f"exact mode on CUDA needs a power-of-two head size, not "
                         f"{stage.args.head_dim}")
    for m in stage.modules():
        if isinstance(m, nn.Linear):
            m.forward = partial(linear, weight=m.weight, bias=m.bias)
        elif isinstance(m, SparseMoE):
            m.linear = linear


def exact_linear(device: torch.device) -> Callable[..., torch.Tensor]:
    """Exact mode's `linear(x, weight, bias=None)` on `device`: each row's bits independent of
    the other rows of the launch."""
    if device.type == "cuda":
        return _triton("matmul_triton").linear
    if device.type == "cpu":
        return exact_cpu.linear
    raise ValueError(f"exact mode has kernels for cpu and cuda devices, not {device.type}")


def exact_attention(device: torch.device) -> Callable[..., torch.Tensor]:
    """Exact mode's paged attention on `device` (`worker.attention.PagedAttention.attend`'s
    contract): each row's bits independent of the batch, of the chunking of its prompt and of
    where its pages live."""
    if device.type == "cuda":
        return _triton("paged_triton").paged_attention
    return exact_cpu.paged_attention


def _triton(name: str):
    kernels = triton_module(name)
    if kernels is None:
        raise ValueError("exact mode on CUDA needs Triton (pip install 'siding[gpu]')")
    return kernels
