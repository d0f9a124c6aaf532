"""Every worker metric (docs/reference.md, "Metrics"), in one registry per worker.

Each series carries the labels `worker` (the rank) and `device`, and every label combination
exists from the start, so a dashboard shows zeros rather than gaps. The staging ring reports
through `transfer`, `wait`, `ring` and `decline`; the process reports `forward` per step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocol.metrics_http import serve_metrics

TRANSFER_PATHS = ("ahead", "ordered", "writeback")
DECLINE_REASONS = ("budget", "headroom", "unsupported")
# a step of a worker that takes plans ahead (worker/overlap.py), enqueued while an earlier one
# still ran, or onto an idle device (the plan came late)
AHEAD_OUTCOMES = ("queued", "idle")
# One stage's forward pass: from well under a millisecond (a decode step on a GPU) to seconds
# (a long prefill chunk on the CPU).
FORWARD_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                   1.024, 2.048, 4.096, 8.192, 16.384)


class WorkerMetrics:
    def __init__(self, rank: int, device: str, pipeline_depth: int, exact: bool) -> None:
        r = self.registry = CollectorRegistry()
        own = ["worker", "device"]
        self.transfer_bytes = Counter("siding_transfer_bytes", "KV bytes copied, by path",
                                      [*own, "path"], registry=r)
        self.transfer_copies = Counter("siding_transfer_copies", "KV copies issued, by path",
                                       [*own, "path"], registry=r)
        self.transfer_wait = Counter("siding_transfer_wait_seconds",
                                     "Compute stream time spent waiting for a ring slot", own,
                                     registry=r)
        self.ring_bytes = Gauge("siding_ring_bytes", "Device bytes held by the staging ring", own,
                                registry=r)
        self.ring_slots = Gauge("siding_ring_slots", "Slots in the staging ring", own, registry=r)
        self.pipeline_depth = Gauge("siding_pipeline_depth", "Layers delivered ahead of use", own,
                                    registry=r)
        self.ring_declines = Counter("siding_ring_declines",
                                     "Steps that took the ordered path instead of the ring",
                                     [*own, "reason"], registry=r)
        self.forward_seconds = Histogram("siding_forward_seconds", "One step through this stage",
                                         own, buckets=FORWARD_BUCKETS, registry=r)
        self.exact_mode = Gauge("siding_exact_mode", "1 when exact mode is on", own, registry=r)
        self.ahead_steps = Counter("siding_ahead_steps",
                                   "Steps enqueued behind a running one (queued) or onto an idle "
                                   "device (idle)",
                                   [*own, "outcome"], registry=r)
        self.rejected = Counter("siding_rejected_connections",
                                "Peers refused by CURVE authentication, by socket",
                                [*own, "socket"], registry=r)
        # Children resolved once: the ring reports per layer, where a label lookup would show.
        self._own = {"worker": str(rank), "device": device}
        self._bytes = {p: self.transfer_bytes.labels(**self._own, path=p) for p in TRANSFER_PATHS}
        self._copies = {p: self.transfer_copies.labels(**self._own, path=p)
                        for p in TRANSFER_PATHS}
        self._declines = {r: self.ring_declines.labels(**self._own, reason=r)
                          for r in DECLINE_REASONS}
        self._wait = self.transfer_wait.labels(**self._own)
        self._forward = self.forward_seconds.labels(**self._own)
        self._ahead = {o: self.ahead_steps.labels(**self._own, outcome=o) for o in AHEAD_OUTCOMES}
        self._rejected = self.rejected.labels(**self._own, socket="activations")
        self.ring(0, 0, pipeline_depth)
        self.exact_mode.labels(**self._own).set(int(exact))

    def reject(self, n: int = 1) -> None:
        """`n` peers of the activation socket failed its authentication."""
        self._rejected.inc(n)

    def transfer(self, path: str, nbytes: int, copies: int = 1) -> None:
        """`copies` copies moved `nbytes` in all on `path` (ahead, ordered or writeback)."""
        self._bytes[path].inc(nbytes)
        self._copies[path].inc(copies)

    def wait(self, seconds: float) -> None:
        self._wait.inc(seconds)

    def ring(self, nbytes: int, slots: int, depth: int | None = None) -> None:
        """The ring's current size (0 and 0 when KV lives on the device), and its depth."""
        self.ring_bytes.labels(**self._own).set(nbytes)
        self.ring_slots.labels(**self._own).set(slots)
        if depth is not None:
            self.pipeline_depth.labels(**self._own).set(depth)

    def decline(self, reason: str) -> None:
        """A step took the ordered path: `budget`, `headroom` or `unsupported`."""
        self._declines[reason].inc()

    def forward(self, seconds: float) -> None:
        self._forward.observe(seconds)

    def ahead(self, outcome: str) -> None:
        """A step was enqueued behind a running one (`queued`) or onto an idle device."""
        self._ahead[outcome].inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        serve_metrics(self.registry, port, addr)
