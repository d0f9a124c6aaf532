import torch

from worker.sampler import SamplingParams, draw_seed, sample


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]


def test_seeded_draw_depends_only_on_seed_and_position():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[2:3], [p], [17])
    batched = sample(logits, [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 42, 3)],
                     [5, 6, 17, 8])
    assert batched[2] == alone[0]
    draws = {sample(logits[2:3], [p], [pos])[0] for pos in range(20)}
    assert len(draws) > 5  # different positions draw differently


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = SamplingParams(temperature=1.0, top_k=2, seed=3)
    top_p = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    for pos in range(200):
        assert sample(logits, [top_k], [pos])[0] in (0, 1)
        assert sample(logits, [top_p], [pos])[0] in (0, 1)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = [sample(logits, [SamplingParams(temperature=1.0, seed=9)], [i])[0] for i in range(3000)]
    share = draws.count(0) / len(draws)
    assert 0.66 < share < 0.74


def test_draw_seed_mixes_seed_and_position():
    assert draw_seed(1, 2) != draw_seed(2, 1)
    assert 0 <= draw_seed(2**62, 10**9) < 2**63
