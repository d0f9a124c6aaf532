"""Which decode steps a worker may enqueue before their plan arrives (worker/overlap.py), and
which plans are the step it guessed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.ring import pools

from protocol.messages import (
    STEPS_AHEAD,
    PageCopy,
    PageMove,
    Sampling,
    SeqPlan,
    Step,
    WorkerConfig,
    steps_ahead,
)
from worker.executor import StepExecutor
from worker.kv.park_store import ParkStore
from worker.loaders.synthetic import SyntheticSource
from worker.overlap import Ahead, follow_on
from worker.runner import ModelRunner
from worker.sampler import SamplingParams

PAGE = 4  # the page size of helpers.ring's pools, which these tests borrow


def runner(sampling: dict[int, SamplingParams] | None = None, max_context: int = 64
           ) -> SimpleNamespace:
    """What `follow_on` reads of a ModelRunner: one stage holding the whole model, sequence 1 on
    two pages (8 positions), sequence 2 on one."""
    return SimpleNamespace(first=True, last=True, pool=SimpleNamespace(page_size=PAGE),
                           stage=SimpleNamespace(args=SimpleNamespace(max_context=max_context)),
                           tables={1: [5, 6], 2: [9]}, sampling=sampling or {})


def decode(*starts: tuple[int, int], step: int = 3) -> Step:
    return Step(step=step, seqs=[SeqPlan(id=i, start=s, n=1, sample=True) for i, s in starts],
                token_ids=[100 + i for i, _ in starts])


@pytest.mark.parametrize("sampling", [{}, {1: SamplingParams(temperature=0.8, seed=3)}])
def test_the_next_step_is_guessed_for_decoding_sequences_with_room_in_their_pages(sampling):
    # greedy, or drawn: the draw is made on the device, keyed by (seed, position)
    nxt = follow_on(decode((1, 5), (2, 1)), runner(sampling))
    assert [(s.id, s.start, s.n, s.sample) for s in nxt.seqs] == [(1, 6, 1, True), (2, 2, 1, True)]
    assert nxt.token_ids == [0, 0]  # the inputs stay on the device


@pytest.mark.parametrize("plan,who,start", [
    (decode((1, 6)), runner(), 7),  # position 7 is the last of its pages: it may go on
    (decode((2, 3)), runner(), None),  # position 4 needs a second page, only the coordinator's
    # a prompt's last chunk samples: its first decode row follows
    (Step(step=3, seqs=[SeqPlan(id=1, start=0, n=5, sample=True)], token_ids=[1] * 5), runner(),
     5),
    (Step(step=3, seqs=[SeqPlan(id=1, start=0, n=5)], token_ids=[1] * 5), runner(), None),
    (decode((1, 5)), SimpleNamespace(**{**vars(runner()), "last": False}), None),  # a split
])
def test_no_guess_without_room_for_the_next_position_or_for_a_chunk_or_a_split(plan, who,
                                                                              start):
    nxt = follow_on(plan, who)
    assert (nxt and [(s.id, s.start) for s in nxt.seqs]) == (start and [(1, start)])


@pytest.mark.parametrize("other", [
    SeqPlan(id=2, start=0, n=3),  # midway through its prompt
    SeqPlan(id=2, start=3, n=1, sample=True),  # position 4 needs a page the plan will give
])
def test_a_sequence_with_nothing_to_go_on_is_left_out_of_the_guess(other):
    plan = Step(step=3, seqs=[SeqPlan(id=1, start=5, n=1, sample=True), other],
                token_ids=[7] + [1] * other.n)
    assert [(s.id, s.start) for s in follow_on(plan, runner()).seqs] == [(1, 6)]


@pytest.mark.parametrize("change", [
    {},
    {"token_ids": [100, 7]},
    {"free": [4]},
    {"park": [PageMove(id=4, pages=[1], slots=[0])]},
    {"restore": [PageMove(id=4, pages=[1], slots=[0])]},
    {"copies": [PageCopy(src=1, dst=2)]},
    {"seqs": [SeqPlan(id=1, start=6, n=1, sample=True, sampling=Sampling()),
              SeqPlan(id=2, start=2, n=1, sample=True)]},
    {"seqs": [SeqPlan(id=1, start=6, n=1, sample=True)], "token_ids": [101]},
])
def test_only_the_plan_it_guessed_uses_a_step_enqueued_ahead(change):
    guessed = follow_on(decode((1, 5), (2, 1)), runner())
    ahead = Ahead(guessed, inputs=[101, 102], tokens=None, started=0.0)
    plan = decode((1, 6), (2, 2), step=4)
    plan.token_ids = [101, 102]
    for key, value in change.items():
        setattr(plan, key, value)
    assert ahead.matches(plan) == (not change)


def guessed_three() -> Ahead:
    """Sequences 1, 2 and 3 guessed at positions 6, 2 and 3 on the inputs 101, 102, 103."""
    plan = decode((1, 5), (2, 1), (3, 2))
    who = runner()
    who.tables[3] = [10]
    return Ahead(follow_on(plan, who), inputs=[101, 102, 103], tokens=None, started=0.0)


def test_a_plan_that_holds_part_of_a_guess_keeps_it_and_runs_the_rest():
    # 2 ended (freed) and 3 was not scheduled; a new prompt (4) and a prompt's next chunk (5)
    plan = Step(step=4, free=[2], token_ids=[103, 101, 1, 2, 3, 9], seqs=[
        SeqPlan(id=3, start=3, n=1, sample=True, pages_add=[11]),
        SeqPlan(id=1, start=6, n=1, sample=True),
        SeqPlan(id=4, start=0, n=3, pages_add=[12], sample=True, sampling=Sampling()),
        SeqPlan(id=5, start=8, n=1)])
    kept, rest = guessed_three().split(plan)
    assert [(i, s.id) for i, s in kept] == [(2, 3), (0, 1)]
    assert [s.id for s in rest.seqs] == [4, 5] and rest.token_ids == [1, 2, 3, 9]
    assert rest.free == [2] and rest.step == 4


@pytest.mark.parametrize("change", [
    {"park": [PageMove(id=4, pages=[1], slots=[0])]},
    {"restore": [PageMove(id=4, pages=[1], slots=[0])]},
    {"copies": [PageCopy(src=1, dst=2)]},
    {"free": [1]},  # a guessed sequence freed, and asked for again: a recompute
    {"seqs": [SeqPlan(id=1, start=0, n=7, sample=True)], "token_ids": [1] * 7},
    {"token_ids": [100]},  # another input than the guess's
    {"seqs": [SeqPlan(id=1, start=6, n=1, sample=True, sampling=Sampling())]},
    {"seqs": [SeqPlan(id=4, start=0, n=1, sample=True)]},  # nothing of the guess
])
def test_a_plan_that_asks_a_guessed_sequence_for_something_else_drops_the_guess(change):
    plan = Step(step=4, seqs=[SeqPlan(id=1, start=6, n=1, sample=True)], token_ids=[101])
    for key, value in change.items():
        setattr(plan, key, value)
    assert guessed_three().split(plan) is None


def test_no_part_of_a_guess_before_its_inputs_are_read():
    ahead = guessed_three()
    ahead.inputs = None
    assert ahead.split(Step(step=4, seqs=[SeqPlan(id=1, start=6, n=1, sample=True)],
                            token_ids=[101])) is None


def test_a_guessed_step_takes_the_pages_its_plan_adds_and_waits_for_its_inputs():
    guessed = follow_on(decode((1, 5), (2, 1)), runner())
    plan = decode((1, 6), (2, 2), step=4)
    plan.seqs[1].pages_add = [7]  # for later positions: the coordinator reserves them early
    plan.token_ids = [101, 102]
    assert Ahead(guessed, inputs=[101, 102], tokens=None, started=0.0).matches(plan)
    assert not Ahead(guessed, inputs=None, tokens=None, started=0.0).matches(plan)


def test_two_steps_ahead_only_on_a_cuda_device_with_device_kv():
    assert steps_ahead("auto", "cuda:0", "device") == STEPS_AHEAD == 2
    assert steps_ahead("auto", "cuda:0", "host") == 1 and steps_ahead("on", "cpu", "device") == 1
    assert steps_ahead("auto", "cpu", "device") == 0 == steps_ahead("off", "cuda:0", "device")


def test_no_guess_past_the_models_positions_though_its_pages_reach_further():
    # sequence 1's pages hold positions 0-7; a model of 7 positions ends at 6
    assert follow_on(decode((1, 6)), runner(max_context=7)) is None
    assert follow_on(decode((1, 5)), runner(max_context=7)).seqs[0].start == 6
    assert follow_on(decode((1, 6)), runner()).seqs[0].start == 7


def test_overlap_is_on_by_default_for_cuda_and_refuses_a_bad_setting():
    assert steps_ahead("auto", "cuda:0", "device") and not steps_ahead("auto", "cpu", "device")
    assert steps_ahead("on", "cpu", "device") and not steps_ahead("off", "cuda:0", "device")
    with pytest.raises(ValueError, match="--overlap must be one of auto, on, off"):
        WorkerConfig(overlap="yes").validate()



def plans_after_a_guess() -> list[Step]:
    """A (1), B (2) and E (4) prefill and decode two steps; guesses follow the second. Then A
    is freed and its pages, the last one holding the guesses' rows, go to a new sequence C (3),
    and E is parked, to be restored into other pages a step later."""
    return [
        Step(step=0, seqs=[SeqPlan(id=1, start=0, n=6, pages_add=[0, 1, 8], sample=True),
                           SeqPlan(id=2, start=0, n=6, pages_add=[2, 3, 13], sample=True),
                           SeqPlan(id=4, start=0, n=6, pages_add=[6, 7, 9], sample=True)]),
        Step(step=1, seqs=[SeqPlan(id=i, start=6, n=1, sample=True) for i in (1, 2, 4)]),
        Step(step=2, seqs=[SeqPlan(id=i, start=7, n=1, sample=True) for i in (1, 2, 4)]),
        Step(step=3, free=[1], park=[PageMove(id=4, pages=[6, 7, 9], slots=[0, 1, 2])],
             seqs=[SeqPlan(id=2, start=8, n=1, sample=True),
                   SeqPlan(id=3, start=0, n=5, pages_add=[0, 1, 8], sample=True)]),
        Step(step=4, seqs=[SeqPlan(id=2, start=9, n=1, sample=True),
                           SeqPlan(id=3, start=5, n=1, sample=True)],
             restore=[PageMove(id=4, pages=[10, 11, 12], slots=[0, 1, 2])]),
        *(Step(step=5 + k, seqs=[SeqPlan(id=2, start=10 + k, n=1, sample=True),
                                 SeqPlan(id=3, start=6 + k, n=1, sample=True),
                                 SeqPlan(id=4, start=8 + k, n=1, sample=True)])
          for k in range(2)),
    ]


def decode_run(kv: str, depth: int, guess: bool) -> list[tuple[torch.Tensor, list[int]]]:
    source = SyntheticSource("tiny")
    a = source.args
    stage = source.load_stage(0, a.n_layers, torch.float32, "cpu")
    device, host = pools(depth, delay_ms=0.3, n_pages=16,
                         shape=(a.n_layers, PAGE, a.n_kv_heads, a.head_dim))
    pool = host if kv == "host" else device
    runner = ModelRunner(stage, pool, ParkStore(pool, 4), "cpu")
    out = []
    for plan in plans_after_a_guess():
        plan.token_ids = [50 + 7 * plan.step + s.id + j for s in plan.seqs for j in range(s.n)]
        meta = runner.apply(plan)
        hidden = runner.forward(plan, meta, None)
        out.append((hidden, runner.sample(plan, meta, hidden)[1]))
        if guess and plan.step == 2:  # what a worker enqueues, and then drops
            nxt = plan
            for _ in range(STEPS_AHEAD):
                nxt = follow_on(nxt, runner)
                nxt_meta = runner.apply(nxt)
                inputs = torch.tensor([9 + s.id for s in nxt.seqs])  # whatever it guessed
                runner.draw(nxt, nxt_meta, runner.forward(nxt, nxt_meta, None, inputs))
    return out


@pytest.mark.parametrize("kv,depth", [("device", 0), ("host", 0), ("host", 1), ("host", 2)])
def test_dropped_guesses_leave_no_trace(kv, depth):
    """Their rows, past each context in pages that are then freed, reused, parked and
    restored, change no bit of any later step."""
    plain, guessed = decode_run("device", 0, False), decode_run(kv, depth, True)
    for step, ((h1, t1), (h2, t2)) in enumerate(zip(plain, guessed, strict=True)):
        assert torch.equal(h1, h2) and t1 == t2, f"step {step}"


def whole_model_executor(depth: int) -> tuple[StepExecutor, list, list[str]]:
    """An executor `depth` steps ahead over the whole tiny model and a pool of 16 pages; what it
    sends the coordinator, and each guess's outcome."""
    source = SyntheticSource("tiny")
    a = source.args
    stage = source.load_stage(0, a.n_layers, torch.float32, "cpu")
    device, _ = pools(0, delay_ms=0.0, n_pages=16,
                      shape=(a.n_layers, PAGE, a.n_kv_heads, a.head_dim))
    runner = ModelRunner(stage, device, ParkStore(device, 4), "cpu")
    sent, outcomes = [], []
    metrics = SimpleNamespace(forward=lambda seconds: None, ahead=outcomes.append)
    return StepExecutor(runner, 0, torch.float32, depth, metrics, sent.append, None), sent, \
        outcomes


def serve_decodes(depth: int) -> tuple[list[list[int]], list[str]]:
    """A worker's executor as the coordinator drives it: two sequences prefill, then decode on
    the tokens it sent back, given pages early (as the scheduler's lookahead does); at step 6
    sequence 2 ends and is freed, at step 7 sequence 3's prompt starts on its pages. Returns the
    tokens of each step and each guess's outcome."""
    ex, sent, outcomes = whole_model_executor(depth)
    ex.run(Step(step=0, seqs=[SeqPlan(id=1, start=0, n=5, pages_add=[0, 1], sample=True),
                              SeqPlan(id=2, start=0, n=5, pages_add=[2, 3], sample=True)],
                token_ids=[11, 12, 13, 14, 15, 21, 22, 23, 24, 25]), None)
    extra = {2: ([4], [5]), 5: ([6], [7]), 8: ([8], [])}  # step -> pages added to 1, 2
    for step in range(1, 11):
        ids = [1] if step >= 6 else [1, 2]
        add = extra.get(step, ([], []))
        last = dict(zip(sent[-1].seq_ids, sent[-1].tokens))
        plan = Step(step=step, free=[2] if step == 6 else [],
                    seqs=[SeqPlan(id=i, start=4 + step, n=1, pages_add=add[i - 1], sample=True)
                          for i in ids],
                    token_ids=[last[i] for i in ids])
        if step == 7:  # a new prompt, on pages sequence 2 held
            plan.seqs.append(SeqPlan(id=3, start=0, n=3, pages_add=[2, 3], sample=True))
            plan.token_ids += [31, 32, 33]
        elif step > 7:
            plan.seqs.append(SeqPlan(id=3, start=step - 5, n=1, sample=True))
            plan.token_ids.append(last[3])
        ex.run(plan, None)
        assert sent[-1].step == step and sent[-1].seq_ids == [s.id for s in plan.seqs]
    return [r.tokens for r in sent], outcomes


@pytest.mark.parametrize("depth,deepen_after,dropped", [
    (1, 2, 1), (STEPS_AHEAD, 2, STEPS_AHEAD), (STEPS_AHEAD, 100, 1)])
def test_steps_enqueued_ahead_give_the_tokens_of_plain_steps(monkeypatch, depth, deepen_after,
                                                             dropped):
    monkeypatch.setattr("worker.executor.DEEPEN_AFTER", deepen_after)
    plain, none = serve_decodes(0)
    tokens, outcomes = serve_decodes(depth)
    assert tokens == plain and not none
    # steps 1-5 were enqueued ahead and used (pages added or not), `depth` ahead from step 3 on
    # if two in a row suffice; at step 6 the plan freed a sequence: the guess's row for the other
    # was used, the guesses enqueued on the whole guess were dropped; at step 7 a new prompt
    # joined the guessed row; then the guesses held both sequences
    assert outcomes == (["used"] * 5 + ["partial"] + ["dropped"] * (dropped - 1) + ["partial"]
                        + ["used"] * 3)


def decodes_at_page_ends(depth: int) -> tuple[list[dict[int, int]], list[str]]:
    """Two sequences decoding whose pages are given only when a step needs them, as when
    prompts wait: each in turn reaches the end of its pages while the other has room. Returns
    each step's tokens by sequence and each guess's outcome."""
    ex, sent, outcomes = whole_model_executor(depth)
    ex.run(Step(step=0, seqs=[SeqPlan(id=1, start=0, n=5, pages_add=[0, 1], sample=True),
                              SeqPlan(id=2, start=0, n=3, pages_add=[2], sample=True)],
                token_ids=[11, 12, 13, 14, 15, 21, 22, 23]), None)
    pages = {(1, 8): [4], (2, 4): [3], (2, 8): [5]}  # (sequence, position) -> its next page
    for step in range(1, 8):
        last = dict(zip(sent[-1].seq_ids, sent[-1].tokens))
        seqs = [SeqPlan(id=i, start=start, n=1, sample=True, pages_add=pages.get((i, start), []))
                for i, start in ((1, 4 + step), (2, 2 + step))]
        ex.run(Step(step=step, seqs=seqs, token_ids=[last[1], last[2]]), None)
        assert sent[-1].step == step and sorted(sent[-1].seq_ids) == [1, 2]
    return [dict(zip(r.seq_ids, r.tokens)) for r in sent], outcomes


@pytest.mark.parametrize("depth", [1, STEPS_AHEAD])
def test_a_sequence_at_the_end_of_its_pages_leaves_the_rest_of_the_guess_standing(depth):
    plain, none = decodes_at_page_ends(0)
    tokens, outcomes = decodes_at_page_ends(depth)
    assert tokens == plain and not none
    # 2 ends its first page at step 1 and 1 its second at step 3: the guesses after them held
    # the other sequence alone, and their plans used them in part
    assert outcomes[:4] == ["used", "partial", "used", "partial"]
    assert "dropped" not in outcomes


def test_a_stage_of_a_layer_split_runs_plain_steps_whatever_its_overlap():
    source = SyntheticSource("tiny")
    a = source.args
    stage = source.load_stage(0, a.n_layers // 2, torch.float32, "cpu")
    device, _ = pools(0, delay_ms=0.0, n_pages=16,
                      shape=(a.n_layers // 2, PAGE, a.n_kv_heads, a.head_dim))
    runner = ModelRunner(stage, device, ParkStore(device, 4), "cpu")
    errors, forwarded = [], []
    ex = StepExecutor(runner, 0, torch.float32, STEPS_AHEAD,
                      SimpleNamespace(forward=lambda seconds: None, ahead=errors.append),
                      errors.append, lambda header, frames: forwarded.append(header.shape))
    ex.run(Step(step=0, seqs=[SeqPlan(id=1, start=0, n=3, pages_add=[0, 1], sample=True)],
                token_ids=[5, 6, 7]), None)
    for step in (1, 2, 3):
        ex.run(Step(step=step, seqs=[SeqPlan(id=1, start=2 + step, n=1, sample=True)],
                    token_ids=[8]), None)
    assert not errors and forwarded == [[3, a.dim], [1, a.dim], [1, a.dim], [1, a.dim]]
