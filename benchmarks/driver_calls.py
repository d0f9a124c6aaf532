"""`siding bench driver-calls`: the host cost of one CUDA stream operation, through each binding.

`worker/cuda_driver.py` makes a host-KV step's stream operations (through CuPy, since this
benchmark found it the cheapest: `docs/bench/driver-calls-h200.json` holds the run that compared
it with the hand-written ctypes bindings it replaced). This times, in one process and side by
side, the host's nanoseconds per call of siding's own functions (`siding`: the wrappers, with
what they check), CuPy's runtime API bare (`cupy`) and NVIDIA's driver bindings (`cuda-python`),
with PyTorch's own call (`torch`) as the baseline, for a 4 KiB pinned copy each way, an event
record plus a stream's wait on it, a captured graph's launch and a completed event's query.
All of them run on PyTorch's streams, graph and primary context: a handle from one is a handle
to all (cudaStream_t is CUstream).

    python -m benchmarks.driver_calls --out driver-calls.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from protocol.help_formatter import HelpFormatter
from worker import cuda_driver

from .report import format_table

OPS = ("copy_h2d", "copy_d2h", "event_record_wait", "graph_launch", "event_query")
BACKENDS = ("siding", "cupy", "cuda-python")
BASELINE = "torch"
NBYTES = 4096
# Only the calls are timed; the streams are synchronised, untimed, after every CHUNK of them. The
# driver's queue holds about a thousand pending operations before a call blocks on the device, so
# a chunk of 256 keeps every timed call a host cost and never a wait for the GPU (a 4 KiB copy
# takes the device about as long as the host takes to issue it).
CHUNK = 256
NOT_READY = 600  # cudaErrorNotReady and CUDA_ERROR_NOT_READY alike
SLEEP_CYCLES = 50_000_000  # ~25 ms of GPU time: the event under test is still pending meanwhile

NOTES = [
    "host ns per call from time.perf_counter_ns around the calls only; the streams are "
    f"synchronised, untimed, every {CHUNK} calls so the queue never fills",
    "event_record_wait is per pair: a record on the current stream and another stream's wait",
    "graph_launch: torch is graph.replay(), the others launch graph.raw_cuda_graph_exec()",
    "siding: worker/cuda_driver.py's functions as they are (over CuPy, errors checked)",
    "cupy: cupy.cuda.runtime functions bound with ints, no wrapper: they raise on error, except "
    "eventQuery, which returns the status, so its wrapper checks it",
    "cuda-python: CUstream/CUdeviceptr/CUgraphExec/CUevent objects built once outside the loop; "
    "the host pointer of a copy has no handle type (typed Any) and is passed as an int, "
    "converted by the binding inside every call; each result tuple's error is checked",
]


@dataclass(frozen=True)
class Plan:
    """Raw handles every backend works on, all from PyTorch."""

    device: int  # address of NBYTES on the device
    host_src: int  # page-locked, NBYTES
    host_dst: int  # page-locked, NBYTES
    stream: int  # torch's current stream: copies, event records, graph launches
    other: int  # the stream that waits on the event
    graph_exec: int  # cudaGraphExec_t of a captured `x.add_(1)`


@dataclass
class Calls:
    """One backend's thinnest correct calls, every argument bound."""

    h2d: Callable[[], Any]
    d2h: Callable[[], Any]
    record: Callable[[], Any]  # the backend's own event, on `stream`
    wait: Callable[[], Any]  # `other` waits on that event
    launch: Callable[[], Any]
    query: Callable[[], bool]  # is that event complete


def siding_calls(plan: Plan) -> Calls:
    event = cuda_driver.Event()
    copy = cuda_driver.copy_async
    return Calls(
        h2d=partial(copy, plan.device, plan.host_src, NBYTES, plan.stream, False, True),
        d2h=partial(copy, plan.host_dst, plan.device, NBYTES, plan.stream, True, False),
        record=partial(event.record, plan.stream),
        wait=partial(cuda_driver.wait_event, plan.other, event),
        launch=partial(cuda_driver.launch_graph, plan.graph_exec, plan.stream),
        query=event.query,
    )


def cupy_calls(plan: Plan) -> Calls:
    from cupy.cuda import runtime as rt

    # destroyed with the process: the benchmark makes one per backend
    event = rt.eventCreateWithFlags(rt.eventDisableTiming)

    def query() -> bool:
        status = rt.eventQuery(event)
        if status == NOT_READY:
            return False
        if status:
            raise rt.CUDARuntimeError(status)
        return True

    return Calls(
        h2d=partial(rt.memcpyAsync, plan.device, plan.host_src, NBYTES, rt.memcpyHostToDevice,
                    plan.stream),
        d2h=partial(rt.memcpyAsync, plan.host_dst, plan.device, NBYTES, rt.memcpyDeviceToHost,
                    plan.stream),
        record=partial(rt.eventRecord, event, plan.stream),
        wait=partial(rt.streamWaitEvent, plan.other, event, 0),
        launch=partial(rt.graphLaunch, plan.graph_exec, plan.stream),
        query=query,
    )


def cuda_python_calls(plan: Plan) -> Calls:
    from cuda.bindings import driver as cu

    def fail(err: Any) -> cuda_driver.CudaError:
        return cuda_driver.CudaError(f"CUDA driver call failed: {err!r}")

    err, event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    if err:
        raise fail(err)
    stream, other = cu.CUstream(plan.stream), cu.CUstream(plan.other)
    device, graph = cu.CUdeviceptr(plan.device), cu.CUgraphExec(plan.graph_exec)
    host_src, host_dst = plan.host_src, plan.host_dst
    h2d_fn, d2h_fn = cu.cuMemcpyHtoDAsync, cu.cuMemcpyDtoHAsync
    record_fn, wait_fn, launch_fn = cu.cuEventRecord, cu.cuStreamWaitEvent, cu.cuGraphLaunch
    query_fn = cu.cuEventQuery

    def h2d() -> None:
        err = h2d_fn(device, host_src, NBYTES, stream)[0]
        if err:
            raise fail(err)

    def d2h() -> None:
        err = d2h_fn(host_dst, device, NBYTES, stream)[0]
        if err:
            raise fail(err)

    def record() -> None:
        err = record_fn(event, stream)[0]
        if err:
            raise fail(err)

    def wait() -> None:
        err = wait_fn(other, event, 0)[0]
        if err:
            raise fail(err)

    def launch() -> None:
        err = launch_fn(graph, stream)[0]
        if err:
            raise fail(err)

    def query() -> bool:
        err = query_fn(event)[0]
        if err == NOT_READY:
            return False
        if err:
            raise fail(err)
        return True

    return Calls(h2d, d2h, record, wait, launch, query)


@dataclass
class Tensors:
    """What the plan's handles point into, kept alive for the run."""

    device: torch.Tensor  # [NBYTES] uint8
    host_src: torch.Tensor  # [NBYTES] uint8, pinned
    host_dst: torch.Tensor  # [NBYTES] uint8, pinned
    stream: torch.cuda.Stream
    other: torch.cuda.Stream
    counter: torch.Tensor  # [1] float32, what the graph increments
    graph: torch.cuda.CUDAGraph


def torch_calls(t: Tensors) -> Calls:
    event = torch.cuda.Event()
    return Calls(
        h2d=partial(t.device.copy_, t.host_src, non_blocking=True),
        d2h=partial(t.host_dst.copy_, t.device, non_blocking=True),
        record=event.record,  # on the current stream, `t.stream`
        wait=partial(t.other.wait_event, event),
        launch=t.graph.replay,
        query=event.query,
    )


def setup() -> tuple[Tensors, Plan]:
    """Buffers, two side streams (the first made current) and a captured one-kernel graph."""
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    counter = torch.zeros(1, device="cuda")
    counter.add_(1)  # loads the kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        counter.add_(1)
    t = Tensors(
        device=torch.zeros(NBYTES, dtype=torch.uint8, device="cuda"),
        host_src=torch.zeros(NBYTES, dtype=torch.uint8, pin_memory=True),
        host_dst=torch.zeros(NBYTES, dtype=torch.uint8, pin_memory=True),
        stream=stream, other=other, counter=counter, graph=graph,
    )
    plan = Plan(t.device.data_ptr(), t.host_src.data_ptr(), t.host_dst.data_ptr(),
                stream.cuda_stream, other.cuda_stream, graph.raw_cuda_graph_exec())
    torch.cuda.synchronize()
    return t, plan


def verify(calls: Calls, t: Tensors, seed: int) -> dict[str, bool]:
    """Each call does what it says, once: bytes round-trip, the graph runs, the wait orders,
    the query tells pending from done."""
    pattern = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
    t.host_src.copy_(pattern)
    t.host_dst.zero_()
    t.device.zero_()
    calls.h2d()
    calls.d2h()
    t.stream.synchronize()
    checks = {"copy_roundtrip": torch.equal(t.host_dst, pattern)}

    before = t.counter.item()
    for _ in range(3):
        calls.launch()
    t.stream.synchronize()
    checks["graph_launch"] = t.counter.item() == before + 3

    flag, seen = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    flag.fill_(1)
    calls.record()
    calls.wait()
    with torch.cuda.stream(t.other):
        seen.copy_(flag)
    checks["query_pending"] = not calls.query()
    torch.cuda.synchronize()
    checks["wait_orders"] = seen.item() == 1
    checks["query_done"] = calls.query()
    return checks


def time_round(fns: Sequence[Callable[[], Any]], n: int, sync: Callable[[], None]) -> float:
    """ns per call (per pair when two) over n calls, only the calls timed."""
    total, done = 0, 0
    while done < n:
        k = min(CHUNK, n - done)
        if len(fns) == 1:
            (f,) = fns
            t0 = time.perf_counter_ns()
            for _ in range(k):
                f()
            total += time.perf_counter_ns() - t0
        else:
            f, g = fns
            t0 = time.perf_counter_ns()
            for _ in range(k):
                f()
                g()
            total += time.perf_counter_ns() - t0
        sync()
        done += k
    return total / n


def op_calls(calls: Calls, op: str) -> tuple[Callable[[], Any], ...]:
    return {
        "copy_h2d": (calls.h2d,),
        "copy_d2h": (calls.d2h,),
        "event_record_wait": (calls.record, calls.wait),
        "graph_launch": (calls.launch,),
        "event_query": (calls.query,),
    }[op]


def measure(backends: dict[str, Calls], n: int, rounds: int) -> dict[str, dict[str, dict]]:
    """Rounds interleave the backends, so drift in clocks or load falls on all of them alike."""
    sync = torch.cuda.synchronize
    results: dict[str, dict[str, dict]] = {}
    for op in OPS:
        samples: dict[str, list[float]] = {name: [] for name in backends}
        for calls in backends.values():
            if op == "event_query":
                calls.record()  # a completed event for the query loop
                sync()
            time_round(op_calls(calls, op), CHUNK, sync)  # warm-up
        for _ in range(rounds):
            for name, calls in backends.items():
                samples[name].append(time_round(op_calls(calls, op), n, sync))
        results[op] = {name: {"median": statistics.median(s), "min": min(s)}
                       for name, s in samples.items()}
    return results


def library_versions() -> tuple[dict[str, str | None], dict[str, str]]:
    """(version of each library, or None; why each missing one is missing)."""
    versions: dict[str, str | None] = {"cupy": None, "cuda_bindings": None}
    missing: dict[str, str] = {}
    try:
        import cupy

        versions["cupy"] = cupy.__version__
    except Exception as e:  # a broken install is as missing as an absent one
        missing["cupy"] = f"{type(e).__name__}: {e}"
    try:
        import cuda.bindings

        versions["cuda_bindings"] = cuda.bindings.__version__
    except Exception as e:
        missing["cuda-python"] = f"{type(e).__name__}: {e}"
    return versions, missing


def run(n: int, rounds: int) -> dict[str, Any]:
    versions, missing = library_versions()
    t, plan = setup()
    makers: dict[str, Callable[[], Calls]] = {
        "siding": partial(siding_calls, plan),
        "cupy": partial(cupy_calls, plan),
        "cuda-python": partial(cuda_python_calls, plan),
        BASELINE: partial(torch_calls, t),
    }
    backends: dict[str, Calls] = {}
    checks: dict[str, dict[str, bool]] = {}
    errors: dict[str, str] = {}
    for seed, (name, make) in enumerate(makers.items()):
        if name in missing:
            continue
        try:
            calls = make()
            checks[name] = verify(calls, t, seed)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
            continue
        backends[name] = calls
    ns = measure(backends, n, rounds)
    names = [*BACKENDS, BASELINE]
    return {
        "machine": torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **versions,
        "calls_per_round": n,
        "rounds": rounds,
        "ns_per_call": {op: {name: ns[op].get(name) for name in names} for op in OPS},
        "correct": {name: (all(checks[name].values()) if name in checks else
                           False if name in errors else None) for name in names},
        "checks": checks,
        "missing": missing,
        "errors": errors,
        "notes": NOTES,
    }


def format_results(record: dict[str, Any]) -> str:
    """The record as a table: ns per call, median round (min round), a column a backend."""
    names = [*BACKENDS, BASELINE]

    def cell(op: str, name: str) -> str:
        ns = record["ns_per_call"][op].get(name)
        if ns is not None:
            return f"{ns['median']:.0f} ({ns['min']:.0f})"
        return "missing" if name in record["missing"] else "error"

    rows = [[op, *(cell(op, name) for name in names)] for op in OPS]
    correct = {True: "yes", False: "NO", None: "-"}
    rows.append(["correct", *(correct[record["correct"].get(name)] for name in names)])
    lines = [f"host ns per call, median of {record['rounds']} rounds of "
             f"{record['calls_per_round']} (min round); {record['machine']}",
             format_table(["op", *names], rows)]
    lines += [f"{name}: {why}" for name, why in {**record["missing"], **record["errors"]}.items()]
    return "\n".join(lines)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.driver_calls",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON record's path")
    p.add_argument("--calls", type=positive, default=20000, help="calls per round")
    p.add_argument("--rounds", type=positive, default=5, help="timed rounds")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("driver-calls: needs a CUDA device, and torch sees none "
              "(torch.cuda.is_available() is False)", file=sys.stderr)
        raise SystemExit(2)
    record = run(args.calls, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(format_results(record))
    if False in record["correct"].values():
        raise SystemExit(1)  # a backend failed its checks or its setup: its numbers mean nothing


if __name__ == "__main__":
    main(sys.argv[1:])
