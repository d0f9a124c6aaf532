"""The worker process: register, be assigned a place, build it (`build.py`), then run plans in
step order (`executor.py`) as their inputs arrive.

Sockets: a DEALER to the coordinator for control and results, a PULL bound for the previous
stage's activations, a PUSH to the next stage. Heartbeats go on a socket of their own from a
thread, so a long model load or a long step never looks like a dead worker.

A worker outlives its coordinator: ZeroMQ reconnects (backing off up to RECONNECT_MAX_MS), a
worker still waiting for its ASSIGN registers again every REGISTER_SECONDS, and a coordinator
that does not count on this worker (it restarted, or lost this worker for a while and regrouped
without it) answers its heartbeats with RESET, on which the worker starts over: it executes
itself again, registers and loads what it is assigned.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque

import torch
import zmq

from protocol import security
from protocol.busy_poll import BusyPoller
from protocol.errors import ProtocolError
from protocol.help_formatter import HelpFormatter
from protocol.messages import (
    Activations,
    Assign,
    Heartbeat,
    Ready,
    Register,
    Reset,
    Shutdown,
    Step,
    StepError,
)
from protocol.wire import MAX_MESSAGE_BYTES, decode, encode

from .build import build, model_info
from .executor import StepExecutor
from .metrics import WorkerMetrics

log = logging.getLogger("siding.worker")

HEARTBEAT_SECONDS = 0.5  # the coordinator's deadline is 2 s; each beat wakes it
REGISTER_SECONDS = 5.0  # REGISTER again this often until assigned (the coordinator may restart)
RECONNECT_MAX_MS = 5000  # ZeroMQ's reconnect backoff to a coordinator that went away
NEXT_STAGE_SECONDS = 2.0  # a next stage that takes no activations this long is lost


class Worker:
    def __init__(self, coordinator: str, rank: int, device: str, advertise: str,
                 curve_keys: str | None, insecure: bool, exit_with_parent: bool):
        security.check_links(curve_keys, insecure)
        security.check_bind(f"tcp://{advertise}:0", curve_keys, insecure)
        self.coordinator = coordinator
        self.advertise = advertise  # the activation and metrics sockets bind here
        self.requested_rank = rank
        self.device = device
        self.curve_keys = curve_keys
        self.ctx = zmq.Context()
        self.ctl = self._dealer()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.auth = security.secure_server(self.pull, curve_keys) if curve_keys else None
        self.metrics: WorkerMetrics | None = None
        self.rejected = 0  # peers refused before the metrics exist
        if curve_keys:
            security.RejectionCounter(self.pull, self._rejected)  # for the process's life
        port = self.pull.bind_to_random_port(f"tcp://{advertise}")
        self.data_endpoint = f"tcp://{advertise}:{port}"
        self.push: zmq.Socket | None = None
        self.parent = os.getppid() if exit_with_parent else None
        self.stop = threading.Event()
        self.last_result = 0.0  # time.monotonic() of the last step's message, a sign of life
        self.plans: deque[Step] = deque()
        self.arrived: dict[int, Activations | tuple[Activations, torch.Tensor]] = {}
        self.rank = -1
        self.first = False  # the first stage: no activations come in (set by _load)
        self.dtype: torch.dtype | None = None
        self.executor: StepExecutor | None = None
        self.busy = BusyPoller(0.0)  # how it waits for plans (--busy-poll; set by _load)
        self.reset_reason: str | None = None  # a RESET the heartbeat thread received

    def _rejected(self) -> None:
        log.warning("refused a peer of the activation socket: it lacks the cluster's keys")
        if self.metrics is None:
            self.rejected += 1
        else:
            self.metrics.reject()

    def _dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        if self.curve_keys:
            security.secure_client(s, self.curve_keys)
        s.connect(self.coordinator)
        return s

    # ---- start-up ---------------------------------------------------------------------------

    def run(self) -> None:
        assign = self._wait_assign()
        self.rank = assign.rank
        threading.Thread(target=self._heartbeat, daemon=True).start()
        try:
            ready = self._load(assign)
        except Exception as e:
            message = str(e) or type(e).__name__
            log.error("worker %d failed to load: %s", self.rank, message)
            self.ctl.send_multipart(encode(StepError(step=0, code="internal", message=message)))
            time.sleep(0.2)
            raise SystemExit(1) from None
        self.ctl.send_multipart(encode(ready))
        self._serve()

    def _wait_assign(self) -> Assign:
        registered = 0.0
        while not self.stop.is_set():
            if time.monotonic() - registered >= REGISTER_SECONDS:
                registered = time.monotonic()
                self.ctl.send_multipart(encode(Register(
                    rank=self.requested_rank, device=self.device, pid=os.getpid(),
                    hostname=socket.gethostname(), data_endpoint=self.data_endpoint,
                )))
            if self.ctl.poll(500):
                msg = self._recv(self.ctl)
                if isinstance(msg, Assign):
                    return msg
                if isinstance(msg, Shutdown):
                    raise SystemExit(0)
            self._check_parent()
        raise SystemExit(0)

    def _start_over(self, reason: str) -> None:
        """RESET: run this worker afresh (same command line), which registers again. A process
        image of its own rather than state unwound by hand: the pool, the graphs, the ring's
        streams and every socket start clean. Nothing is torn down first (ZeroMQ's context
        aborts when destroyed under its monitor and heartbeat threads): the exec closes every
        descriptor, ZeroMQ opens them close-on-exec."""
        log.warning("worker %d: the coordinator regroups (%s); registering again", self.rank,
                    reason or "no reason given")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "worker", *sys.argv[1:]])

    def _load(self, a: Assign) -> Ready:
        t0 = time.perf_counter()
        metrics = WorkerMetrics(a.rank, self.device, a.config.pipeline_depth, a.config.exact)
        metrics.reject(self.rejected)
        self.metrics = metrics
        if a.metrics_port is not None:
            try:
                self.metrics.serve(a.metrics_port, self.advertise)
            except OSError as e:
                raise RuntimeError(f"cannot serve metrics on {self.advertise}:"
                                   f"{a.metrics_port}: {e.strerror}") from None
        layers = None
        if a.layer_start is not None and a.layer_end is not None:
            layers = (a.layer_start, a.layer_end)
        built = build(a.config, a.rank, a.n_workers, self.device, metrics, layers)
        if a.next_endpoint:
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 0)
            self.push.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected next stage
            self.push.setsockopt(zmq.SNDTIMEO, round(NEXT_STAGE_SECONDS * 1000))
            if self.curve_keys:
                security.secure_client(self.push, self.curve_keys)
            self.push.connect(a.next_endpoint)
        self.first, self.dtype = built.runner.first, built.dtype
        self.busy.seconds = built.busy_seconds
        self.executor = StepExecutor(built.runner, a.rank, built.dtype, built.steps_ahead, metrics,
                                     self._to_coordinator,
                                     self._to_next if self.push is not None else None)
        start, end = built.layers
        log.info("worker %d: layers [%d, %d) of %s on %s in %.1fs", a.rank, start, end,
                 built.source.name, self.device, time.perf_counter() - t0)
        return Ready(rank=a.rank, layer_start=start, layer_end=end, device=self.device,
                     kv_bytes_per_page=built.kv_bytes_per_page,
                     model=model_info(built.source) if a.rank == 0 else None)

    # ---- serving ----------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        while not self.stop.is_set():
            if self.reset_reason is not None:
                self._start_over(self.reset_reason)
            ex = self.executor
            # With steps on the device, spin: the next plan is enqueued as it comes and each
            # step's tokens go as they land (worker/overlap.py); without, for --busy-poll.
            events = self.busy.poll(poller, 0 if ex.enqueued else 200)
            if self.ctl in events:
                msg = self._recv(self.ctl)
                if isinstance(msg, Step):
                    self.plans.append(msg)
                elif isinstance(msg, Reset):
                    self._start_over(msg.reason)
                elif isinstance(msg, Shutdown):
                    return
            if self.pull in events:
                self._receive_activations()
            while self.plans and (self.first or self.plans[0].step in self.arrived):
                ex.answer_landed(keep=1)  # tokens first where a later step keeps the device busy
                plan = self.plans.popleft()
                ex.run(plan, None if self.first else self.arrived.pop(plan.step))
            ex.answer_landed()
            self._check_parent()

    def _receive_activations(self) -> None:
        try:
            msg, frames = decode(self.pull.recv_multipart(copy=False))
            if not isinstance(msg, Activations):
                raise ProtocolError(f"expected ACTIVATIONS, got {type(msg).__name__}")
            if not msg.shape:  # the previous stage failed this step
                self.arrived[msg.step] = msg
                return
            if msg.dtype != str(self.dtype).removeprefix("torch.") or len(msg.shape) != 2:
                raise ProtocolError(f"activations of dtype {msg.dtype} shape {msg.shape}")
            raw = bytearray(frames[0])
            hidden = torch.empty(0, dtype=torch.uint8)
            if raw:  # frombuffer refuses an empty buffer (a step with no rows)
                hidden = torch.frombuffer(raw, dtype=torch.uint8)
            hidden = hidden.view(self.dtype).reshape(msg.shape).to(self.device)
            self.arrived[msg.step] = (msg, hidden)
        except Exception as e:  # whatever arrives, a malformed frame never stops the worker
            log.warning("dropped bad activations: %s", e)

    def _to_coordinator(self, msg) -> None:
        self.ctl.send_multipart(encode(msg))
        self.last_result = time.monotonic()  # any message is a sign of life

    def _to_next(self, header: Activations, frames: list) -> None:
        """Hand the step on; a next stage that takes nothing for NEXT_STAGE_SECONDS (it died,
        or its host is cut off) loses the step rather than this worker its loop: the
        coordinator regroups the workers then, and this one must read its RESET."""
        try:
            self.push.send_multipart(encode(header, frames), copy=False)  # SNDTIMEO bounds it
        except zmq.Again:
            log.warning("worker %d: the next stage takes nothing; step %d dropped", self.rank,
                        header.step)

    def _recv(self, sock: zmq.Socket):
        try:
            msg, _ = decode(sock.recv_multipart(copy=False))
            return msg
        except ProtocolError as e:
            log.warning("dropped a bad message: %s", e)
            return None

    def _heartbeat(self) -> None:
        """Beats from a thread of its own, skipped while step results come more often: every
        message wakes the coordinator's loop."""
        sock = self._dealer()
        try:
            while not self.stop.is_set():
                if sock.poll(round(HEARTBEAT_SECONDS * 1000)):
                    # a coordinator that does not know this worker answers its beats: RESET
                    # (the control socket, idle meanwhile, is not known to it)
                    msg = self._recv(sock)
                    if isinstance(msg, Reset):
                        self.reset_reason = msg.reason or "no reason given"
                    continue
                if time.monotonic() - self.last_result >= HEARTBEAT_SECONDS:
                    ex = self.executor
                    beat = Heartbeat(rank=self.rank, pid=os.getpid()) if ex is None else (
                        Heartbeat(rank=self.rank, pid=os.getpid(),
                                  forward_seconds=ex.forward_seconds, steps=ex.steps))
                    sock.send_multipart(encode(beat))
        finally:
            sock.close()

    def _check_parent(self) -> None:
        if self.parent is not None and os.getppid() != self.parent:
            log.warning("coordinator process went away; worker %d exits", self.rank)
            self.stop.set()
            raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="siding worker", description="a siding worker process",
                                formatter_class=HelpFormatter)
    p.add_argument("--coordinator", default="tcp://127.0.0.1:5556",
                   help="the coordinator's worker endpoint (its --worker-listen)")
    p.add_argument("--rank", type=int, default=-1, help="pipeline rank (default: by arrival)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N: where this worker's layers run")
    p.add_argument("--advertise", default="127.0.0.1",
                   help="address the previous stage reaches this worker's activation socket "
                   "on, and Prometheus its metrics")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="the coordinator's CURVE keys directory (`siding keys DIR`): they "
                   "authenticate this worker's links, loopback or not")
    p.add_argument("--insecure", action="store_true",
                   help="run without --curve-keys: any peer that reaches this worker's sockets "
                   "may join or inject into them")
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="what this worker logs")
    p.add_argument("--debug", action="store_true", help="--log-level debug")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level="DEBUG" if a.debug else a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s worker %(levelname)s %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.exit_with_parent:  # started by `siding launch`, which drains on Ctrl-C, then stops us
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(a.coordinator, a.rank, a.device, a.advertise, a.curve_keys, a.insecure,
                        a.exit_with_parent)
    except ValueError as e:
        print(f"siding worker: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    worker.run()
    # Told to stop, with nothing left to send: the threads' sockets (heartbeats, CURVE
    # authentication, rejection counting) would hold the context's teardown up to a second.
    logging.shutdown()
    os._exit(0)
