"""CoordinatorConfig: every knob of a cluster, validated once at start-up. What the workers are
built from is one `WorkerConfig` in it, sent to them whole."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from protocol.worker_config import WorkerConfig


def usable_cores() -> int:
    """The cores this process may run on: its affinity, which `taskset` and container CPU sets
    narrow, not the machine's count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def threads_per_worker(workers: int) -> int:
    """Torch CPU threads for each of `workers` local workers: the usable cores shared out. More
    threads than cores make every CPU op spin."""
    return max(1, usable_cores() // workers)


def is_endpoint(endpoint: str) -> bool:
    """tcp://HOST:PORT or ipc://PATH, the forms siding binds and connects."""
    transport, sep, address = endpoint.partition("://")
    return bool(sep and address and transport in ("tcp", "ipc") and (
        transport == "ipc" or ":" in address))


@dataclass
class CoordinatorConfig:
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    workers: int = 1
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    prefix_cache: bool = True  # full pages of computed prompts reused by content
    preempt_every: int = 0
    prefill_hold_ms: int = 0  # new prompts may wait this long while others decode (0: never)
    multi_step: int = 1  # steps planned and answered as one group (one worker only)
    listen: str = "tcp://127.0.0.1:5555"  # client endpoints: one, or one per frontend (a,b,...)
    frontends: int = 1  # processes that serve clients (text, streaming) beside the engine core
    http: str | None = None  # HOST:PORT of the OpenAI-compatible HTTP API (off when None)
    api_key: str | None = field(default=None, repr=False)  # bearer token the HTTP API asks for
    sse_keepalive: float | None = None  # seconds of silence before an SSE comment (None: never)
    http_timeout: float = 10.0  # seconds an HTTP connection may idle before its request
    worker_listen: str = "tcp://127.0.0.1:5556"
    metrics_port: int | None = 9400
    curve_keys: str | None = None
    insecure: bool = False
    spawn_workers: bool = True  # launch: start local worker processes
    worker_threads: int = 0  # torch threads per local worker (0: threads_per_worker)
    startup_timeout: float = 600.0
    heartbeat_timeout: float = 2.0
    step_timeout: float = 300.0  # a step in flight longer than this restarts the workers
    worker_wait: float = 60.0  # while the workers are down, requests wait this long, then fail
    max_waiting: int = 4096  # queued requests before new ones get `overloaded`
    max_queued_per_client: int = 1024  # one client's queued requests before its next is refused
    frontend_timeout: float = 10.0  # a frontend silent this long is restarted
    log_level: str = "info"  # of every process of the cluster

    def __post_init__(self) -> None:
        if len(self.devices) == 1 and self.workers > 1:
            self.devices = self.devices * self.workers
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.workers >= 1, "--workers must be at least 1")
        need(len(self.devices) == self.workers,
             f"--devices names {len(self.devices)} devices for {self.workers} workers")
        for d in self.devices:
            need(d == "cpu" or d.startswith("cuda"), f"unknown device {d!r}: use cpu or cuda:N")
        self.worker.validate()
        need(self.preempt_every >= 0, "--preempt-every must be >= 0")
        need(0 <= self.prefill_hold_ms <= 10_000, "--prefill-hold-ms must be in [0, 10000]")
        need(1 <= self.multi_step <= 64, "--multi-step must be in [1, 64]")
        need(self.multi_step == 1 or self.workers == 1,
             "--multi-step needs one worker: a layer split runs one step a stage")
        need(1 <= self.frontends <= 64, "--frontends must be in [1, 64]")
        need(self.max_queued_per_client >= 1, "--max-queued-per-client must be at least 1")
        need(self.worker_wait > 0, "--worker-wait must be a positive number of seconds")
        if not self.spawn_workers:  # workers of its own get keys made for the run
            from protocol.security import check_links

            check_links(self.curve_keys, self.insecure)
        if self.http is not None:
            from protocol.security import check_http_bind

            from .http.address import parse_address

            host, _ = parse_address(self.http)
            check_http_bind(host, self.api_key, self.insecure)
        need(self.sse_keepalive is None or self.sse_keepalive > 0,
             "--sse-keepalive must be a positive number of seconds")
        need(self.http_timeout > 0, "--http-timeout must be a positive number of seconds")
        need(self.api_key is None or self.api_key.strip() == self.api_key != "",
             "--api-key must be non-empty, without surrounding whitespace")
        for flag, endpoint in [("--worker-listen", self.worker_listen),
                               *(("--listen", e) for e in self.listen.split(","))]:
            need(is_endpoint(endpoint), f"{flag} {endpoint!r}: give an endpoint such as "
                 "tcp://127.0.0.1:5555 (or ipc:///path)")
        given = self.listen.split(",")
        need(len(given) <= self.frontends,
             f"--listen names {len(given)} endpoints for {self.frontends} frontend(s)")

    def client_endpoints(self) -> list[str]:
        """Where each frontend listens: the endpoints --listen names, then, for frontends it
        does not name, the first one's host on a port of the system's choosing."""
        given = self.listen.split(",")
        base = given[0].rpartition(":")[0]
        return given + [f"{base}:*"] * (self.frontends - len(given))
