"""The engine core's frontends: their processes, the FRONTEND_HELLO/SERVE/LISTENING handshake,
liveness, and restarts. Knows sockets and processes, not requests.

Frontends reach the core over one ROUTER on an ipc socket in a directory only this user can
enter, so the file system is what authenticates them; nothing on it leaves the machine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from protocol.messages import FrontendHello, Heartbeat, Listening, Serve, Shutdown
from protocol.wire import MAX_MESSAGE_BYTES, encode

from .config import CoordinatorConfig
from .http import address
from .ports import bind

log = logging.getLogger("siding.coordinator")

OUTPUT_HWM = 1_000_000  # queued outputs per frontend; a frontend never stops reading for long
CORE_BEAT_SECONDS = 1.0  # the longest the core leaves a frontend without a message


def check_free(flag: str, endpoint: str) -> None:
    """OSError naming `flag` if a tcp:// endpoint's port is taken (a bind as ZeroMQ's, released
    at once; `*` ports and ipc:// are not checked)."""
    transport, _, address = endpoint.partition("://")
    host, _, port = address.rpartition(":")
    if transport != "tcp" or port == "*":
        return
    host = host.removeprefix("[").removesuffix("]")
    bind(flag, endpoint, "0.0.0.0" if host == "*" else host, int(port)).close()


@dataclass(eq=False)
class FrontendHandle:
    index: int
    listen: str  # what it binds; the port it got, once known, so a restart takes the same
    process: subprocess.Popen | None = None
    identity: bytes | None = None
    endpoint: str | None = None  # where clients reach it, once it listens
    last_seen: float = 0.0
    last_sent: float = 0.0  # when the core last sent it anything (its sign of life: `beat`)
    restarts: int = 0

    @property
    def serving(self) -> bool:
        return self.endpoint is not None


class FrontendGroup:
    def __init__(self, ctx: zmq.Context, config: CoordinatorConfig, private_dir: Path):
        self.config = config
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, OUTPUT_HWM)
        self.sock.setsockopt(zmq.RCVHWM, OUTPUT_HWM)
        self.sock.bind(f"ipc://{private_dir}/core")
        for ep in config.client_endpoints():  # here, once, rather than in a frontend process
            check_free("--listen", ep)
        self.handles = [FrontendHandle(i, ep) for i, ep in enumerate(config.client_endpoints())]
        # The OpenAI API's one listening socket: every frontend accepts on it.
        self.http = None if config.http is None else address.listen(config.http)
        # where the core serves its metrics' exposition, which the API serves as /metrics
        self.metrics_socket = str(private_dir / "metrics")
        self.serve_msg: Serve | None = None

    @property
    def endpoint(self) -> str:
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def serving(self) -> bool:
        return all(h.serving for h in self.handles)

    @property
    def client_endpoints(self) -> str:
        """What clients are given: every frontend's endpoint, comma-separated."""
        return ",".join(h.endpoint or h.listen for h in self.handles)

    @property
    def http_url(self) -> str | None:
        """Where the OpenAI API is served (by every frontend), once bound."""
        return None if self.http is None else address.socket_url(self.http)

    def spawn_all(self) -> None:
        for h in self.handles:
            self._spawn(h)

    def _spawn(self, h: FrontendHandle) -> None:
        c = self.config
        cmd = [sys.executable, "-m", "coordinator.frontend", "--core", self.endpoint,
               "--index", str(h.index), "--listen", h.listen, "--exit-with-parent",
               "--log-level", c.log_level]
        if c.curve_keys:
            cmd += ["--curve-keys", c.curve_keys]
        if c.insecure:
            cmd += ["--insecure"]
        env, fds = None, ()
        if self.http is not None:
            fds = (self.http.fileno(),)
            cmd += ["--http-fd", str(fds[0]), "--metrics-socket", self.metrics_socket]
            if c.sse_keepalive is not None:
                cmd += ["--sse-keepalive", str(c.sse_keepalive)]
            cmd += ["--http-timeout", str(c.http_timeout)]
            if c.api_key is not None:  # not on the command line, where `ps` shows it
                env = dict(os.environ, SIDING_API_KEY=c.api_key)
        h.process = subprocess.Popen(cmd, env=env, pass_fds=fds)
        h.identity, h.endpoint, h.last_seen = None, None, time.monotonic()

    def serve(self, msg: Serve) -> None:
        """The model is known: every frontend that has said hello may start serving."""
        self.serve_msg = msg
        for h in self.handles:
            if h.identity is not None and not h.serving:
                self.send(h.index, msg)

    def note(self, identity: bytes, msg) -> FrontendHandle | None:
        """A message from a frontend: the handshake's steps, and liveness. Returns its handle
        if known."""
        if isinstance(msg, FrontendHello):
            if not 0 <= msg.index < len(self.handles):
                log.warning("a frontend said hello as index %d; ignored", msg.index)
                return None
            h = self.handles[msg.index]
            h.identity, h.last_seen = identity, time.monotonic()
            if self.serve_msg is not None:
                self.send(h.index, self.serve_msg)
            return h
        h = next((x for x in self.handles if x.identity == identity), None)
        if h is None:
            return None
        h.last_seen = time.monotonic()
        if isinstance(msg, Listening):
            h.endpoint = msg.endpoint
            h.listen = msg.endpoint  # a restart binds the same port
            log.info("frontend %d: pid %d serving %s%s", h.index, h.process.pid if h.process
                     else 0, msg.endpoint, f" and {self.http_url}" if self.http else "")
        elif not isinstance(msg, Heartbeat) and not h.serving:
            return None
        return h

    def send(self, index: int, msg, frames=()) -> None:
        h = self.handles[index]
        if h.identity is None:
            return
        try:
            self.sock.send_multipart([h.identity, *encode(msg, frames)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # gone, or not reading: its liveness check will see to it
            log.warning("frontend %d: cannot send (%s)", index, e)
        else:
            h.last_sent = time.monotonic()

    def beat(self, now: float) -> None:
        """A heartbeat to each serving frontend the core has not sent anything for
        CORE_BEAT_SECONDS: how a frontend knows the core lives (frontend.py, `_check_core`)."""
        for h in self.handles:
            if h.serving and now - h.last_sent >= CORE_BEAT_SECONDS:
                self.send(h.index, Heartbeat(rank=0))

    def dead(self) -> list[FrontendHandle]:
        """Frontends whose process exited or that stopped talking."""
        now = time.monotonic()
        return [h for h in self.handles if h.process is not None and (
            h.process.poll() is not None or now - h.last_seen > self.config.frontend_timeout)]

    def restart(self, h: FrontendHandle) -> None:
        if h.process is not None and h.process.poll() is None:
            h.process.kill()
            h.process.wait()
        h.restarts += 1
        log.error("frontend %d stopped; restarting it on %s", h.index, h.listen)
        self._spawn(h)

    def stop(self, timeout: float = 5.0) -> None:
        for h in self.handles:
            if h.identity is not None:
                self.send(h.index, Shutdown())
        deadline = time.monotonic() + timeout
        for h in self.handles:
            if h.process is None:
                continue
            try:
                h.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h.process.kill()
                h.process.wait()
        if self.http is not None:
            self.http.close()

    def describe(self) -> list[dict]:
        return [{"index": h.index, "endpoint": h.endpoint, "serving": h.serving,
                 "pid": h.process.pid if h.process else None, "restarts": h.restarts}
                for h in self.handles]
