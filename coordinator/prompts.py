"""Large prompts tokenized off the frontend's loop, so that one client's megabyte of text never
holds back anyone else's tokens, keepalives or the heartbeats the core watches.

A prompt of up to `INLINE_CHARS` characters is tokenized on the loop (well under a millisecond).
A larger one goes to a thread of its own, which takes the clients in turn (one prompt each, round
robin) so that a client with many large prompts does not queue ahead of another's one. The
tokenizer releases the GIL while it works (`TextCodec.encode`): a 1M-character prompt takes
about 3 s of one core, and the loop keeps turning meanwhile. The thread has its own
`TextCodec`, so the two share nothing of the tokenizer. Finished prompts wake the loop through
an inproc socket.

A large prompt may be submitted after a small one its client sent later; each is still one
request with its own id.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import zmq

from protocol.errors import ErrorCode, RequestError
from protocol.messages import Generate, ModelInfo
from protocol.wire import ChunkFrames

from .admission import prompt_ids
from .text import TextCodec

INLINE_CHARS = 1 << 14  # characters of text tokenized on the loop; past this, on the thread
MAX_PER_CLIENT = 16  # large prompts one client may have waiting; past this, `overloaded`


def text_chars(msg: Generate) -> int:
    """Characters of text the request's prompt needs tokenized (0: token ids)."""
    if msg.messages is not None:
        return sum(len(m.content) for m in msg.messages)
    return len(msg.prompt or "")


@dataclass(eq=False)
class PromptJob:
    client: bytes  # the client's ROUTER identity
    msg: Generate
    arrival: float
    last_sent: float  # when the client last heard of it (keepalives)
    keepalive: list[bytes] = field(init=False)
    cancelled: bool = False
    prompt: list[int] | None = None
    error: RequestError | None = None

    def __post_init__(self) -> None:
        self.keepalive = ChunkFrames(self.msg.request_id, 0).encode([])


class PromptTokenizer:
    def __init__(self, ctx: zmq.Context, model: ModelInfo):
        self.model = model
        self.pending: dict[tuple[bytes, str], PromptJob] = {}  # (client, request id) -> job
        self._queues: OrderedDict[bytes, deque[PromptJob]] = OrderedDict()  # guarded by _lock
        self._done: deque[PromptJob] = deque()
        self._lock = threading.Condition()
        self._closed = False
        self._endpoint = f"inproc://prompts-{id(self):x}"
        self.ready = ctx.socket(zmq.PULL)  # the loop polls it; one empty message per finished job
        self.ready.setsockopt(zmq.LINGER, 0)
        self.ready.bind(self._endpoint)
        self._thread = threading.Thread(target=self._run, args=(ctx,), name="prompts",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: PromptJob) -> None:
        mine = sum(1 for c, _ in self.pending if c == job.client)
        if mine >= MAX_PER_CLIENT:
            raise RequestError(ErrorCode.OVERLOADED, f"{mine} large prompts of this client are "
                               f"already being tokenized; the limit is {MAX_PER_CLIENT}")
        self.pending[(job.client, job.msg.request_id)] = job
        with self._lock:
            self._queues.setdefault(job.client, deque()).append(job)
            self._lock.notify()

    def cancel(self, client: bytes, request_id: str | None = None) -> list[PromptJob]:
        """Forget a client's job (`request_id`), or all of them: they are dropped once done."""
        jobs = [j for (c, r), j in self.pending.items()
                if c == client and (request_id is None or r == request_id)]
        for job in jobs:
            job.cancelled = True
            del self.pending[(client, job.msg.request_id)]
        return jobs

    def finished(self) -> list[PromptJob]:
        """Jobs tokenized since the last call (the cancelled ones left out)."""
        while True:
            try:
                self.ready.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._lock:
            done, self._done = list(self._done), deque()
        out = []
        for job in done:
            if not job.cancelled:
                del self.pending[(job.client, job.msg.request_id)]
                out.append(job)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=5)
        self.ready.close(0)

    def _next(self) -> PromptJob | None:
        """The next job, one client's at a time in turn; None once closed."""
        with self._lock:
            while not self._queues and not self._closed:
                self._lock.wait()
            if self._closed:
                return None
            client, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            del self._queues[client]
            if queue:
                self._queues[client] = queue  # to the back of the turn
            return job

    def _run(self, ctx: zmq.Context) -> None:
        codec = TextCodec(self.model)
        wake = ctx.socket(zmq.PUSH)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._endpoint)
        try:
            while (job := self._next()) is not None:
                if not job.cancelled:
                    try:
                        job.prompt = prompt_ids(job.msg, codec)
                    except RequestError as e:
                        job.error = e
                with self._lock:
                    self._done.append(job)
                wake.send(b"")
        finally:
            wake.close(0)
