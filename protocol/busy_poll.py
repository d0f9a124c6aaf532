"""Waiting on sockets without falling asleep: after its last message, a process polls in a loop
for a while (`--busy-poll`) before it blocks in the kernel.

A message between two processes that both sleep wakes three threads cold (the sender's ZeroMQ
I/O thread, the receiver's, then the receiver itself), and a request crosses six such hops
before its first token. On a lent H200 host a DEALER/ROUTER round trip after 0.2 s of silence
took 670 us blocking and 443 us with both ends spinning, against 95 us back to back
(`docs/benchmarks.md`, "prefix"). A spinning process takes one core while it spins, so
`auto` spins only where the cluster runs on CUDA devices (hosts with cores to spare, as vLLM's
workers spin on their shared-memory queue), for AUTO_SECONDS after the last message; on a CPU
the cores are the model's, and nothing spins. Heartbeats open no window (`signs_of_life`): a
frontend's, every 2 s, kept an idle engine core spinning half the time, and the core's, every
second, would keep an idle frontend spinning for good.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import zmq

AUTO_SECONDS = 1.0  # how long `auto` spins after a message, on CUDA clusters


def busy_seconds(setting: float | None, devices: Iterable[str]) -> float:
    """The spin window of `--busy-poll` (None: auto) for a process serving `devices`."""
    if setting is not None:
        return setting
    return AUTO_SECONDS if any(str(d).startswith("cuda") for d in devices) else 0.0


class BusyPoller:
    """`zmq.Poller.poll`, spinning for up to `seconds` after the last event it returned."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.last = time.monotonic()  # the last event (start-up counts as one)
        self.before = self.last  # `last` before the latest event came

    def poll(self, poller: zmq.Poller, timeout_ms: int) -> dict:
        """The events of `poller` within `timeout_ms` (0: now; never forever), as a dict."""
        if self.seconds > 0 and timeout_ms > 0:
            now = time.monotonic()
            deadline = now + timeout_ms / 1000
            spin_until = min(deadline, self.last + self.seconds)
            while now < spin_until:
                if events := poller.poll(0):
                    self._came()
                    return dict(events)
                os.sched_yield()
                now = time.monotonic()
            timeout_ms = max(0, round((deadline - now) * 1000))
        events = poller.poll(timeout_ms)
        if events:
            self._came()
        return dict(events)

    def signs_of_life(self) -> None:
        """What the last poll returned were only heartbeats: they open no window, or an idle
        process that hears one every few seconds would spin for good."""
        self.last = self.before

    def _came(self) -> None:
        self.before, self.last = self.last, time.monotonic()
