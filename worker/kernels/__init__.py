"""Kernels beside the plain PyTorch ones: the batch-invariant kernels of exact mode, for the CPU
(`exact_cpu`, torch only) and for CUDA (`exact_triton`, which imports Triton on first use, so a
CPU-only install never needs it). `worker/exact.py` is the one place that switches exact mode
on; on CUDA default mode also uses the Triton paged attention (`worker/attention.py`) and RMSNorm
(`worker/model.py`), which cost less than PyTorch's eager kernels and change no guarantee."""

from __future__ import annotations

import functools
from types import ModuleType

# Key positions per split of the CUDA paged attention (`exact_triton.SPLIT`); the decode graphs
# size their buffers by it without importing Triton.
ATTENTION_SPLIT = 256


@functools.cache
def triton_kernels() -> ModuleType | None:
    """`exact_triton`, or None where Triton is not installed."""
    try:
        from . import exact_triton
    except ImportError:
        return None
    return exact_triton
