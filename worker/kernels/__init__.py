"""Kernels beside the plain PyTorch ones: the batch-invariant kernels of exact mode, for the CPU
(`exact_cpu`, torch only) and for CUDA (`exact_triton`, which imports Triton on first use, so a
CPU-only install never needs it). `worker/exact.py` is the one place that switches them on; the
Triton paged attention also serves default mode on CUDA (`worker/attention.py`)."""
