"""Rotary position embedding in Hugging Face's non-interleaved ("rotate_half") layout."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from worker.model_args import LLAMA3_KEYS


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """[head_dim // 2] float32, computed as transformers' Llama rotary embedding does, bit for bit.

    `scaling` is None, Llama 3 style (`LLAMA3_KEYS`), or `{"freq_factors": [...]}`: a divisor per
    frequency, as llama.cpp stores Llama 3 scaling (`rope_freqs.weight`), or linear scaling's
    factor repeated.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if scaling is None:
        return inv_freq
    if "freq_factors" in scaling:
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float)
    factor, low, high, old_context = (scaling[key] for key in LLAMA3_KEYS)
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rope(nn.Module):
    """cos/sin tables for every position below `max_context`, gathered by absolute position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_context: int):
        super().__init__()
        # Built on the CPU even under a meta-device context (loaders build stages on meta);
        # `StageModel.to(device)` moves them.
        with torch.device("cpu"):
            inv_freq = inverse_frequencies(head_dim, theta, scaling)
            # freqs: [max_context, head_dim // 2]
            freqs = torch.arange(max_context, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions: [T] int64 -> cos, sin: [T, 1, head_dim // 2] in the activations' dtype, as
        # HF casts them before use, so the products below match the reference in every dtype.
        cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        return cos[:, None, :], sin[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, heads, D]; the products of HF's `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
