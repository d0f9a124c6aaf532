"""The engine core's SUBMIT checks (coordinator/requests.py): a frontend is trusted to have
validated its clients' prompts, yet the core refuses a prompt frame that does not hold what the
header says or holds ids outside the vocabulary, and queues nothing for it."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from coordinator.metrics import CoordinatorMetrics
from coordinator.page_allocator import PageAllocator
from coordinator.requests import Requests, merged
from coordinator.scheduler import Scheduler
from protocol.messages import MAX_LIST, Failed, Finished, Outputs, Submit
from protocol.sampling import SamplingParams

VOCAB = 1000


def core() -> tuple[Requests, Scheduler, list]:
    sent = []
    scheduler = Scheduler(PageAllocator(64), PageAllocator(64), 16, 8, 64)
    frontends = SimpleNamespace(send=lambda frontend, msg, frames=(): sent.append(msg))
    return Requests(scheduler, frontends, CoordinatorMetrics(), 16, 16), scheduler, sent


def submit(requests: Requests, key: int, ids: list[int], n_prompt: int | None = None) -> None:
    msg = Submit(key=key, n_prompt=len(ids) if n_prompt is None else n_prompt,
                 sampling=SamplingParams(max_tokens=4), arrival=0.0, client="c")
    requests.submit(0, msg, memoryview(array("i", ids).tobytes()), VOCAB, None)


def test_a_prompt_of_ids_in_the_vocabulary_is_queued_as_sent():
    requests, scheduler, sent = core()
    submit(requests, 1, [0, 5, VOCAB - 1])
    assert not sent and [s.token_ids for s in scheduler.waiting] == [[0, 5, VOCAB - 1]]


@pytest.mark.parametrize("ids,n_prompt,why", [
    ([1, VOCAB], None, "outside the vocabulary"),
    ([-1, 2], None, "outside the vocabulary"),
    ([1, 2, 3], 2, "does not hold n_prompt ids"),
])
def test_a_bad_prompt_frame_is_refused_and_nothing_is_queued(ids, n_prompt, why):
    requests, scheduler, sent = core()
    submit(requests, 7, ids, n_prompt)
    (msg,) = sent
    assert msg.failed[0].key == 7 and why in msg.failed[0].message
    assert not scheduler.waiting and not len(requests)


def test_outputs_of_several_steps_merge_into_one_message_a_frontend_in_step_order():
    def sent(frontend, rows, finished=(), failed=()):
        frame = array("q", [x for row in rows for x in row]).tobytes()
        return frontend, Outputs(n_rows=len(rows), finished=list(finished),
                                 failed=list(failed)), frame

    ended, lost = Finished(1, 0, "stop", 0), Failed(9, "internal", "step failed")
    steps = [sent(0, [(1, 0, 11), (2, 0, 21)]), sent(1, [(5, 0, 51)]),
             sent(0, [(1, 0, 12), (2, 0, 22)], [ended]), sent(0, [(2, 0, 23)], failed=[lost])]
    out = merged(steps)
    assert [(f, m.n_rows, m.finished, m.failed, array("q", frame).tolist())
            for f, m, frame in out] == [
        (0, 5, [ended], [lost], [1, 0, 11, 2, 0, 21, 1, 0, 12, 2, 0, 22, 2, 0, 23]),
        (1, 1, [], [], [5, 0, 51]),
    ]


def test_merged_outputs_start_a_new_message_rather_than_pass_the_row_limit():
    big = Outputs(n_rows=MAX_LIST - 1)
    out = merged([(0, big, b"a"), (0, Outputs(n_rows=2), b"b"), (0, Outputs(n_rows=1), b"c")])
    assert [(m.n_rows, frame) for _, m, frame in out] == [(MAX_LIST - 1, b"a"), (3, b"bc")]
