"""The few CUDA driver calls a host-KV step makes per layer, without PyTorch's per-call cost.

A staging ring step issues about a hundred stream operations from the host: per layer a slot
wait, a graph launch, a release record and a delivery (a wait, a copy, a record). Through
PyTorch each costs 3-20 us of host time (a `copy_` walks the dispatcher and TensorIterator; a
stream switch, an event record and a graph replay each take their own locks and lookups); on an
H200 a llama-1b step at 2-3k keys is 1.8-1.9 ms of device time, and those calls alone were
about 0.7 ms of the host's 2 ms (docs/kv-pipelining.md). Made directly, a copy takes 5-7 us, a
graph launch 5-6 and an event wait 2-3 (measured under a timing wrapper, whose cost is in them).

So `CudaTransport` and the decode graphs call the driver directly through ctypes (no dependency:
libcuda is what every CUDA program, PyTorch included, already runs on), on PyTorch's own streams
and context: the calls are made on the thread that initialised the device through PyTorch, whose
primary context is current there. Every call's result is checked; a failure raises
`CudaError` with the driver's name for it.
"""

from __future__ import annotations

import ctypes
from functools import cache

CU_EVENT_DEFAULT = 0
CU_EVENT_DISABLE_TIMING = 2


class CudaError(RuntimeError):
    pass


@cache
def driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    p, n, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
    for name, args in [
        ("cuEventCreate", (ctypes.POINTER(p), u)),
        ("cuEventDestroy_v2", (p,)),
        ("cuEventRecord", (p, p)),
        ("cuEventQuery", (p,)),
        ("cuEventSynchronize", (p,)),
        ("cuEventElapsedTime", (ctypes.POINTER(ctypes.c_float), p, p)),
        ("cuStreamWaitEvent", (p, p, u)),
        ("cuMemcpyHtoDAsync_v2", (p, p, n, p)),
        ("cuMemcpyDtoHAsync_v2", (p, p, n, p)),
        ("cuGraphLaunch", (p, p)),
        ("cuGetErrorName", (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def check(result: int) -> None:
    if result:
        name = ctypes.c_char_p()
        driver().cuGetErrorName(result, ctypes.byref(name))
        raise CudaError(f"CUDA driver call failed: {(name.value or b'?').decode()} ({result})")


NOT_READY = 600  # CUDA_ERROR_NOT_READY: cuEventQuery's "not yet"


class Event:
    """A CUDA event owned by this object. `timing`: it can be timed against another."""

    __slots__ = ("handle", "_destroy")

    def __init__(self, timing: bool = False):
        lib = driver()
        handle = ctypes.c_void_p()
        check(lib.cuEventCreate(ctypes.byref(handle),
                                CU_EVENT_DEFAULT if timing else CU_EVENT_DISABLE_TIMING))
        self.handle = handle.value
        self._destroy = lib.cuEventDestroy_v2

    def record(self, stream: int) -> None:
        check(driver().cuEventRecord(self.handle, stream))

    def synchronize(self) -> None:
        check(driver().cuEventSynchronize(self.handle))

    def query(self) -> bool:
        result = driver().cuEventQuery(self.handle)
        if result == NOT_READY:
            return False
        check(result)
        return True

    def elapsed_ms(self, end: Event) -> float:
        ms = ctypes.c_float()
        check(driver().cuEventElapsedTime(ctypes.byref(ms), self.handle, end.handle))
        return ms.value

    def __del__(self) -> None:
        if self.handle:
            self._destroy(self.handle)  # nothing to raise to at collection


def wait_event(stream: int, event: Event) -> None:
    check(driver().cuStreamWaitEvent(stream, event.handle, 0))


def copy_async(dst: int, src: int, nbytes: int, stream: int, dst_host: bool, src_host: bool
               ) -> None:
    """Copy `nbytes` from address `src` to `dst` on `stream`, one side on the host (page-locked,
    or the copy is synchronous) and the other on the device."""
    if src_host == dst_host:
        raise ValueError("a transport copies between the host and the device")
    lib = driver()
    if src_host:
        check(lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream))
    else:
        check(lib.cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream))


def launch_graph(graph_exec: int, stream: int) -> None:
    check(driver().cuGraphLaunch(graph_exec, stream))
