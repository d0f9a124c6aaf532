"""The few CUDA calls a host-KV step makes per layer, without PyTorch's per-call cost.

A staging ring step issues about a hundred stream operations from the host: per layer a slot
wait, a graph launch, a release record and a delivery (a wait, a copy, a record). Through
PyTorch each costs 3-20 us of host time (a `copy_` walks the dispatcher and TensorIterator; a
stream switch, an event record and a graph replay each take their own locks and lookups); on an
H200 a llama-1b step at 2-3k keys is 1.8-1.9 ms of device time, and those calls alone were
about 0.7 ms of the host's 2 ms (docs/kv-pipelining.md).

So `CudaTransport`, the uploads and the step graphs make them through CuPy's bindings of the
CUDA runtime (`cupy_backends.cuda.api.runtime`, Cython: plain ints in, an exception on error),
on PyTorch's own streams, events and graphs: the handles are the driver's, shared by both, and
the runtime works in the device's primary context, which PyTorch made current. Measured side by
side on an H200 (`siding bench driver-calls`, `docs/bench/driver-calls-h200.json`), CuPy's calls
cost less host time than the hand-written ctypes bindings of libcuda this module had before and
than NVIDIA's cuda-python: a copy 1.7-1.8 us against 2.4, an event record and wait 0.8 against
2.2, a graph launch 1.8 against 2.2. CuPy is imported on first use, so a CPU worker never
needs it.
"""

from __future__ import annotations

from functools import cache
from typing import Any


class CudaError(RuntimeError):
    pass


@cache
def runtime() -> Any:
    try:
        from cupy_backends.cuda.api import runtime as rt
    except ImportError as e:
        raise CudaError("CUDA workers need CuPy for their stream operations: pip install "
                        "'siding[gpu]' (cupy-cuda12x; or cupy-cuda13x on a CUDA 13 toolkit)"
                        ) from e
    return rt


def _call(fn, *args) -> Any:
    try:
        return fn(*args)
    except runtime().CUDARuntimeError as e:
        raise CudaError(f"CUDA call failed: {e}") from None


NOT_READY = 600  # cudaErrorNotReady: eventQuery's "not yet"


class Event:
    """A CUDA event owned by this object. `timing`: it can be timed against another."""

    __slots__ = ("handle", "_destroy")

    def __init__(self, timing: bool = False):
        rt = runtime()
        self.handle = _call(rt.eventCreateWithFlags,
                            rt.eventDefault if timing else rt.eventDisableTiming)
        self._destroy = rt.eventDestroy

    def record(self, stream: int) -> None:
        _call(runtime().eventRecord, self.handle, stream)

    def synchronize(self) -> None:
        _call(runtime().eventSynchronize, self.handle)

    def query(self) -> bool:
        result = runtime().eventQuery(self.handle)  # a status, not an exception
        if result == NOT_READY:
            return False
        if result:
            raise CudaError(f"CUDA call failed: eventQuery returned {result}")
        return True

    def elapsed_ms(self, end: Event) -> float:
        return _call(runtime().eventElapsedTime, self.handle, end.handle)

    def __del__(self) -> None:
        if self.handle:
            try:
                self._destroy(self.handle)
            except Exception:  # nothing to raise to at collection (or at exit)
                pass


def wait_event(stream: int, event: Event) -> None:
    _call(runtime().streamWaitEvent, stream, event.handle, 0)


def copy_async(dst: int, src: int, nbytes: int, stream: int, dst_host: bool, src_host: bool
               ) -> None:
    """Copy `nbytes` from address `src` to `dst` on `stream`, one side on the host (page-locked,
    or the copy is synchronous) and the other on the device."""
    if src_host == dst_host:
        raise ValueError("a transport copies between the host and the device")
    rt = runtime()
    kind = rt.memcpyHostToDevice if src_host else rt.memcpyDeviceToHost
    _call(rt.memcpyAsync, dst, src, nbytes, kind, stream)


def launch_graph(graph_exec: int, stream: int) -> None:
    _call(runtime().graphLaunch, graph_exec, stream)
