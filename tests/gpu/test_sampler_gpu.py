"""Sampling on a CUDA device (worker/sampler.py): each row's draw is its draw alone whatever the
batch, a draw's noise is the same bits as on the CPU, and the chosen ids follow the
distribution. Skipped without a GPU."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from protocol.sampling import SamplingParams  # noqa: E402
from worker.sampler import draw_seed, sample, sample_tokens, uniforms  # noqa: E402

MIXED = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=1),
         SamplingParams(temperature=1.3, top_p=0.8, seed=2),
         SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=3),
         SamplingParams(temperature=1.0, seed=4), SamplingParams(top_k=1, temperature=2.0)]


def test_each_rows_draw_on_the_gpu_is_its_draw_alone_in_any_batch():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(len(MIXED), 128256, generator=g) * 3).cuda()
    positions = [11, 12, 13, 14, 15, 16]
    batched = sample(logits, MIXED, positions)
    alone = [sample(logits[i:i + 1], [p], [positions[i]])[0] for i, p in enumerate(MIXED)]
    assert batched == alone
    many = sample(logits.repeat(40, 1), MIXED * 40, positions * 40)  # 240 rows
    assert many == batched * 40


def test_the_noise_is_the_cpus_bit_for_bit():
    keys = torch.tensor([draw_seed(s, p) for s, p in ((1, 2), (3, 4), (2**62, 10**9))])
    assert torch.equal(uniforms(keys.cuda(), 5000).cpu(), uniforms(keys, 5000))


def test_the_tokens_stay_on_the_device_and_follow_the_distribution():
    n = 20000
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]], device="cuda")).expand(n, 3)
    tokens = sample_tokens(logits, [SamplingParams(temperature=1.0, seed=9)] * n, list(range(n)))
    assert tokens.is_cuda
    share = (tokens == 0).float().mean().item()
    assert 0.68 < share < 0.72
