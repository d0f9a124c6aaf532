"""Writing GGUF files as llama.cpp's converter does, for the loaders' tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np


@contextmanager
def gguf_writer(path: Path, arch: str, config) -> Iterator[gguf.GGUFWriter]:
    """A writer for `arch` with a transformers `config`'s shape written (RoPE base 10000), that
    writes the file when the block ends: the caller adds the rest and the tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    yield w
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q or k rows [n_heads * D, ...] from Hugging Face's half-split RoPE order to llama.cpp's
    interleaved one (convert_hf_to_gguf's `permute`)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))
