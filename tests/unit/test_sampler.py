import torch

from protocol.sampling import SamplingParams
from worker.sampler import draw_seed, sample


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


MIXED = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=1),
         SamplingParams(temperature=1.3, top_p=0.8, seed=2),
         SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=3),
         SamplingParams(temperature=1.0, seed=4), SamplingParams(top_k=1, temperature=2.0)]


def test_each_rows_draw_is_its_draw_alone_in_any_batch_of_mixed_parameters():
    torch.manual_seed(1)
    logits = torch.randn(len(MIXED), 5000) * 3
    positions = [11, 12, 13, 14, 15, 16]
    batched = sample(logits, MIXED, positions)
    alone = [sample(logits[i:i + 1], [p], [positions[i]])[0] for i, p in enumerate(MIXED)]
    assert batched == alone
    reversed_batch = sample(logits.flip(0), MIXED[::-1], positions[::-1])
    assert reversed_batch[::-1] == batched
    assert batched[0] == int(logits[0].argmax()) and batched[5] == int(logits[5].argmax())


def test_without_top_p_no_token_is_cut_off():
    # top_p 1.0 keeps every token, however little mass is left after the others (here 1.7e-4
    # of it: 17 of 100,000 draws expected)
    n = 100_000
    logits = torch.tensor([[0.0, 0.0, -8.0]]).expand(n, 3)
    draws = sample(logits, [SamplingParams(temperature=1.0, seed=5)] * n, list(range(n)))
    assert 0 < draws.count(2) < 60


def test_uniforms_are_open_interval_and_depend_only_on_their_key():
    from worker.sampler import uniforms
    keys = torch.tensor([draw_seed(1, 2), draw_seed(3, 4), 0, 2**63 - 1])
    u = uniforms(keys, 1000)
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(uniforms(keys[2:3], 1000), u[2:3])
    assert abs(float(u.mean()) - 0.5) < 0.02
