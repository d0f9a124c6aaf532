"""Exact mode bit for bit: every sequence's logits, at every token it samples, are the bits it
gets alone, beside 3 or 15 others arriving at different steps, with its prompt chunked by 4, 16
or 512 rows, on 1, 2 or 3 stages, with its pages moved or dropped and recomputed. The default
kernels do change bits in the same replays, so these tests see what they guard."""

import pytest
import torch
from exactness.replay import Seq, Stages, replay

MODEL = "synthetic:tiny"


def crowd(n: int) -> list[Seq]:
    """n + 1 sequences of different lengths and arrival steps; the target (37 tokens) is last."""
    seqs = [Seq([3 + (i * 131 + j * 17) % 490 for j in range(3 + (i * 37) % 60)],
                4 + (i * 7) % 13, arrival=(i * 5) % 9) for i in range(n)]
    return seqs + [Seq(list(range(101, 138)), 16, arrival=2)]


def run(exact: bool, n: int, cuts: list[int], chunk: int, page: int = 4, **knobs):
    stages = Stages(MODEL, cuts, 512, page, exact, "cpu", torch.float32)
    return replay(stages, crowd(n), chunk, **knobs)


@pytest.fixture(scope="module")
def solo() -> list[list[torch.Tensor]]:
    """Each of the 16 sequences alone: one stage, whole prompt in one step, 16-position pages."""
    stages = Stages(MODEL, [], 64, 16, True, "cpu", torch.float32)
    return [replay(stages, [Seq(s.prompt, s.max_tokens, 0)], 512)[0] for s in crowd(15)]


CASES = {
    "alone-chunk4": (0, [], 4, {}),
    "crowd3-chunk16-2stages": (3, [2], 16, {}),
    "crowd15-chunk4-1stage-pages-moved": (15, [], 4, {"move_every": 5}),
    "crowd15-chunk512-3stages-pages-moved": (15, [1, 3], 512, {"move_every": 3}),
    "crowd15-chunk16-2stages-recomputed": (15, [2], 16, {"recompute_every": 6}),
    "crowd15-chunk16-1stage-moved-and-recomputed": (15, [], 16, {"move_every": 2,
                                                                 "recompute_every": 7}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_every_sequence_gets_its_solo_logits_bit_for_bit(solo, case):
    n, cuts, chunk, knobs = CASES[case]
    got = run(True, n, cuts, chunk, **knobs)
    want = solo[:n] + solo[-1:]
    assert [len(g) for g in got] == [len(w) for w in want]
    differing = [i for i, (g, w) in enumerate(zip(got, want))
                 if not all(torch.equal(a, b) for a, b in zip(g, w))]
    assert differing == []


def test_default_kernels_do_change_logits_in_the_same_replays():
    alone = replay(Stages(MODEL, [], 64, 16, False, "cpu", torch.float32),
                   [crowd(15)[-1]], 512)[0]
    crowded = run(False, 15, [2], 16, recompute_every=6)[-1]
    assert len(crowded) == len(alone)
    assert not all(torch.equal(a, b) for a, b in zip(crowded, alone))
