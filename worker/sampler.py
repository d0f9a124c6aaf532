"""Token sampling on the logits' device, every row of a step in one batched pass: only the chosen
ids cross to the host.

Every draw is keyed by (seed, position): a row's noise is a counter-based hash of its key and
each vocabulary index (splitmix64, in int64 tensor arithmetic that wraps alike on every
device), so a sequence's sampled tokens do not depend on its neighbours, on parks, on which
worker samples, or on how many rows the step has. Temperature, top-k and top-p are row-wise
tensor operations over the rows that draw; greedy rows take the argmax.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from .batch import device_ints

_MASK64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's
# the same as signed int64, for tensor arithmetic (signed; multiplication wraps)
_GOLDEN_I64, _MIX1_I64, _MIX2_I64 = (c - (1 << 64) for c in (GOLDEN, MIX1, MIX2))


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
    """splitmix64 of (seed, position), folded into [0, 2^63): a row's key."""
    z = (seed * GOLDEN + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * MIX2) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [N] int64 -> [N, vocab] float32 in (0, 1): splitmix64 of (key, index), the top 24
    bits of each hash, centred in its interval."""
    z = keys[:, None] * _GOLDEN_I64 + torch.arange(1, vocab + 1, dtype=torch.int64,
                                                   device=keys.device)[None, :]
    z = (z ^ _shr(z, 30)) * _MIX1_I64
    z = (z ^ _shr(z, 27)) * _MIX2_I64
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                  greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [N, vocab], float32 or the model's dtype (drawn rows are drawn in float32);
    positions[i]: the position the sampled token will occupy; greedy: the logits' argmax where
    it is known already. -> [N] int64 on the logits' device (the host has not waited for it)."""
    tokens = logits.argmax(dim=-1) if greedy is None else greedy.clone()
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn:
        return tokens
    dev, vocab = logits.device, logits.shape[1]
    ps = [params[i] for i in drawn]
    # temperature, and the mass top-p keeps (past any sum: none dropped without top-p), as
    # float64 bits: every per-row value in one upload that does not wait for the device
    floats = array("q")
    floats.frombytes(array("d", [v for p in ps for v in (
        p.temperature, p.top_p if p.top_p < 1.0 else 2.0)]).tobytes())
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]  # 0: no top-k
    rows, keys, ks, floats = device_ints(
        [drawn, [draw_seed(p.seed, positions[i]) for p, i in zip(ps, drawn)], top_ks,
         floats.tolist()], dev)
    floats = floats.view(torch.float64).float().view(-1, 2)
    x = logits[rows].float() / floats[:, :1]
    if k_max := max(top_ks):
        kth = torch.topk(x, k_max, dim=-1).values.gather(1, (ks.clamp(min=1) - 1)[:, None])
        x = x.masked_fill((ks > 0)[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in ps):
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= floats[:, 1:]
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    # exponential race: argmax(p / E), E = -log(U), is a draw from p
    tokens[rows] = (probs / -torch.log(uniforms(keys, vocab))).argmax(dim=-1)
    return tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """`sample_tokens`, read on the host."""
    return sample_tokens(logits, params, positions).tolist()
