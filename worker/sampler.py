"""Token sampling. Every draw comes from a generator keyed by (seed, position), so a sequence's
sampled tokens do not depend on its neighbours, on parks, or on which worker samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def draw_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position), folded into torch's 63-bit seed range."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """logits: [N, vocab] float32; positions[i]: the position the sampled token will occupy."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, positions[i])
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    x = logits.float() / p.temperature
    if 0 < p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    gen = torch.Generator(device="cpu").manual_seed(draw_seed(p.seed, position))
    # exponential race: argmax(p / E) is a draw from p, one generator per row
    e = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=gen)
    return int((probs.cpu() / e).argmax())
