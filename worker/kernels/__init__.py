"""Kernels beside the plain PyTorch ones, for the CPU (`exact_cpu`, torch only: exact mode's
batch-invariant kernels) and for CUDA in Triton, each module imported on first use (a CPU-only
install never needs Triton):

- `paged_triton`: exact mode's batch-invariant paged attention (`worker/exact.py`, the one place
  that switches exact mode on), the page reads every paged kernel shares, and the row writes
  every mode's step graphs make;
- `matmul_triton`: exact mode's batch-invariant matmul;
- `flash_triton`: default mode's paged attention (flash attention for prompts, split keys for
  decode steps);
- `rowwise_triton`: RMSNorm, RoPE, SiLU-and-multiply and the residual add, one launch each, in
  every mode (`worker/model.py`): cheaper than PyTorch's eager kernels and with their bits.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

# Key positions per split of default mode's decode attention at most (`flash_triton`), and what
# the step graphs' key buckets are counted in: they size their buffers by it without importing
# Triton.
ATTENTION_SPLIT = 256


def splits_bucket(context: int) -> int:
    """The power of two of ATTENTION_SPLIT splits that covers `context` keys: what a decode step
    of that context is sized by (its graph, its split)."""
    n = -(-context // ATTENTION_SPLIT)
    return 1 << (n - 1).bit_length()


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """This package's Triton module `name`, or None where Triton is not installed."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != "triton" and not (e.name or "").startswith("triton."):
            raise
        return None


@functools.cache
def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device: what the split kernels size their grids by."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_kernels() -> ModuleType | None:
    """`paged_triton`, or None where Triton is not installed."""
    return triton_module("paged_triton")
