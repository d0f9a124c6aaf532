"""Which decode steps a worker may enqueue before their plan arrives (worker/overlap.py), and
which plans are the step it guessed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from protocol.messages import PageCopy, PageMove, Sampling, SeqPlan, Step
from worker.overlap import OVERLAP_ENV, Ahead, continues, follow_on, overlap_enabled
from worker.sampler import SamplingParams

PAGE = 4


def runner(sampling: dict[int, SamplingParams] | None = None) -> SimpleNamespace:
    """What `follow_on` reads of a ModelRunner: one stage holding the whole model, sequence 1 on
    two pages (8 positions), sequence 2 on one."""
    return SimpleNamespace(first=True, last=True, pool=SimpleNamespace(page_size=PAGE),
                           tables={1: [5, 6], 2: [9]}, sampling=sampling or {})


def decode(*starts: tuple[int, int], step: int = 3) -> Step:
    return Step(step=step, seqs=[SeqPlan(id=i, start=s, n=1, sample=True) for i, s in starts],
                token_ids=[100 + i for i, _ in starts])


def test_the_next_step_is_guessed_for_greedy_sequences_with_room_in_their_pages():
    nxt = follow_on(decode((1, 5), (2, 1)), runner())
    assert [(s.id, s.start, s.n, s.sample) for s in nxt.seqs] == [(1, 6, 1, True), (2, 2, 1, True)]
    assert nxt.token_ids == [0, 0]  # the inputs stay on the device


@pytest.mark.parametrize("plan,who", [
    (decode((1, 6)), runner()),  # position 7 is the last of its pages: it may go on
    (decode((2, 3)), runner()),  # position 4 needs a second page, which only the coordinator has
    (decode((1, 5)), runner({1: SamplingParams(temperature=0.8)})),  # a draw, on the host
    (Step(step=3, seqs=[SeqPlan(id=1, start=0, n=5, sample=True)], token_ids=[1] * 5), runner()),
    (decode((1, 5)), SimpleNamespace(**{**vars(runner()), "last": False})),  # a layer split
])
def test_no_guess_without_room_for_the_next_position_or_for_a_draw_a_prefill_or_a_split(plan, who):
    assert (follow_on(plan, who) is None) == (plan.seqs[0].start != 6)


def test_a_batch_is_steady_when_its_sequences_each_moved_one_position():
    assert continues(decode((1, 4), (2, 0)), decode((1, 5), (2, 1)))
    assert not continues(None, decode((1, 5)))
    assert not continues(decode((1, 4), (2, 0)), decode((1, 5)))  # one left
    assert not continues(decode((1, 4)), decode((1, 6)))


@pytest.mark.parametrize("change", [
    {},
    {"token_ids": [100, 7]},
    {"free": [4]},
    {"park": [PageMove(id=4, pages=[1], slots=[0])]},
    {"restore": [PageMove(id=4, pages=[1], slots=[0])]},
    {"copies": [PageCopy(src=1, dst=2)]},
    {"seqs": [SeqPlan(id=1, start=6, n=1, sample=True, pages_add=[7]),
              SeqPlan(id=2, start=2, n=1, sample=True)]},
    {"seqs": [SeqPlan(id=1, start=6, n=1, sample=True, sampling=Sampling()),
              SeqPlan(id=2, start=2, n=1, sample=True)]},
    {"seqs": [SeqPlan(id=1, start=6, n=1, sample=True)], "token_ids": [101]},
])
def test_only_the_plan_it_guessed_uses_a_step_enqueued_ahead(change):
    guessed = follow_on(decode((1, 5), (2, 1)), runner())
    ahead = Ahead(guessed, inputs=[101, 102], tokens=None)
    plan = decode((1, 6), (2, 2), step=4)
    plan.token_ids = [101, 102]
    for key, value in change.items():
        setattr(plan, key, value)
    assert ahead.matches(plan) == (not change)


def test_overlap_is_on_by_default_for_cuda_with_device_kv_and_refuses_a_bad_setting(monkeypatch):
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert overlap_enabled("cuda:0", "device")
    assert not overlap_enabled("cuda:0", "host") and not overlap_enabled("cpu", "device")
    monkeypatch.setenv(OVERLAP_ENV, "1")
    assert overlap_enabled("cpu", "host")
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert not overlap_enabled("cuda:0", "device")
    monkeypatch.setenv(OVERLAP_ENV, "yes")
    with pytest.raises(ValueError, match=OVERLAP_ENV):
        overlap_enabled("cpu", "device")
