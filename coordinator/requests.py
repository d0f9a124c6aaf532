"""The engine core's live requests, by (frontend, key): a frontend's `SUBMIT` becomes a
`Request` in the scheduler, a step's tokens and endings go back to their frontends as
`OUTPUTS`, and every request-level metric (tokens, queue time, TTFT, inter-token latency,
end-to-end latency, finish reasons, errors) is counted here."""

from __future__ import annotations

import time
from array import array
from collections import Counter

import numpy as np

from protocol.errors import ErrorCode
from protocol.messages import MAX_LIST, Cancel, Failed, Finished, Outputs, Report, Submit

from .frontends import FrontendGroup
from .metrics import CoordinatorMetrics
from .schedule import Schedule, StepOutput
from .scheduler import Scheduler
from .sequence import Request

PROMPT_ID = np.dtype(np.int32)  # a SUBMIT's prompt frame: its ids, as array("i") packs them


class Requests:
    def __init__(self, scheduler: Scheduler, frontends: FrontendGroup,
                 metrics: CoordinatorMetrics, max_waiting: int, max_queued_per_client: int):
        self.scheduler = scheduler
        self.frontends = frontends
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_queued_per_client = max_queued_per_client
        self.live: dict[tuple[int, int], Request] = {}
        self.queued: Counter[str] = Counter()  # requests not yet scheduled, by client

    def __len__(self) -> int:
        return len(self.live)

    def submit(self, frontend: int, msg: Submit, frame: memoryview, vocab_size: int,
               closed: tuple[ErrorCode, str] | None) -> None:
        """Queue a request, or refuse it: `closed` says why the core takes none now."""
        if len(frame) != PROMPT_ID.itemsize * msg.n_prompt:
            return self._refuse(frontend, msg.key, ErrorCode.INVALID_REQUEST,
                                "the prompt frame does not hold n_prompt ids")
        prompt = np.frombuffer(frame, dtype=PROMPT_ID)  # checked whole, not id by id
        if prompt.max() >= vocab_size or prompt.min() < 0:
            return self._refuse(frontend, msg.key, ErrorCode.INVALID_REQUEST,
                                "the prompt has ids outside the vocabulary")
        if closed is not None:
            return self._refuse(frontend, msg.key, *closed)
        if (frontend, msg.key) in self.live:
            return self._refuse(frontend, msg.key, ErrorCode.INVALID_REQUEST,
                                f"request key {msg.key} is already in use")
        if len(self.scheduler.waiting) >= self.max_waiting:
            return self._refuse(frontend, msg.key, ErrorCode.OVERLOADED,
                                "too many requests are queued")
        if self.queued[msg.client] >= self.max_queued_per_client:
            return self._refuse(frontend, msg.key, ErrorCode.OVERLOADED,
                                f"this client has {self.max_queued_per_client} requests queued "
                                "already (--max-queued-per-client)")
        req = Request(frontend=frontend, key=msg.key, params=msg, prompt_ids=prompt.tolist(),
                      arrival=msg.arrival, client=msg.client, prompt_bytes=bytes(frame))
        self.queued[msg.client] += 1
        self.scheduler.add_request(req)
        self.live[(frontend, msg.key)] = req
        self.metrics.prompt_tokens.inc(len(prompt) * msg.sampling.n)

    def _refuse(self, frontend: int, key: int, code: ErrorCode, message: str) -> None:
        self.metrics.request_errors.labels(code=code.value).inc()
        self.frontends.send(frontend, Outputs(failed=[Failed(key, code.value, message)]), [b""])

    def cancel(self, frontend: int, msg: Cancel) -> None:
        """A stop string ended a choice, or the client aborted or went away. The frontend hears
        back a `Finished` for each choice a stop ends (with its preemptions)."""
        req = self.live.get((frontend, msg.key))
        if req is None:
            return
        ended = [s for s in req.seqs if msg.index in (-1, s.index)
                 and self.scheduler.finish(s, msg.reason)]
        if msg.reason == "abort":
            self.metrics.request_errors.labels(code=ErrorCode.ABORTED.value).inc()
            self._forget(req)
            return
        self.frontends.send(frontend, Outputs(finished=[
            Finished(req.key, s.index, s.finish_reason, s.preemptions) for s in ended]), [b""])
        if req.finished:
            self._close(req)

    def report(self, msg: Report) -> None:
        """Counts only a frontend saw: requests it refused, client messages it dropped."""
        for code, count in msg.errors.items():
            if code in ErrorCode._value2member_map_ and isinstance(count, int) and count > 0:
                self.metrics.request_errors.labels(code=code).inc(count)
        if msg.dropped:
            self.metrics.dropped_messages.labels(socket="client").inc(msg.dropped)
        if msg.rejected:
            self.metrics.rejected.labels(socket="client").inc(msg.rejected)

    def _abort(self, req: Request) -> None:
        """End every choice of `req` before its time and forget it (not counted as finished)."""
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        self._forget(req)

    def fail(self, req: Request, code: ErrorCode, message: str) -> None:
        self._abort(req)
        self.metrics.request_errors.labels(code=code.value).inc()
        self.frontends.send(req.frontend, Outputs(failed=[Failed(req.key, code.value, message)]),
                            [b""])

    def fail_all(self, code: ErrorCode, message: str) -> None:
        for req in list(self.live.values()):
            self.fail(req, code, message)

    def drop_frontend(self, frontend: int) -> None:
        """A frontend died: its requests end (their clients hear nothing more)."""
        lost = [r for r in self.live.values() if r.frontend == frontend]
        for req in lost:
            self._abort(req)
        self.metrics.request_errors.labels(code=ErrorCode.ABORTED.value).inc(len(lost))

    def scheduled(self, sched: Schedule, now: float) -> None:
        for seq, _ in sched.batch:
            if seq.request.scheduled_time is None:
                seq.request.scheduled_time = now
                self._dequeue(seq.request)
                self.metrics.queue.observe(now - seq.request.arrival)

    def _forget(self, req: Request) -> None:
        if self.live.pop((req.frontend, req.key), None) is not None and \
                req.scheduled_time is None:
            self._dequeue(req)

    def _dequeue(self, req: Request) -> None:
        """`req` leaves its client's queued count (scheduled, or ended before it was)."""
        self.queued[req.client] -= 1
        if self.queued[req.client] <= 0:
            del self.queued[req.client]

    def outputs(self, out: StepOutput, now: float) -> list[tuple[int, Outputs, bytes]]:
        """Each frontend's share of a step: rows of (key, index, token), then what ended, as
        (frontend, message, frame) for the caller to send. Counted and closed here and now, so
        that a cancel that comes before they are sent finds its request ended."""
        self.metrics.generation_tokens.inc(len(out.tokens))
        rows: dict[int, array] = {}
        touched: dict[int, Request] = {}
        for seq, token in out.tokens:
            req = seq.request
            rows.setdefault(req.frontend, array("q")).extend((req.key, seq.index, token))
            touched[id(req)] = req
        gaps: dict[float, int] = {}  # since each stream's last token: most share theirs
        for req in touched.values():  # once per step, so `n` choices do not time each other
            if req.first_token_time is None:
                req.first_token_time = now
                self.metrics.ttft.observe(now - req.arrival)
            else:
                gap = now - req.last_token_time
                gaps[gap] = gaps.get(gap, 0) + 1
            req.last_token_time = now
        for gap, count in gaps.items():
            self.metrics.itl.observe(gap, count)
        finished: dict[int, list[Finished]] = {}
        for seq in out.finished:
            req = seq.request
            finished.setdefault(req.frontend, []).append(
                Finished(req.key, seq.index, seq.finish_reason, seq.preemptions))
            if req.finished:
                self._close(req)
        sends = []
        for frontend in rows.keys() | finished.keys():
            frame = rows.get(frontend, array("q"))
            sends.append((frontend, Outputs(n_rows=len(frame) // 3,
                                            finished=finished.get(frontend, [])),
                          frame.tobytes()))
        return sends

    def _close(self, req: Request) -> None:
        """Every choice of `req` has ended: count it, forget it."""
        self._forget(req)
        self.metrics.e2e.observe(time.monotonic() - req.arrival)
        for seq in req.seqs:
            self.metrics.requests.labels(finish_reason=seq.finish_reason).inc()
            self.metrics.request_preemptions.observe(seq.preemptions)


def merged(sends: list[tuple[int, Outputs, bytes]]) -> list[tuple[int, Outputs, bytes]]:
    """`Requests.outputs` of several steps, one message a frontend: rows in step order, then
    every ending. A choice's rows all come before its ending (nothing is planned for it after
    the step that ends it), so the frontend reads the merged message as it reads the steps'."""
    if len(sends) < 2:
        return sends
    out: list[tuple[int, Outputs, list[bytes]]] = []
    last: dict[int, tuple[int, Outputs, list[bytes]]] = {}  # each frontend's open message
    for frontend, msg, frame in sends:
        into = last.get(frontend)
        if into is None or into[1].n_rows + msg.n_rows > MAX_LIST:
            last[frontend] = into = (frontend, msg, [frame])
            out.append(into)
            continue
        first = into[1]
        first.n_rows += msg.n_rows
        first.finished = first.finished + msg.finished
        first.failed = first.failed + msg.failed
        into[2].append(frame)
    return [(frontend, msg, b"".join(frames)) for frontend, msg, frames in out]
