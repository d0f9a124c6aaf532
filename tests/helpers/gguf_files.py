"""Writing GGUF files as llama.cpp's converter does, for the loaders' tests."""

from __future__ import annotations

import numpy as np


def permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q or k rows [n_heads * D, ...] from Hugging Face's half-split RoPE order to llama.cpp's
    interleaved one (convert_hf_to_gguf's `permute`)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))
