"""The serving loop: client messages in, plans out to the workers, results back to clients.

One thread owns both ROUTER sockets. Each turn: read what arrived, schedule and dispatch as many
plans as may be in flight (one per pipeline stage), then check worker health and client
liveness. Nothing a client or worker sends can raise out of the loop: bad input becomes an
`Error` reply or a dropped, counted message.
"""

from __future__ import annotations

import errno
import logging
import secrets
import time
from dataclasses import asdict, dataclass

import zmq

from protocol import security
from protocol.errors import ErrorCode, ProtocolError, RequestError
from protocol.messages import (
    Abort,
    Chunk,
    Error,
    Generate,
    PageCopy,
    PageMove,
    Ready,
    Register,
    SeqPlan,
    Status,
    StatusReply,
    Step,
    StepError,
    StepResult,
)
from protocol.messages import Sampling as SamplingMsg
from protocol.wire import MAX_MESSAGE_BYTES, decode, encode

from .admission import check_fits, prompt_ids
from .config import CoordinatorConfig
from .metrics import CoordinatorMetrics
from .output import append_token, final_result, stream_chunks
from .page_allocator import PageAllocator
from .scheduler import Schedule, Scheduler
from .sequence import Request, Sequence
from .text import Detokenizer, TextCodec
from .worker_group import StartupError, WorkerGroup

log = logging.getLogger("siding.coordinator")

KEEPALIVE_SECONDS = 1.0
MAX_RESTARTS = 3  # worker restarts within RESTART_WINDOW before the cluster gives up
RESTART_WINDOW = 60.0
CLIENT_HWM = 100_000  # queued replies per client before it counts as not reading


@dataclass
class InFlight:
    sched: Schedule
    sent: float


class Engine:
    def __init__(self, config: CoordinatorConfig, metrics: CoordinatorMetrics | None = None):
        self.config = config
        self.metrics = metrics or CoordinatorMetrics()
        for ep in (config.listen, config.worker_listen):
            security.check_bind(ep, config.curve_keys, config.insecure)
        self.ctx = zmq.Context()
        self.auth = None
        self.clients = self._router(config.listen)
        self.clients.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.worker_sock = self._router(config.worker_listen)
        self.workers = WorkerGroup(self.worker_sock, config)
        self.requests: dict[tuple[bytes, str], Request] = {}
        self.inflight: dict[int, InFlight] = {}
        self.to_free: list[int] = []
        self.next_step = 0
        self.next_seq = 0
        self.decode_steps = 0
        self.forward_seconds = [0.0, 0]  # the last stage's forward time: sum, steps
        self.draining = False
        self.restarts: list[float] = []
        self.failed: str | None = None  # set when the cluster can no longer serve
        self.codec: TextCodec | None = None
        self.allocator = PageAllocator(config.kv_pages)
        self.park_slots = PageAllocator(config.park_pages)
        self.scheduler = Scheduler(self.allocator, self.park_slots, config.page_size,
                                   config.max_batch_seqs, config.max_batch_tokens)
        self.page_bytes = 0  # KV bytes of one page summed over every worker's layers
        self.metrics.kv_pages_total.set(config.kv_pages)

    def _router(self, endpoint: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        s.setsockopt(zmq.SNDHWM, CLIENT_HWM)
        if self.config.curve_keys:
            auth = security.secure_server(s, self.config.curve_keys)
            self.auth = self.auth or auth
        s.bind(endpoint)
        return s

    @property
    def endpoint(self) -> str:
        return self.clients.getsockopt_string(zmq.LAST_ENDPOINT)

    # ---- start and stop ---------------------------------------------------------------------

    def start(self) -> None:
        """Spawn local workers (if configured) and wait until every one is READY."""
        self.workers.begin()
        while not self.workers.ready:
            got = self._recv_worker(200)
            if got is not None:
                self.workers.on_startup_message(*got)
            self.workers.check_startup()
        self._on_workers_ready()

    def _recv_worker(self, timeout_ms: int):
        if not self.worker_sock.poll(timeout_ms):
            return None
        parts = self.worker_sock.recv_multipart(copy=False)
        try:
            msg, _ = decode(parts[1:])
        except ProtocolError as e:
            self._dropped("worker", e)
            return None
        self.workers.note(parts[0].bytes, msg)
        return parts[0].bytes, msg

    def _on_workers_ready(self) -> None:
        self.model = self.workers.model
        self.page_bytes = self.workers.kv_bytes_per_page
        if self.codec is None:
            self.codec = TextCodec(self.model)
        self.metrics.workers_up.set(self.workers.n_up)
        log.info("%d workers ready", self.workers.n_up)

    def close(self) -> None:
        self.workers.stop_local()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)

    def serve(self, should_stop=lambda: False, drain_seconds: float = 30.0) -> None:
        """Serve until should_stop() turns true, then drain for up to drain_seconds."""
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.worker_sock, zmq.POLLIN)
        drain_deadline = None
        last_check = 0.0
        while True:
            if should_stop() and not self.draining:
                self.draining = True
                drain_deadline = time.monotonic() + drain_seconds
                log.info("draining %d requests", len(self.requests))
            if self.draining and (not self.requests or time.monotonic() > drain_deadline):
                for req in list(self.requests.values()):
                    self._fail(req, ErrorCode.ABORTED, "the server is shutting down")
                return
            busy = bool(self.scheduler.waiting or self.scheduler.running)
            can_dispatch = busy and len(self.inflight) < self._max_inflight()
            events = dict(poller.poll(0 if can_dispatch and not self.inflight else 20))
            if self.worker_sock in events:
                self._drain(self.worker_sock, self._on_worker)
            if self.clients in events:
                self._drain(self.clients, self._on_client)
            self._dispatch()
            now = time.monotonic()
            if now - last_check > 0.1:
                last_check = now
                self._check_workers()
                self._keepalive(now)
                self._update_gauges()

    def _drain(self, sock: zmq.Socket, handle) -> None:
        for _ in range(1000):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = parts[0].bytes
            try:
                msg, frames = decode(parts[1:])
            except ProtocolError as e:
                self._dropped("client" if sock is self.clients else "worker", e)
                if sock is self.clients:
                    self._send(identity, Error(code=e.code, message=e.message))
                continue
            try:
                handle(identity, msg)
            except Exception:  # a bug must not take the loop down; say so loudly
                log.exception("failed to handle %s", type(msg).__name__)
                if sock is self.clients:
                    rid = getattr(msg, "request_id", None)
                    self.metrics.request_errors.labels(code="internal").inc()
                    self._send(identity, Error(code="internal", message="internal error",
                                               request_id=rid))

    def _dropped(self, where: str, e: Exception) -> None:
        self.metrics.dropped_messages.labels(socket=where).inc()
        log.warning("dropped a malformed %s message: %s", where, e)

    # ---- clients ----------------------------------------------------------------------------

    def _on_client(self, identity: bytes, msg) -> None:
        if isinstance(msg, Generate):
            try:
                self._admit(identity, msg)
            except RequestError as e:
                self.metrics.request_errors.labels(code=e.code).inc()
                self._send(identity, Error(code=e.code, message=e.message,
                                           request_id=msg.request_id))
        elif isinstance(msg, Abort):
            req = self.requests.get((identity, msg.request_id))
            if req is not None:
                self._fail(req, ErrorCode.ABORTED, "aborted by the client")
        elif isinstance(msg, Status):
            self._send(identity, StatusReply(status=self.status()))
        else:
            self._dropped("client", ProtocolError(f"{type(msg).__name__} is not a client message"))
            self._send(identity, Error(code="invalid_request",
                                       message=f"{type(msg).__name__} is not a client message"))

    def _admit(self, identity: bytes, msg: Generate) -> None:
        msg.check()
        if self.draining:
            raise RequestError(ErrorCode.OVERLOADED, "the server is shutting down")
        if self.failed:
            raise RequestError(ErrorCode.WORKER_FAILED, self.failed)
        if (identity, msg.request_id) in self.requests:
            raise RequestError(ErrorCode.INVALID_REQUEST,
                               f"request id {msg.request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise RequestError(ErrorCode.OVERLOADED, "too many requests are queued")
        prompt = prompt_ids(msg, self.codec)
        check_fits(prompt, msg, self.model, self.config.kv_pages, self.config.page_size)
        req = Request(id=msg.request_id, client=identity, params=msg, prompt_ids=prompt)
        seed = msg.seed if msg.seed is not None else secrets.randbits(62)
        for i in range(msg.n):
            seq = Sequence(
                id=self.next_seq, request=req, index=i, token_ids=list(prompt),
                seed=seed if i == 0 else (seed + i * 0x9E3779B97F4A7C15) % (1 << 62),
                detok=Detokenizer(self.codec, prompt),
            )
            self.next_seq += 1
            req.seqs.append(seq)
        parent = req.seqs[0]
        self.scheduler.add(parent)
        if msg.n > 1 and len(prompt) > 1:  # the prompt is computed once and shared
            parent.fork_at, parent.children = len(prompt) - 1, req.seqs[1:]
        else:
            for seq in req.seqs[1:]:
                self.scheduler.add(seq)
        self.requests[(identity, msg.request_id)] = req
        self.metrics.prompt_tokens.inc(len(prompt) * msg.n)

    def _send(self, identity: bytes, msg) -> bool:
        """Send to a client; a client that is gone or not reading loses its requests."""
        try:
            self.clients.send_multipart([identity, *encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
            for req in [r for r in self.requests.values() if r.client == identity]:
                self._finish_request(req, notify=False)
                self.metrics.request_errors.labels(code="aborted").inc()
            log.info("client %s went away; its requests were aborted", identity.hex())
            return False

    def _keepalive(self, now: float) -> None:
        for req in list(self.requests.values()):
            if now - req.last_keepalive >= KEEPALIVE_SECONDS:
                req.last_keepalive = now
                self._send(req.client, Chunk(request_id=req.id))

    def status(self) -> dict:
        c = self.config
        return {
            "model": self.model.name if self.codec else None,
            "exact": c.exact,
            "workers": self._workers_status(),
            "workers_up": self.workers.n_up,
            **self.metrics.figures(),
            "pool": {"page_size": c.page_size, "pages_total": c.kv_pages,
                     "pages_used": self.allocator.n_used, "pages_free": self.allocator.n_free},
            "park": {"slots_total": self.park_slots.n_pages, "slots_used": self.park_slots.n_used},
            "requests": {"running": len(self.scheduler.running),
                         "waiting": len(self.scheduler.waiting),
                         "parked": len(self.scheduler.parked)},
            "config": {k: v for k, v in asdict(c).items() if k != "curve_keys"},
        }

    def _workers_status(self) -> list[dict]:
        workers = self.workers.describe()
        total, steps = self.forward_seconds
        for w in workers:  # only the last stage reports its forward time to the coordinator
            last = w["rank"] == len(workers) - 1
            w["forward_seconds_mean"] = total / steps if last and steps else None
        return workers

    # ---- scheduling and dispatch ------------------------------------------------------------

    def _max_inflight(self) -> int:
        return len(self.workers.handles) or 1

    def _dispatch(self) -> None:
        if self.failed or not self.workers.ready:
            return
        while len(self.inflight) < self._max_inflight():
            if self._preempt_due():
                if self.inflight:
                    return  # let the pipeline drain: every running sequence is parked at once
                if self._preempt_all():
                    continue
            sched = self.scheduler.schedule()
            if not sched:
                if not self.inflight and self._make_room():
                    continue
                return
            self._send_step(sched)

    def _make_room(self) -> bool:
        """Nothing fits and nothing runs (pages shared between `n` completions do not come
        back when one holder leaves): preempt the worst sequence so the others can grow."""
        victim = self.scheduler.pick_victim()
        if victim is None:
            return False
        sched = Schedule()
        self.scheduler.preempt(victim, sched)
        self._send_step(sched)
        return True

    def _preempt_due(self) -> bool:
        """--preempt-every K: K decode steps since the last park of everyone. With several stages
        some step is nearly always in flight, so a due park holds new steps back until none is,
        rather than waiting for a moment that may not come."""
        k = self.config.preempt_every
        return bool(k) and self.decode_steps >= k

    def _preempt_all(self) -> bool:
        """Park every running sequence (restored by the next schedule, into other pages)."""
        self.decode_steps = 0
        sched = Schedule()
        for seq in [s for s in self.scheduler.running if s.pages]:
            self.scheduler.preempt(seq, sched)
        if not sched:
            return False
        self._send_step(sched)
        return True

    def _send_step(self, sched: Schedule) -> None:
        plans, tokens = [], []
        for seq, n in sched.batch:
            seq.in_flight = True
            sampling = None
            if not seq.announced:
                p = seq.request.params
                sampling = SamplingMsg(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                       seed=seq.seed)
                seq.announced = True
            plans.append(SeqPlan(id=seq.id, start=seq.n_computed, n=n,
                                 pages_add=seq.pages[seq.pages_sent:],
                                 sample=seq.n_computed + n == len(seq.token_ids),
                                 sampling=sampling))
            seq.pages_sent = len(seq.pages)
            tokens.extend(seq.token_ids[seq.n_computed:seq.n_computed + n])
            if seq.request.scheduled_time is None:
                seq.request.scheduled_time = time.monotonic()
                self.metrics.queue.observe(seq.request.scheduled_time - seq.request.arrival)
        for seq in sched.recomputed:
            self.to_free.append(seq.id)
        self._count_preemptions(sched)
        step = self.next_step
        self.next_step += 1
        self.workers.send(Step(
            step=step, seqs=plans, token_ids=tokens, free=self.to_free,
            park=[PageMove(id=m.seq.id, pages=m.pages, slots=m.slots) for m in sched.parks],
            restore=[PageMove(id=m.seq.id, pages=m.pages, slots=m.slots)
                     for m in sched.restores],
            copies=[PageCopy(src=a, dst=b) for a, b in sched.copies],
        ))
        self.to_free = []
        if sched.batch and all(n == 1 for _, n in sched.batch):
            self.decode_steps += 1
        self.inflight[step] = InFlight(sched, time.monotonic())

    def _count_preemptions(self, sched: Schedule) -> None:
        m = self.metrics
        m.preemptions.labels(action="park").inc(len(sched.parks))
        m.preemptions.labels(action="recompute").inc(len(sched.recomputed))
        m.restores.inc(len(sched.restores))
        m.park_bytes.labels(direction="out").inc(
            sum(len(x.pages) for x in sched.parks) * self.page_bytes)
        m.park_bytes.labels(direction="in").inc(
            sum(len(x.pages) for x in sched.restores) * self.page_bytes)

    # ---- workers ----------------------------------------------------------------------------

    def _on_worker(self, identity: bytes, msg) -> None:
        if not self.workers.ready:
            self.workers.on_startup_message(identity, msg)
            if self.workers.ready:
                self._on_workers_ready()
            return
        handle = self.workers.note(identity, msg)
        if handle is None:
            if isinstance(msg, Register):
                log.warning("a worker registered after start-up (rank %d); ignored", msg.rank)
            return
        if isinstance(msg, StepResult):
            self._on_result(msg)
        elif isinstance(msg, StepError):
            self._on_step_error(msg)
        elif isinstance(msg, Ready):
            log.warning("unexpected READY from worker %d", msg.rank)

    def _on_step_error(self, msg: StepError) -> None:
        """The sequences a worker named fail; the rest of the step recompute from their tokens,
        since how far each stage got with the step is unknown."""
        rec = self.inflight.pop(msg.step, None)
        log.error("step %d failed: %s", msg.step, msg.message)
        if rec is None:
            return
        sched = rec.sched
        involved = [s for s, _ in sched.batch] + [m.seq for m in sched.parks + sched.restores]
        for seq in involved:
            seq.in_flight = False
        for seq in dict.fromkeys(involved):
            if seq.request.finished or (seq.request.client, seq.request.id) not in self.requests:
                continue
            if not msg.seq_ids or seq.id in msg.seq_ids:
                self._fail(seq.request, ErrorCode.INTERNAL, msg.message)
            else:
                self.scheduler.recompute(seq)
                self.to_free.append(seq.id)
                self.metrics.preemptions.labels(action="recompute").inc()

    def _on_result(self, msg: StepResult) -> None:
        rec = self.inflight.pop(msg.step, None)
        if rec is None:
            return
        self.metrics.step_seconds.observe(time.monotonic() - rec.sent)
        self.forward_seconds[0] += msg.forward_seconds
        self.forward_seconds[1] += 1
        if msg.park_seconds:
            self.metrics.park_seconds.observe(msg.park_seconds)
        sampled = dict(zip(msg.seq_ids, msg.tokens))
        touched: dict[int, Request] = {}
        for seq, n in rec.sched.batch:
            seq.in_flight = False
            if seq.finish_reason is not None or seq.request.finished:
                continue
            seq.n_computed += n
            if seq.fork_at == seq.n_computed:
                self.scheduler.fork(seq)
            if seq.id in sampled:
                self._append(seq, sampled[seq.id])
                touched[id(seq.request)] = seq.request
        for req in touched.values():
            if (req.client, req.id) in self.requests:
                self._token_times(req)
                self._emit(req)

    def _token_times(self, req: Request) -> None:
        """Once per step that gave `req` tokens, so its `n` choices do not time each other."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now

    def _append(self, seq: Sequence, token: int) -> None:
        self.metrics.generation_tokens.inc()
        if append_token(seq, token, self.codec.eos_ids, self.model.max_context):
            self.scheduler.remove(seq)
            self.to_free.append(seq.id)

    def _emit(self, req: Request) -> None:
        """Stream what is new, and send the result once every sequence has finished."""
        if req.params.stream:
            for chunk in stream_chunks(req):
                req.last_keepalive = time.monotonic()
                if not self._send(req.client, chunk):
                    return
        if req.finished:
            self._send(req.client, final_result(req))
            self._finish_request(req)

    def _finish_request(self, req: Request, notify: bool = True) -> None:
        self.requests.pop((req.client, req.id), None)
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            if seq.pages or seq.park_slots or self.scheduler.holds(seq):
                self.scheduler.remove(seq)
                self.to_free.append(seq.id)
        if notify:
            now = time.monotonic()
            self.metrics.e2e.observe(now - req.arrival)
            for seq in req.seqs:
                self.metrics.requests.labels(finish_reason=seq.finish_reason).inc()
                self.metrics.request_preemptions.observe(seq.preemptions)

    def _fail(self, req: Request, code: ErrorCode, message: str) -> None:
        self._finish_request(req, notify=False)
        self.metrics.request_errors.labels(code=code.value).inc()
        self._send(req.client, Error(code=code.value, message=message, request_id=req.id))

    def _check_workers(self) -> None:
        if self.failed:
            return
        try:
            if not self.workers.ready:
                self.workers.check_startup()
                return
            now = time.monotonic()
            dead = self.workers.dead()
            stuck = [step for step, rec in self.inflight.items()
                     if now - rec.sent > self.config.step_timeout]
            if not dead and not stuck:
                return
            ranks = ", ".join(str(h.rank) for h in dead) or f"(step {stuck[0]} stuck)"
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW] + [now]
            if not self.config.spawn_workers or len(self.restarts) > MAX_RESTARTS:
                raise StartupError(f"worker {ranks} stopped")
            log.error("worker %s stopped; restarting the workers, sequences will recompute",
                      ranks)
            self._recompute_all()
            self.workers.restart()
        except StartupError as e:
            self.failed = f"{e}; the cluster cannot serve"
            log.error(self.failed)
            self.inflight.clear()
            for req in list(self.requests.values()):
                self._fail(req, ErrorCode.WORKER_FAILED, self.failed)

    def _recompute_all(self) -> None:
        """Every sequence's KV is gone with the workers: re-run their tokens from scratch."""
        self.inflight.clear()
        every = list(self.scheduler.parked) + self.scheduler.running
        for seq in sorted(every, key=lambda s: (s.request.arrival, s.id), reverse=True):
            seq.in_flight = False  # appendleft: the oldest ends up first
            self.scheduler.recompute(seq)
            self.metrics.preemptions.labels(action="recompute").inc()
        self.to_free = []  # the new workers start with empty page tables

    def _update_gauges(self) -> None:
        m = self.metrics
        m.requests_running.set(len(self.scheduler.running))
        m.requests_waiting.set(len(self.scheduler.waiting))
        m.kv_pages_used.set(self.allocator.n_used)
        m.park_pages_used.set(self.park_slots.n_used)
        m.requests_parked.set(len(self.scheduler.parked))
        m.workers_up.set(self.workers.n_up)
