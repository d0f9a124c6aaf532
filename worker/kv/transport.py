"""Transports: how the staging ring moves bytes and orders its sides.

A transport has a compute side (where attention runs), a transfer side (a FIFO of copies to the
device, and nothing else, so that the link never waits on anything but a slot's release) and a
write-back side (a FIFO of copies back to the host, which wait for the compute side; of its own,
so that none of it holds up the deliveries queued after it), and events that order one against
another the way CUDA events order streams: `wait` and `copy(after=...)` capture each event's
latest record at the time they are called, never a later one, and nothing blocks the host except
`host_wait` and `synchronize` (and, on the CPU, the compute side's `wait`, because there the host
thread *is* the compute stream).

`CudaTransport` is two dedicated CUDA streams and driver events (`worker/cuda_driver.py`).
`CpuTransport` is two copy threads over FIFOs with events of their own, so the same ring logic
runs in CI. Both take `delay_ms`, a fault injection that delays every copy on either side: with
it a missing wait shows up as wrong bytes instead of staying hidden behind a fast copy (the
tests set it through `WorkerConfig.transport_delay_ms`, a hidden `--transport-delay-ms`).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .. import cuda_driver as cuda

# Every wait has a deadline: a transfer that has not landed after this long is a bug, not load.
WAIT_TIMEOUT_S = 120.0
# torch.cuda._sleep spins for clock cycles; about 1.5-2 GHz on current parts, so a delay is
# approximate, which is all fault injection needs.
CYCLES_PER_MS = 1_500_000
# CUDA waits are timed on one call in this many, drawn at random (a fixed stride would time the
# same layer every step), with two timing events each, and scaled back up.
WAIT_SAMPLE = 16

Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src)


class Transport(Protocol):
    def event(self) -> Any: ...

    def record(self, ev: Any) -> None:
        """Record `ev` on the compute side, after everything enqueued there so far."""

    def wait(self, ev: Any) -> None:
        """Make the compute side wait for `ev`'s latest record."""

    def copy(self, pairs: Sequence[Pair], after: Sequence[Any] = (), then: Any = None) -> None:
        """On the transfer side: wait for each event of `after`, copy each (dst, src), then
        record `then`."""

    def copy_back(self, pairs: Sequence[Pair], after: Sequence[Any] = (), then: Any = None) -> None:
        """As `copy`, on the write-back side."""

    def host_wait(self, ev: Any) -> None:
        """Block the host until `ev`'s latest record has completed."""

    def synchronize(self) -> None:
        """Block the host until both sides are idle."""

    def wait_seconds(self) -> float:
        """Compute-side time spent in `wait` since the last call, for the waits that have run."""

    def close(self) -> None: ...


def make_transport(device: torch.device | str, delay_ms: float = 0.0) -> Transport | None:
    """The transport for `device`, or None where there is none (the ring then declines)."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransport(device, delay_ms)
    if device.type == "cpu":
        return CpuTransport(delay_ms)
    return None


class CudaTransport:
    """Two streams of PyTorch's for the transfer and write-back sides, the device's current
    stream as the compute side, and the stream operations made through the CUDA driver
    (`worker/cuda_driver.py`): a ring step makes about a hundred of them."""

    def __init__(self, device: torch.device | str, delay_ms: float = 0.0):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.back = torch.cuda.Stream(self.device)
        # The worker computes on the device's current stream and never switches it.
        self.compute = torch.cuda.current_stream(self.device)
        self._handles = {s: s.cuda_stream for s in (self.stream, self.back)}
        self._compute = self.compute.cuda_stream
        self.delay_cycles = int(delay_ms * CYCLES_PER_MS)
        self._sample = random.Random(0).random
        self._timed: list[tuple[cuda.Event, cuda.Event]] = []

    def event(self) -> cuda.Event:
        return cuda.Event()

    def record(self, ev: cuda.Event) -> None:
        ev.record(self._compute)

    def wait(self, ev: cuda.Event) -> None:
        if self._sample() * WAIT_SAMPLE >= 1:
            cuda.wait_event(self._compute, ev)
            return
        a, b = cuda.Event(timing=True), cuda.Event(timing=True)
        a.record(self._compute)
        cuda.wait_event(self._compute, ev)
        b.record(self._compute)
        self._timed.append((a, b))

    def copy(self, pairs: Sequence[Pair], after: Sequence[Any] = (), then: Any = None) -> None:
        self._issue(self.stream, pairs, after, then)

    def copy_back(self, pairs: Sequence[Pair], after: Sequence[Any] = (), then: Any = None) -> None:
        self._issue(self.back, pairs, after, then)

    def _issue(self, s: torch.cuda.Stream, pairs: Sequence[Pair], after: Sequence[Any],
               then: Any) -> None:
        handle = self._handles[s]
        for ev in after:
            cuda.wait_event(handle, ev)
        for dst, src in pairs:
            if self.delay_cycles:
                self._sleep(s)
            if not (dst.nbytes == src.nbytes and dst.dtype == src.dtype and dst.is_contiguous()
                    and src.is_contiguous()):
                raise ValueError(f"a transport copy needs contiguous tensors of one shape, "
                                 f"not {tuple(src.shape)} -> {tuple(dst.shape)}")
            cuda.copy_async(dst.data_ptr(), src.data_ptr(), dst.nbytes, handle,
                            not dst.is_cuda, not src.is_cuda)
        if then is not None:
            then.record(handle)

    def _sleep(self, s: torch.cuda.Stream) -> None:
        torch.cuda.set_stream(s)
        try:
            torch.cuda._sleep(self.delay_cycles)
        finally:
            torch.cuda.set_stream(self.compute)

    def host_wait(self, ev: cuda.Event) -> None:
        ev.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.back.synchronize()
        self.compute.synchronize()

    def wait_seconds(self) -> float:
        """The sampled waits that have run (the host may ask mid-step: later ones count then)."""
        done = 0
        while done < len(self._timed) and self._timed[done][1].query():
            done += 1
        ms = sum(a.elapsed_ms(b) for a, b in self._timed[:done])
        del self._timed[:done]
        return ms * WAIT_SAMPLE / 1e3

    def close(self) -> None:
        self.synchronize()


class CpuEvent:
    """An event with generations: `recorded` counts records enqueued, `done` those completed.
    A wait passes once `done` reaches its generation, so an event's records must complete in
    the order they were made: each side's are, being a FIFO."""

    __slots__ = ("cond", "recorded", "done")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.recorded = 0
        self.done = 0

    def complete(self, gen: int) -> None:
        with self.cond:
            self.done = max(self.done, gen)
            self.cond.notify_all()

    def wait_for(self, gen: int) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.done >= gen, WAIT_TIMEOUT_S):
                raise RuntimeError(f"transfer event not completed after {WAIT_TIMEOUT_S:.0f}s")


class CopyThread:
    """One side's copies, run in FIFO order by a thread of its own."""

    def __init__(self, name: str, delay_s: float):
        self.delay = delay_s
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, pairs: Sequence[Pair], after: Sequence[CpuEvent], then: Sequence[CpuEvent]
            ) -> None:
        needs = [(ev, ev.recorded) for ev in after]
        records = []
        for ev in then:
            with ev.cond:
                ev.recorded += 1
                records.append((ev, ev.recorded))
        self.queue.put((needs, list(pairs), records))

    def drain(self) -> None:
        done = CpuEvent()
        self.put([], (), [done])
        done.wait_for(1)

    def close(self) -> None:
        self.queue.put(None)
        if threading.current_thread() is not self.thread:  # a pool's finalizer may run here
            self.thread.join(WAIT_TIMEOUT_S)

    def _run(self) -> None:
        # The ring's buffers are made under inference mode; writing them needs it too.
        with torch.inference_mode():
            while (item := self.queue.get()) is not None:
                needs, pairs, records = item
                try:
                    for ev, need in needs:
                        ev.wait_for(need)
                    for dst, src in pairs:
                        if self.delay:
                            time.sleep(self.delay)
                        dst.copy_(src)
                except BaseException as e:  # surfaced on the compute side's next wait
                    self.error = e
                finally:
                    for ev, gen in records:
                        ev.complete(gen)


class CpuTransport:
    """The compute side is the calling thread (its ops are finished when they return), the
    transfer and write-back sides are copy threads."""

    def __init__(self, delay_ms: float = 0.0):
        self.sides = (CopyThread("siding-transfer", delay_ms / 1e3),
                      CopyThread("siding-writeback", delay_ms / 1e3))
        self._waited = 0.0

    def event(self) -> CpuEvent:
        return CpuEvent()

    def record(self, ev: CpuEvent) -> None:
        with ev.cond:
            ev.recorded += 1
        ev.complete(ev.recorded)

    def wait(self, ev: CpuEvent) -> None:
        t0 = time.perf_counter()
        ev.wait_for(ev.recorded)
        self._waited += time.perf_counter() - t0
        self._raise()

    def copy(self, pairs: Sequence[Pair], after: Sequence[Any] = (), then: Any = None) -> None:
        self.sides[0].put(pairs, after, [] if then is None else [then])

    def copy_back(self, pairs: Sequence[Pair], after: Sequence[Any] = (), then: Any = None) -> None:
        self.sides[1].put(pairs, after, [] if then is None else [then])

    def host_wait(self, ev: CpuEvent) -> None:
        ev.wait_for(ev.recorded)
        self._raise()

    def synchronize(self) -> None:
        for side in self.sides:
            side.drain()
        self._raise()

    def wait_seconds(self) -> float:
        s, self._waited = self._waited, 0.0
        return s

    def close(self) -> None:
        for side in self.sides:
            side.close()

    def _raise(self) -> None:
        for side in self.sides:
            if side.error is not None:
                raise RuntimeError(f"a staging copy failed: {side.error}") from side.error
