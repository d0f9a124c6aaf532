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

from protocol.sampling import SamplingParams

from .batch import device_ints

_MASK64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's
# the same as signed int64, for tensor arithmetic (signed; multiplication wraps)
_GOLDEN_I64, _MIX1_I64, _MIX2_I64 = (c - (1 << 64) for c in (GOLDEN, MIX1, MIX2))


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


KEEP_ALL = 2.0  # a top-p past any sum of probabilities: no token cut


def float_bits(values: list[float]) -> list[int]:
    """Floats as their float64 bits, int64s: what travels in an int upload."""
    bits = array("q")
    bits.frombytes(array("d", values).tobytes())
    return bits.tolist()


_KEEP_ALL_BITS = float_bits([KEEP_ALL])[0]


@dataclass(frozen=True)
class Draws:
    """What the rows that draw (not greedy) of a step's sampled rows need, as int64 lists for one
    upload: their indices among the sampled rows, their keys, top-k (0: none) and, as float64
    bits, temperature and the mass top-p keeps (KEEP_ALL: every token)."""

    rows: list[int]
    keys: list[int]
    top_ks: list[int]
    temperatures: list[int]
    top_ps: list[int]

    @staticmethod
    def of(params: list[SamplingParams], positions: list[int], vocab: int) -> Draws:
        rows = [i for i, p in enumerate(params) if not p.greedy]
        ps = [params[i] for i in rows]
        return Draws(rows, [draw_seed(p.seed, positions[i]) for p, i in zip(ps, rows)],
                     [p.top_k if 0 < p.top_k < vocab else 0 for p in ps],
                     float_bits([p.temperature for p in ps]),
                     float_bits([p.top_p if p.top_p < 1.0 else KEEP_ALL for p in ps]))

    @property
    def k_max(self) -> int:
        """The largest top-k (0: no row's)."""
        return max(self.top_ks, default=0)

    @property
    def top_p(self) -> bool:
        """Whether any row cuts by top-p."""
        return any(v != _KEEP_ALL_BITS for v in self.top_ps)

    def lists(self) -> list[list[int]]:
        return [self.rows, self.keys, self.top_ks, self.temperatures, self.top_ps]


def draw(logits: torch.Tensor, keys: torch.Tensor, top_ks: torch.Tensor,
         temperatures: torch.Tensor, top_ps: torch.Tensor, k_max: int, top_p: bool
         ) -> torch.Tensor:
    """Each row's draw from its logits [N, vocab] (drawn in float32): keys, top_ks [N] int64,
    temperatures and top_ps [N] float64 bits in int64, as `Draws`; k_max at least every row's
    top-k (0: none has one), top_p whether any row's top_p cuts. -> [N] int64. Row by row
    operations of fixed shapes: a row's token depends on that row's inputs alone, whatever N or
    k_max, so an eager step and a captured one (`worker/draw_graphs.py`) draw alike."""
    temperature = temperatures.view(torch.float64).float()
    x = logits.float() / temperature[:, None]
    if k_max:
        kth = torch.topk(x, k_max, dim=-1).values.gather(1, (top_ks.clamp(min=1) - 1)[:, None])
        x = x.masked_fill((top_ks > 0)[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        mass = top_ps.view(torch.float64).float()[:, None]
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= mass
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    # exponential race: argmax(p / E), E = -log(U), is a draw from p
    return (probs / -torch.log(uniforms(keys, logits.shape[1]))).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                  greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [N, vocab], float32 or the model's dtype (drawn rows are drawn in float32);
    positions[i]: the position the sampled token will occupy; greedy: the logits' argmax where
    it is known already. -> [N] int64 on the logits' device (the host has not waited for it)."""
    tokens = logits.argmax(dim=-1) if greedy is None else greedy.clone()
    d = Draws.of(params, positions, logits.shape[1])
    if not d.rows:
        return tokens
    # every per-row value in one upload that does not wait for the device
    rows, keys, top_ks, temperatures, top_ps = device_ints(d.lists(), logits.device)
    tokens[rows] = draw(logits[rows], keys, top_ks, temperatures, top_ps, d.k_max, d.top_p)
    return tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """`sample_tokens`, read on the host."""
    return sample_tokens(logits, params, positions).tolist()
