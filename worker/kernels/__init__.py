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
  every mode (`worker/model.py`): cheaper than PyTorch's eager kernels and with their bits;
- `counting`: how the last of an output's programs to finish knows it is the last
  (`launch_counts` holds the counts).
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType

# Key positions per split of default mode's decode attention at most (`flash_triton`), and what
# the step graphs' key buckets are counted in: they size their buffers by it without importing
# Triton.
ATTENTION_SPLIT = 256
# What a kernel compiles with unless it says otherwise (exact attention: `paged_triton.NO_FUSION`):
# multiply-adds fused where the compiler finds them, Triton's default up to 3.9, which the kernels'
# bits and speed were measured with; 3.10 turns the default off
FUSION = {"enable_fp_fusion": True}


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


@functools.cache
def launch_counts(device):
    """Zeros [sm_count] int32 on a CUDA device: the programs of one output (a matmul tile's
    splits, a spread attention row's key tiles) count themselves finished here
    (`kernels.counting.last_to_finish`), and the last adds their partial results. Shared by
    every launch of a device, which the worker makes one after another on one stream; a launch
    counts fewer outputs than the device has SMs. Made on a kernel's first launch, which a step
    graph's warm-up makes before its capture: a capture would record the zeroing, not run it."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("launch_counts first asked for inside a CUDA graph capture: "
                           "warm the launch up before capturing it")
    return torch.zeros(sm_count(device), dtype=torch.int32, device=device)


def triton_kernels() -> ModuleType | None:
    """`paged_triton`, or None where Triton is not installed."""
    return triton_module("paged_triton")


class Scratch:
    """Float32 memory that the attention of every captured step of one worker views for its
    partial results (`paged_triton.StepAttention`, `flash_triton.StepAttention`). A worker's
    steps replay one after another on one stream, so one buffer serves every graph, where a
    buffer each took hundreds of MB. A graph that needs more than the buffer holds gets a new
    one, at least twice as large, which the graphs after it share; those captured before keep
    theirs."""

    def __init__(self, device):
        self.device = device
        self.buffer = None

    def views(self, *shapes: tuple[int, ...]) -> list:
        import torch

        sizes = [math.prod(shape) for shape in shapes]
        need = sum(sizes)
        if self.buffer is None or self.buffer.numel() < need:
            grown = 0 if self.buffer is None else 2 * self.buffer.numel()
            self.buffer = torch.empty(max(need, grown), dtype=torch.float32, device=self.device)
        return [v.view(shape) for v, shape in zip(self.buffer[:need].split(sizes), shapes)]

    def states(self, shape: tuple[int, ...], head_dim: int) -> tuple:
        """Softmax states over `shape` (the split kernels' splits, exact mode's spread tiles):
        maxima and sums [*shape], unnormalised outputs [*shape, head_dim]."""
        return tuple(self.views(shape, shape, (*shape, head_dim)))


def states_bytes(shape: tuple[int, ...], head_dim: int) -> int:
    """The bytes `Scratch.states(shape, head_dim)` takes."""
    return math.prod(shape) * (head_dim + 2) * 4
