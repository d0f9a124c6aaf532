"""The engine core: schedule -> plan -> dispatch -> apply results, and supervision.

One thread owns the worker ROUTER and the frontends' ROUTER; it speaks token ids and finish
reasons only (text and clients are the frontends', `coordinator/frontend.py`). Each turn: read
what arrived (step results through the scheduler, then the frontends' requests), dispatch as
many plans as may be in flight (one per pipeline stage), and only then send each frontend its
step outputs, then check the workers and frontends. Nothing a frontend or worker sends can
raise out of the loop.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import zmq

from protocol import security, wire
from protocol.busy_poll import BusyPoller, busy_seconds
from protocol.errors import ErrorCode
from protocol.messages import (
    Cancel,
    Heartbeat,
    Outputs,
    Ready,
    Register,
    Report,
    Serve,
    Status,
    StatusReply,
    StepError,
    StepResult,
    Submit,
)
from protocol.wire import MAX_MESSAGE_BYTES
from protocol.worker_config import steps_ahead

from .config import CoordinatorConfig
from .frontends import FrontendGroup
from .metrics import CoordinatorMetrics
from .page_allocator import PageAllocator
from .plan import step_frames
from .prefix_cache import PrefixCache
from .requests import Requests, merged
from .run_dir import RunDir
from .schedule import Schedule
from .scheduler import Scheduler
from .status import cluster_status
from .worker_group import StartupError, WorkerGroup

log = logging.getLogger("siding.coordinator")

# Worker deaths are found within 2 s and frontends' within 10 s. Every wake costs tens of
# microseconds of CPU (a poll, the heartbeats): the idle loop wakes a few times a second.
SUPERVISE_SECONDS = 0.5
# How long the loop waits for the rest of a group whose held results have come (they are sent
# back to back; longer only where a step of the group failed and the rest still run).
GROUP_WAIT_MS = 2


@dataclass
class InFlight:
    sched: Schedule
    sent: float
    hold: bool  # its result comes just before that of a later step (Step.hold)


class EngineCore:
    def __init__(self, config: CoordinatorConfig, metrics: CoordinatorMetrics | None = None):
        self.config = config
        self.metrics = metrics or CoordinatorMetrics()
        for ep in [config.worker_listen, *config.client_endpoints()]:
            security.check_bind(ep, config.curve_keys, config.insecure)
        self.ctx = zmq.Context()
        self.run_dir = RunDir()
        # The worker links (this socket, and the workers' activation sockets) always need keys
        # (or --insecure): the cluster's own, or for workers it starts itself, keys made for
        # this run only, so that no other process on the machine can join or inject into them.
        link_keys = config.curve_keys
        if link_keys is None and config.spawn_workers:
            link_keys = str(security.generate_keys(self.run_dir.path / "links"))
        self.worker_sock = self.ctx.socket(zmq.ROUTER)
        self.worker_sock.setsockopt(zmq.LINGER, 0)
        self.worker_sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.auth = self.rejections = None
        if link_keys:
            self.auth = security.secure_server(self.worker_sock, link_keys)
            self.rejections = security.RejectionCounter(
                self.worker_sock, self.metrics.rejected.labels(socket="worker").inc)
        try:
            self.worker_sock.bind(config.worker_listen)
        except zmq.ZMQError as e:
            reason = e.strerror.partition(" (addr=")[0]  # the endpoint is named already
            raise OSError(f"--worker-listen {config.worker_listen}: cannot listen there: "
                          f"{reason}") from None
        self.workers = WorkerGroup(self.worker_sock, config, link_keys)
        self.frontends = FrontendGroup(self.ctx, config, self.run_dir.path)
        if config.http is not None:
            self.metrics.serve_frontends(self.frontends.metrics_socket)
        # how the loop waits: --busy-poll, auto resolved once the workers' devices are known
        self.busy = BusyPoller(0.0)
        self.heard = False  # a message besides heartbeats since the last poll (`_poll`)
        w = config.worker
        pool = PageAllocator(w.kv_pages)
        cache = None
        if config.prefix_cache:  # keyed by all that changes a page's bits besides its tokens
            cache = PrefixCache(pool, w.page_size, f"{w.model}|{w.dtype}|exact={w.exact}")
            self.metrics.watch_prefix_cache(cache)
        # A worker that is the whole pipeline takes steps planned on the tokens of those before
        # it, still in flight (docs/overlap-scheduling.md), in groups of --multi-step answered
        # at once; a layer split runs one step a stage.
        ahead = steps_ahead(w.overlap, config.devices[0], w.kv) if config.workers == 1 else 0
        self.group = config.multi_step
        self.max_in_flight = self.group * (1 + ahead) if config.workers == 1 else config.workers
        self.scheduler = Scheduler(pool, PageAllocator(w.park_pages), w.page_size,
                                   w.max_batch_seqs, w.max_batch_tokens,
                                   config.preempt_every, config.prefill_hold_ms / 1000, cache,
                                   plan_ahead=bool(ahead) or self.group > 1)
        self.requests = Requests(self.scheduler, self.frontends, self.metrics,
                                 config.max_waiting, config.max_queued_per_client)
        self.inflight: dict[int, InFlight] = {}
        # step outputs applied but not yet sent to the frontends: sent once the next plans are
        # out, (frontend, message, frame)
        self.unsent: list[tuple[int, Outputs, bytes]] = []
        self.next_step = 0
        self.group_open = False  # a group's held results came, its last one not yet
        self.forward_seconds = [0.0, 0]  # the last stage's forward time: sum, steps
        self.draining = False
        self.outage_reason: str | None = None  # why the workers are down, while they are
        self.outage_since: float | None = None  # when the workers went down, while they are
        self.retry_at: float | None = None  # when halted workers are started again
        self.model = None
        self.metrics.kv_pages_total.set(config.worker.kv_pages)
        self.poll_all = self._poller()
        self.poll_frontends = self._poller(workers=False)
        self.poll_workers = self._poller(frontends=False)  # while no other plan may go out

    @property
    def endpoint(self) -> str:
        """The client endpoints, comma-separated (one per frontend)."""
        return self.frontends.client_endpoints

    # ---- start and stop ---------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the frontends and local workers (if configured); return once every worker is
        READY and every frontend listens."""
        self.frontends.spawn_all()
        self.workers.begin()
        while not (self.workers.ready and self.frontends.serving):
            self._poll(self.poll_all, 200)
            if not self.workers.ready:
                self.workers.check_startup()
            for h in self.frontends.dead():
                raise StartupError(f"frontend {h.index} stopped during start-up")

    def _on_workers_ready(self) -> None:
        self.model = self.workers.model
        self.scheduler.set_model(frozenset(self.model.eos_ids), self.model.max_context)
        w = self.config.worker
        self.busy.seconds = busy_seconds(w.busy_poll, self.workers.devices)
        self.frontends.serve(Serve(model=self.model, kv_pages=w.kv_pages, page_size=w.page_size,
                                   exact=w.exact, busy_poll=self.busy.seconds))
        self.metrics.workers_up.set(self.workers.n_up)
        self.metrics.serving(self.model.name)
        self.outage_since = self.outage_reason = None
        log.info("%d workers ready", self.workers.n_up)

    def close(self) -> None:
        self.frontends.stop()
        self.workers.stop_local()
        if self.rejections is not None:
            self.rejections.stop()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)
        self.run_dir.remove()

    def serve(self, should_stop=lambda: False, drain_seconds: float = 30.0,
              hurry=lambda: False) -> None:
        """Serve until should_stop() turns true, then drain for up to drain_seconds, or until
        hurry() turns true; the requests still running then are aborted.

        While no step is in flight the loop does not wake for the workers (only heartbeats can
        come), and while no other plan may go out, not for the frontends (`_poll`); supervision
        reads the socket not waited on twice a second."""
        gc.freeze()  # what start-up made lives on: collections need not scan it again
        drain_deadline = 0.0
        last_check = 0.0
        while True:
            if should_stop() and not self.draining:
                self.draining = True
                drain_deadline = time.monotonic() + drain_seconds
                log.info("draining %d requests", len(self.requests))
            if self.draining and (not self.requests or time.monotonic() > drain_deadline
                                  or hurry()):
                self.requests.fail_all(ErrorCode.ABORTED, "the server is shutting down")
                return
            idle_device = self.scheduler.has_work and not self.inflight
            poller = self.poll_frontends if not self.inflight else \
                self.poll_all if self._room() else self.poll_workers
            self._poll(poller, 0 if idle_device else round(SUPERVISE_SECONDS * 1000))
            if self.scheduler.has_work:
                self._dispatch()
            now = time.monotonic()
            if now - last_check > SUPERVISE_SECONDS:
                last_check = now
                self._supervise(now)
                self.metrics.set_gauges(self.scheduler, self.workers.n_up)

    def _poller(self, workers: bool = True, frontends: bool = True) -> zmq.Poller:
        poller = zmq.Poller()
        if workers:
            poller.register(self.worker_sock, zmq.POLLIN)
        if frontends:
            poller.register(self.frontends.sock, zmq.POLLIN)
        return poller

    def _room(self) -> bool:
        """Whether another group of plans may go out now."""
        return len(self.inflight) + self.group <= self.max_in_flight

    def _poll(self, poller: zmq.Poller, timeout_ms: int) -> None:
        """Wait for messages and handle them. While as many plans are in flight as may be, the
        loop waits for the workers only: what the frontends send then is read once a result
        makes room, before the next plan (or at the next supervision), so that each request,
        cancel or status costs no wake of its own (a wake of this loop costs ~100 us of CPU
        cold on a busy 2-core machine, docs/benchmarks.md) and waits for nothing it could have
        had sooner."""
        events = self.busy.poll(poller, timeout_ms)
        self.heard = False
        if self.worker_sock in events:
            self._drain(self.worker_sock, "worker", self._on_worker)
            # the rest of a group, sent back to back, is microseconds behind: one wake for all
            while self.group_open and self.worker_sock.poll(GROUP_WAIT_MS):
                self._drain(self.worker_sock, "worker", self._on_worker)
        if self.frontends.sock in events or (poller is self.poll_workers and self._room()):
            self._drain(self.frontends.sock, "frontend", self._on_frontend)
        if events and not self.heard:  # the frontends' heartbeats of an idle cluster
            self.busy.signs_of_life()
        self._send_outputs()

    def _send_outputs(self) -> None:
        """Where results ended steps, the next plans go out (with the requests that arrived
        meanwhile) before the frontends hear of the results: a worker waits on its plan, a
        client's stream can wait the plan's encoding and send."""
        if not self.unsent:
            return
        if self.scheduler.has_work:
            self._dispatch()
        unsent, self.unsent = merged(self.unsent), []
        for frontend, msg, frame in unsent:
            self.frontends.send(frontend, msg, [frame])

    def _drain(self, sock: zmq.Socket, where: str, handle) -> None:
        def guarded(identity: bytes, msg, frames) -> None:
            try:
                handle(identity, msg, frames)
            except StartupError:
                raise
            except Exception:  # a bug must not take the loop down; say so loudly
                log.exception("failed to handle %s from a %s", type(msg).__name__, where)

        wire.drain(sock, guarded, lambda identity, e: self._dropped(where, e))

    def _dropped(self, where: str, e: Exception) -> None:
        self.metrics.dropped_messages.labels(socket=where).inc()
        log.warning("dropped a malformed %s message: %s", where, e)

    # ---- frontends --------------------------------------------------------------------------

    def _on_frontend(self, identity: bytes, msg, frames) -> None:
        self.heard |= not isinstance(msg, Heartbeat)
        h = self.frontends.note(identity, msg)
        if h is None:
            return
        if isinstance(msg, Submit):
            closed = (ErrorCode.OVERLOADED, "the server is shutting down") if self.draining \
                else None
            self.requests.submit(h.index, msg, frames[0], self.model.vocab_size, closed)
        elif isinstance(msg, Cancel):
            self.requests.cancel(h.index, msg)
        elif isinstance(msg, Status):
            self.frontends.send(h.index, StatusReply(status=cluster_status(
                self.config, self.model, self.scheduler, self.workers, self.frontends,
                self.metrics, self.forward_seconds, self.outage_reason, self.draining)))
        elif isinstance(msg, Report):
            self.requests.report(msg)

    # ---- scheduling and dispatch ------------------------------------------------------------

    def _dispatch(self) -> None:
        """Send plans while there is room, a group at a time: each step of a group but its last
        holds its result (`Step.hold`), so the worker answers the group at once."""
        if not self.workers.ready:
            return
        while self._room():
            group, dry = self._plan_group()
            now = time.monotonic()
            for i, sched in enumerate(group):
                hold = i < len(group) - 1
                self.requests.scheduled(sched, now)
                self._count_preemptions(sched)
                self.workers.send_frames(step_frames(self.next_step, sched, hold))
                self.inflight[self.next_step] = InFlight(sched, now, hold)
                self.next_step += 1
            if dry:
                return

    def _plan_group(self) -> tuple[list[Schedule], bool]:
        """Up to `group` steps planned back to back, and whether the scheduler ran out of work
        before the group was full. A group ends early at a step whose only tokens are first
        ones (nothing else was decoding): on an idle server a request's first token is not held
        for a group, and the next group is planned ahead behind it."""
        group: list[Schedule] = []
        while len(group) < self.group:
            sched = self.scheduler.next_step()
            if not sched:
                return group, True
            group.append(sched)
            if sched.only_first_tokens:
                break
        return group, False

    def _count_preemptions(self, sched: Schedule) -> None:
        if not (sched.parks or sched.recomputed or sched.restores):
            return  # most steps
        m = self.metrics
        page_bytes = self.workers.kv_bytes_per_page
        m.preemptions.labels(action="park").inc(len(sched.parks))
        m.preemptions.labels(action="recompute").inc(len(sched.recomputed))
        m.restores.inc(len(sched.restores))
        m.park_bytes.labels(direction="out").inc(
            sum(len(x.pages) for x in sched.parks) * page_bytes)
        m.park_bytes.labels(direction="in").inc(
            sum(len(x.pages) for x in sched.restores) * page_bytes)

    # ---- workers ----------------------------------------------------------------------------

    def _on_worker(self, identity: bytes, msg, frames) -> None:
        self.heard |= not isinstance(msg, Heartbeat)
        if not self.workers.ready:
            self.workers.on_startup_message(identity, msg)
            if self.workers.ready:
                self._on_workers_ready()
            return
        handle = self.workers.note(identity, msg)
        if handle is None:
            if isinstance(msg, Register):  # it registers again every few seconds meanwhile
                log.debug("a worker registered while every rank is up (rank %d)", msg.rank)
            else:  # a worker this group lost, or one of a coordinator before this one
                self.workers.reset(identity, "this coordinator does not count on you")
            return
        if isinstance(msg, StepResult):
            self._on_result(msg)
        elif isinstance(msg, StepError):
            self._on_step_error(msg)
        elif isinstance(msg, Ready):
            log.warning("unexpected READY from worker %d", msg.rank)

    def _on_result(self, msg: StepResult) -> None:
        rec = self.inflight.pop(msg.step, None)
        if rec is None:
            return
        self.group_open = rec.hold
        now = time.monotonic()
        self.metrics.step_seconds.observe(now - rec.sent)
        self.forward_seconds[0] += msg.forward_seconds
        self.forward_seconds[1] += 1
        if msg.park_seconds:
            self.metrics.park_seconds.observe(msg.park_seconds)
        out = self.scheduler.update_from_output(rec.sched, msg.seq_ids, msg.tokens)
        if out.ahead_used or out.ahead_dropped:
            self.metrics.ahead_used.inc(out.ahead_used)
            self.metrics.ahead_dropped.inc(out.ahead_dropped)
        self.unsent += self.requests.outputs(out, now)

    def _on_step_error(self, msg: StepError) -> None:
        rec = self.inflight.pop(msg.step, None)
        log.error("step %d failed: %s", msg.step, msg.message)
        if rec is None:
            return
        failed, recomputed = self.scheduler.fail_step(rec.sched, msg.seq_ids)
        self.metrics.preemptions.labels(action="recompute").inc(len(recomputed))
        for req in {id(s.request): s.request for s in failed}.values():
            self.requests.fail(req, ErrorCode.INTERNAL, msg.message)

    # ---- supervision ------------------------------------------------------------------------

    def _supervise(self, now: float) -> None:
        if not self.inflight:  # the loop did not poll the workers: read their heartbeats
            self._drain(self.worker_sock, "worker", self._on_worker)
        elif not self._room():  # nor the frontends
            self._drain(self.frontends.sock, "frontend", self._on_frontend)
        self._send_outputs()
        self.frontends.beat(now)
        for h in self.frontends.dead():
            self.requests.drop_frontend(h.index)
            self.frontends.restart(h)
        if self.outage_since is not None:
            self._fail_overdue(now)
        try:
            if self.retry_at is not None:
                if now >= self.retry_at:
                    self.retry_at = None
                    log.info("starting the workers again")
                    self.workers.begin()
                return
            if not self.workers.ready:
                self.workers.check_startup()
                return
            dead = self.workers.dead()
            stuck = [step for step, rec in self.inflight.items()
                     if now - rec.sent > self.config.step_timeout]
            if not dead and not stuck:
                return
            ranks = ", ".join(str(h.rank) for h in dead) or f"(step {stuck[0]} stuck)"
            self._restart_workers(now, f"worker {ranks} stopped")
        except StartupError as e:  # try again, however often it takes
            self._restart_workers(now, str(e), at_least=1.0)

    def _restart_workers(self, now: float, reason: str, at_least: float = 0.0) -> None:
        """Restart the workers (local ones: new processes; remote ones: every worker registers
        again, a lost one once its supervisor restarts it), at once or after a backoff; every
        sequence recomputes."""
        delay = max(at_least, self.workers.note_restart(now))
        log.error("%s; restarting the workers%s, sequences will recompute", reason,
                  f" in {delay:.0f} s" if delay else "")
        self.outage_since = self.outage_since or now
        self.outage_reason = f"{reason}; waiting for the workers"
        self.inflight.clear()
        self.metrics.preemptions.labels(action="recompute").inc(self.scheduler.recompute_all())
        if delay:
            self.workers.halt(reason)
            self.retry_at = now + delay
        else:
            self.workers.restart(reason)

    def _fail_overdue(self, now: float) -> None:
        """While the workers are down, a request fails once it has waited --worker-wait
        seconds for them (from its arrival or the outage's start, whichever is later)."""
        wait = self.config.worker_wait
        for req in list(self.requests.live.values()):
            if now - max(req.arrival, self.outage_since) > wait:
                self.requests.fail(req, ErrorCode.WORKER_FAILED,
                                   f"no workers to run it for {wait:g} s")
