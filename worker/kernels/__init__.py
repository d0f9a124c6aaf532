"""Kernels beside the plain PyTorch ones: the batch-invariant kernels of exact mode, for the CPU
(`exact_cpu`, torch only) and for CUDA (`paged_triton`, which imports Triton on first use, so a
CPU-only install never needs it). On CUDA both modes use `paged_triton`'s paged attention
(`worker/attention.py` chooses it) and RMSNorm (`worker/model.py`), which cost less than
PyTorch's eager kernels and change no guarantee; exact mode adds its matmul (`worker/exact.py`,
the one place that switches exact mode on)."""

from __future__ import annotations

import functools
from types import ModuleType

# Key positions per split of the CUDA paged attention (`paged_triton.SPLIT`); the decode graphs
# size their buffers by it without importing Triton.
ATTENTION_SPLIT = 256


@functools.cache
def triton_kernels() -> ModuleType | None:
    """`paged_triton`, or None where Triton is not installed."""
    try:
        from . import paged_triton
    except ImportError:
        return None
    return paged_triton
