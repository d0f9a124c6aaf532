"""The engine core's SUBMIT checks (coordinator/requests.py): a frontend is trusted to have
validated its clients' prompts, yet the core refuses a prompt frame that does not hold what the
header says or holds ids outside the vocabulary, and queues nothing for it."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from coordinator.metrics import CoordinatorMetrics
from coordinator.page_allocator import PageAllocator
from coordinator.requests import Requests
from coordinator.scheduler import Scheduler
from protocol.messages import Submit

VOCAB = 1000


def core() -> tuple[Requests, Scheduler, list]:
    sent = []
    scheduler = Scheduler(PageAllocator(64), PageAllocator(64), 16, 8, 64)
    frontends = SimpleNamespace(send=lambda frontend, msg, frames=(): sent.append(msg))
    return Requests(scheduler, frontends, CoordinatorMetrics(), 16, 16), scheduler, sent


def submit(requests: Requests, key: int, ids: list[int], n_prompt: int | None = None) -> None:
    msg = Submit(key=key, n_prompt=len(ids) if n_prompt is None else n_prompt, max_tokens=4,
                 arrival=0.0, client="c")
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
