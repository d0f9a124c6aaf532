"""The workers of a cluster: local spawning, the REGISTER/ASSIGN/READY handshake, heartbeats,
and plan dispatch. Knows sockets and processes, not scheduling."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass

import zmq

from protocol.messages import (
    Assign,
    Heartbeat,
    ModelInfo,
    Ready,
    Register,
    Reset,
    Shutdown,
    StepError,
)
from protocol.wire import encode

from .config import CoordinatorConfig, threads_per_worker

log = logging.getLogger("siding.coordinator")

MAX_RESTARTS = 3  # restarts within RESTART_WINDOW that start at once; later ones back off
RESTART_WINDOW = 60.0
MAX_BACKOFF = 30.0  # seconds: the longest wait before the next restart


class StartupError(RuntimeError):
    pass


@dataclass(eq=False)
class WorkerHandle:
    identity: bytes
    reg: Register
    rank: int = -1
    layers: tuple[int, int] = (0, 0)
    ready: bool = False
    alive: bool = True
    kv_bytes_per_page: int = 0
    last_seen: float = 0.0
    forward: tuple[float, int] = (0.0, 0)  # its forward passes as its heartbeats say: time, steps


class WorkerGroup:
    def __init__(self, sock: zmq.Socket, config: CoordinatorConfig, link_keys: str | None):
        self.sock = sock
        self.config = config
        self.link_keys = link_keys  # CURVE keys of the worker links, handed to local workers
        self.handles: list[WorkerHandle] = []  # by rank once assigned
        self.pending: list[WorkerHandle] = []  # registered, not yet assigned
        self.processes: list[subprocess.Popen] = []
        self.model: ModelInfo | None = None
        self.ready = False
        self.deadline = 0.0
        self.restarts: list[float] = []

    # ---- local processes --------------------------------------------------------------------

    def spawn_local(self) -> None:
        c = self.config
        bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port of a `*` bind
        endpoint = bound.replace("0.0.0.0", "127.0.0.1")
        threads = c.worker_threads or threads_per_worker(c.workers)
        for rank, device in enumerate(c.devices):
            cmd = [sys.executable, "-m", "worker", "--coordinator", endpoint, "--rank", str(rank),
                   "--device", device, "--threads", str(threads), "--exit-with-parent",
                   "--log-level", c.log_level]
            if self.link_keys:
                cmd += ["--curve-keys", self.link_keys]
            self.processes.append(subprocess.Popen(cmd))

    def stop_local(self, timeout: float = 10.0) -> None:
        for h in self.handles:
            self.sock.send_multipart([h.identity, *encode(Shutdown())])
        deadline = time.monotonic() + timeout
        for p in self.processes:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # ---- handshake --------------------------------------------------------------------------

    def begin(self) -> None:
        """Start (or restart) the handshake; spawn local processes if this cluster owns them."""
        if self.config.spawn_workers:
            self.spawn_local()
        self.pending = []
        self.handles = []
        self.ready = False
        self.deadline = time.monotonic() + self.config.startup_timeout

    def note_restart(self, now: float) -> float:
        """Count a restart; returns how long to wait before it: nothing for the first
        MAX_RESTARTS in RESTART_WINDOW, then 2, 4, 8, ... seconds up to MAX_BACKOFF (remote
        workers: nothing; they come back when they come back)."""
        if not self.config.spawn_workers:
            return 0.0
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW] + [now]
        beyond = len(self.restarts) - MAX_RESTARTS
        return 0.0 if beyond <= 0 else min(MAX_BACKOFF, 2.0 ** beyond)

    def halt(self, reason: str = "") -> None:
        """Forget the handshake, not ready until `begin`: local processes are stopped, remote
        workers told to register again (RESET)."""
        if self.config.spawn_workers:
            self.stop_local(timeout=2.0)
        else:
            for h in [*self.handles, *self.pending]:
                self.reset(h.identity, reason)
        self.processes = []
        self.pending = []
        self.handles = []
        self.ready = False

    def restart(self, reason: str = "") -> None:
        self.halt(reason)
        self.begin()

    def reset(self, identity: bytes, reason: str) -> None:
        """Tell a remote worker to start over and register (local ones are restarted)."""
        if not self.config.spawn_workers:
            self.sock.send_multipart([identity, *encode(Reset(reason=reason))])

    def on_startup_message(self, identity: bytes, msg) -> None:
        """Feed the handshake one message; `ready` turns true when every worker is READY."""
        c = self.config
        if not self.handles:
            if isinstance(msg, Register) and not any(h.identity == identity
                                                     for h in self.pending):
                self.pending.append(WorkerHandle(identity, msg))
                if len(self.pending) == c.workers:
                    self._assign(self.pending)
            elif not isinstance(msg, Register):  # one assigned before this handshake began
                self.reset(identity, "the coordinator is regrouping its workers")
            return
        h = self._by_identity(identity)
        if h is None:
            loading = isinstance(msg, Heartbeat) and any(
                x.rank == msg.rank and x.reg.pid == msg.pid for x in self.handles)
            if not loading and not isinstance(msg, Register):
                self.reset(identity, "the coordinator is regrouping its workers")
            return
        if isinstance(msg, StepError):
            raise StartupError(f"worker {h.rank} failed to start: {msg.message}")
        if isinstance(msg, Ready):
            h.ready, h.layers, h.last_seen = True, (msg.layer_start, msg.layer_end), \
                time.monotonic()
            h.kv_bytes_per_page = msg.kv_bytes_per_page
            if msg.rank == 0:
                self.model = msg.model
            if all(x.ready for x in self.handles):
                self._check_layers()
                self.ready = True

    def check_startup(self) -> None:
        """Raise StartupError if a local worker died or the deadline passed."""
        if self.handles:
            progress = f"{sum(h.ready for h in self.handles)} of {self.config.workers} loaded"
        else:
            progress = f"{len(self.pending)} of {self.config.workers} registered"
        self._check_deadline(self.deadline, progress)

    def _assign(self, pending: list[WorkerHandle]) -> None:
        c = self.config
        ranked = sorted((h for h in pending if h.reg.rank >= 0), key=lambda h: h.reg.rank)
        ranks = [h.reg.rank for h in ranked]
        if len(set(ranks)) != len(ranks) or any(r >= c.workers for r in ranks):
            raise StartupError(f"workers asked for ranks {ranks} in a cluster of {c.workers}")
        free = iter(sorted(set(range(c.workers)) - set(ranks)))
        for h in pending:
            h.rank = h.reg.rank if h.reg.rank >= 0 else next(free)
        self.handles = sorted(pending, key=lambda h: h.rank)
        for h in self.handles:
            nxt = self.handles[h.rank + 1].reg.data_endpoint if h.rank + 1 < c.workers else None
            self.sock.send_multipart([h.identity, *encode(Assign(
                rank=h.rank, n_workers=c.workers, config=c.worker, next_endpoint=nxt,
                metrics_port=None if c.metrics_port is None else c.metrics_port + 1 + h.rank,
            ))])
            log.info("worker %d: %s pid %d on %s", h.rank, h.reg.device, h.reg.pid,
                     h.reg.hostname)

    def _check_layers(self) -> None:
        expect = 0
        for h in self.handles:
            if h.layers[0] != expect or h.layers[1] <= h.layers[0]:
                raise StartupError(f"worker layer ranges do not tile the model: "
                                   f"{[h.layers for h in self.handles]}")
            expect = h.layers[1]
        if self.model is None or expect != self.model.n_layers:
            raise StartupError("workers did not cover every layer of the model")

    def _check_deadline(self, deadline: float, progress: str) -> None:
        for p in self.processes:
            if p.poll() is not None:
                raise StartupError(f"a worker process exited with code {p.returncode} "
                                   f"during start-up ({progress})")
        if time.monotonic() > deadline:
            raise StartupError(f"workers did not start in {self.config.startup_timeout:.0f}s "
                               f"({progress})")

    def _by_identity(self, identity: bytes) -> WorkerHandle | None:
        return next((h for h in self.handles if h.identity == identity), None)

    # ---- serving ----------------------------------------------------------------------------

    def send(self, msg) -> None:
        self.send_frames(encode(msg))

    def send_frames(self, frames: list) -> None:
        """A message already encoded, to every worker alive."""
        for h in self.handles:
            if h.alive:
                self.sock.send_multipart([h.identity, *frames])

    def note(self, identity: bytes, msg) -> WorkerHandle | None:
        """Record liveness for a message from a worker; returns its handle if known."""
        if isinstance(msg, Heartbeat):  # from the worker's heartbeat socket: known by rank and pid
            h = self.handles[msg.rank] if 0 <= msg.rank < len(self.handles) else None
            if h is not None and msg.pid and msg.pid != h.reg.pid:
                h = None  # a worker this group replaced, cut off for a while
        else:
            h = self._by_identity(identity)
        if h is not None:
            h.last_seen = time.monotonic()
            if isinstance(msg, Heartbeat) and msg.steps:
                h.forward = (msg.forward_seconds, msg.steps)
        return h

    def dead(self) -> list[WorkerHandle]:
        """Workers newly found dead: their process exited or their heartbeats stopped."""
        now = time.monotonic()
        found = []
        for h in self.handles:
            if not h.alive:
                continue
            proc = self.processes[h.rank] if h.rank < len(self.processes) else None
            exited = proc is not None and proc.poll() is not None
            if exited or now - h.last_seen > self.config.heartbeat_timeout:
                h.alive = False
                found.append(h)
        return found

    @property
    def kv_bytes_per_page(self) -> int:
        return sum(h.kv_bytes_per_page for h in self.handles)

    @property
    def devices(self) -> list[str]:
        """The devices the workers said they run on (local or remote alike)."""
        return [h.reg.device for h in self.handles]

    @property
    def n_up(self) -> int:
        return sum(h.alive and h.ready for h in self.handles)

    @property
    def n_registered(self) -> int:
        """Workers this handshake has heard from (while regrouping, those that came back)."""
        return len(self.handles) or len(self.pending)

    @property
    def layers_up(self) -> int:
        return sum(h.layers[1] - h.layers[0] for h in self.handles if h.alive and h.ready)

    def describe(self) -> list[dict]:
        return [{"rank": h.rank, "device": h.reg.device, "pid": h.reg.pid,
                 "host": h.reg.hostname, "layers": list(h.layers), "alive": h.alive,
                 "ready": h.ready,
                 "data_endpoint": h.reg.data_endpoint,
                 "forward_seconds_mean": h.forward[0] / h.forward[1] if h.forward[1] else None}
                for h in self.handles]

