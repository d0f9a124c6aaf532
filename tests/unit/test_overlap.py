"""Steps taken ahead (worker/overlap.py): rows planned on a token still in flight take the token
the worker drew last, on its device, and give the tokens of plans that name it; rows computed
for nothing change no later bit; a row on a token the worker did not draw fails alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from protocol.messages import PageMove, SeqPlan, Step, StepError, StepResult
from protocol.worker_config import STEPS_AHEAD, WorkerConfig, steps_ahead
from worker.build import build_runner, load_stage, make_pool
from worker.executor import StepExecutor
from worker.loaders import resolve

PAGE = 4  # tokens a page, as the plans' page tables assume


def test_steps_ahead_two_on_a_cuda_device_with_device_kv_else_one():
    assert steps_ahead("auto", "cuda:0", "device") == STEPS_AHEAD == 2
    assert steps_ahead("auto", "cuda:0", "host") == 1 and steps_ahead("on", "cpu", "device") == 1
    assert steps_ahead("auto", "cpu", "device") == 0 == steps_ahead("off", "cuda:0", "device")


def test_overlap_is_on_by_default_for_cuda_and_refuses_a_bad_setting():
    assert steps_ahead("auto", "cuda:0", "device") and not steps_ahead("auto", "cpu", "device")
    assert steps_ahead("on", "cpu", "device") and not steps_ahead("off", "cuda:0", "device")
    with pytest.raises(ValueError, match="--overlap must be one of auto, on, off"):
        WorkerConfig(overlap="yes").validate()



def plans_past_an_end() -> list[Step]:
    """A (1), B (2) and E (4) prefill and decode two steps, and a step is planned past the end of
    each (as past a stop token); then A is freed and its pages, the last one holding that row,
    go to a new sequence C (3), and E is parked, to be restored into other pages a step later."""
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


def decode_run(kv: str, depth: int, wasted: bool) -> list[tuple[torch.Tensor, list[int]]]:
    stage = load_stage("synthetic:tiny", torch.float32, "cpu")
    pool = make_pool(stage, 16, PAGE, "cpu", kv=kv, depth=depth, slot_layers=1, delay_ms=0.3)
    runner = build_runner(stage, pool, "cpu", park_pages=4)
    out = []
    for plan in plans_past_an_end():
        plan.token_ids = [50 + 7 * plan.step + s.id + j for s in plan.seqs for j in range(s.n)]
        meta = runner.apply(plan)
        hidden = runner.forward(plan, meta, None)
        out.append((hidden, runner.sample(plan, meta, hidden)[1]))
        if wasted and plan.step == 2:  # rows planned ahead whose results are dropped
            for k in range(STEPS_AHEAD):
                nxt = Step(step=plan.step, token_ids=[0] * 3, seqs=[
                    SeqPlan(id=i, start=8 + k, n=1, sample=True, after=True) for i in (1, 2, 4)])
                nxt_meta = runner.apply(nxt)
                runner.draw(nxt, nxt_meta, runner.forward(nxt, nxt_meta, None))
    return out


@pytest.mark.parametrize("kv,depth", [("device", 0), ("host", 0), ("host", 1), ("host", 2)])
def test_rows_computed_for_nothing_leave_no_trace(kv, depth):
    """Their rows, past each context in pages that are then freed, reused, parked and
    restored, change no bit of any later step."""
    plain, wasted = decode_run("device", 0, False), decode_run(kv, depth, True)
    for step, ((h1, t1), (h2, t2)) in enumerate(zip(plain, wasted, strict=True)):
        assert torch.equal(h1, h2) and t1 == t2, f"step {step}"


def whole_model_executor(ahead: int) -> tuple[StepExecutor, list, list[str]]:
    """An executor over the whole tiny model and a pool of 16 pages, taking plans `ahead`; what
    it sends the coordinator, and where each step was enqueued."""
    stage = load_stage("synthetic:tiny", torch.float32, "cpu")
    runner = build_runner(stage, make_pool(stage, 16, PAGE, "cpu"), "cpu", park_pages=4)
    sent, outcomes = [], []
    metrics = SimpleNamespace(forward=lambda seconds: None, ahead=outcomes.append)
    return StepExecutor(runner, 0, torch.float32, ahead, metrics, sent.append, None), sent, \
        outcomes


def serve_decodes(ahead: bool) -> list[dict[int, int]]:
    """Sequences 1 and 2 prefill, then decode, on the tokens each result sent back or (ahead)
    on the tokens drawn last; sequence 2 is left out of step 3 and planned at step 4 on the
    token of step 2; at step 6 it ends and is freed, at step 7 sequence 3's prompt starts on its
    pages beside sequence 1's row. Returns each step's tokens by sequence."""
    ex, sent, outcomes = whole_model_executor(STEPS_AHEAD if ahead else 0)
    ex.run(Step(step=0, seqs=[SeqPlan(id=1, start=0, n=5, pages_add=[0, 1], sample=True),
                              SeqPlan(id=2, start=0, n=5, pages_add=[2, 3], sample=True)],
                token_ids=[11, 12, 13, 14, 15, 21, 22, 23, 24, 25]), None)
    pos = {1: 5, 2: 5}
    pages = {(1, 8): [4], (2, 8): [5], (1, 12): [6]}
    for step in range(1, 10):
        last = {}
        for r in sent:
            last.update(zip(r.seq_ids, r.tokens))
        ids = [1] if step == 3 or step >= 6 else [1, 2]
        plan = Step(step=step, free=[2] if step == 6 else [], seqs=[], token_ids=[])
        for i in ids + ([3] if step >= 7 else []):
            if i == 3 and step == 7:  # a new prompt, on pages sequence 2 held
                plan.seqs.append(SeqPlan(id=3, start=0, n=3, pages_add=[2, 3], sample=True))
                plan.token_ids += [31, 32, 33]
                pos[3] = 3
                continue
            plan.seqs.append(SeqPlan(id=i, start=pos[i], n=1, sample=True, after=ahead,
                                     pages_add=pages.get((i, pos[i]), [])))
            plan.token_ids.append(0 if ahead else last[i])
            pos[i] += 1
        ex.run(plan, None)
        assert sent[-1].step == step and sent[-1].seq_ids == [s.id for s in plan.seqs]
    assert outcomes == (["idle"] * 10 if ahead else [])  # a CPU's steps end as they are run
    return [dict(zip(r.seq_ids, r.tokens)) for r in sent]


def test_rows_planned_on_the_tokens_drawn_last_give_the_tokens_of_plans_that_name_them():
    assert serve_decodes(True) == serve_decodes(False)


def test_a_row_on_a_token_the_worker_did_not_draw_fails_its_sequence_alone():
    ex, sent, _ = whole_model_executor(1)
    ex.run(Step(step=0, seqs=[SeqPlan(id=1, start=0, n=2, pages_add=[0], sample=True)],
                token_ids=[11, 12]), None)
    ex.run(Step(step=1, seqs=[SeqPlan(id=2, start=0, n=1, pages_add=[1], sample=True,
                                      after=True)], token_ids=[0]), None)
    assert isinstance(sent[-1], StepError) and sent[-1].seq_ids == [2]
    # a step that failed leaves no token to plan on: a row after it fails too, not silently
    # on the token drawn before
    ex.run(Step(step=2, seqs=[SeqPlan(id=1, start=2, n=1, sample=True, pages_add=[99])],
                token_ids=[5]), None)
    assert isinstance(sent[-1], StepError) and sent[-1].seq_ids == [1]
    ex.run(Step(step=3, seqs=[SeqPlan(id=1, start=2, n=1, sample=True, after=True)],
                token_ids=[0]), None)
    assert isinstance(sent[-1], StepError) and sent[-1].seq_ids == [1]
    ex.run(Step(step=4, seqs=[SeqPlan(id=1, start=2, n=1, sample=True)], token_ids=[5]), None)
    assert isinstance(sent[-1], StepResult) and sent[-1].seq_ids == [1]


def test_a_stage_of_a_layer_split_runs_plain_steps_whatever_its_overlap():
    source = resolve("synthetic:tiny")
    a = source.args
    stage = load_stage(source, torch.float32, "cpu", layers=(0, a.n_layers // 2))
    runner = build_runner(stage, make_pool(stage, 16, PAGE, "cpu"), "cpu", park_pages=4)
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
