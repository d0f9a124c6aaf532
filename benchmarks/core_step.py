"""`siding bench core-step`: the engine core's CPU per step, in process, without sockets.

What the core does for each step while the worker waits for the next plan (it plans step N+1
from step N's tokens): the scheduler's `next_step`, the plan's frames (`step_frames`),
`update_from_output` and the frontends' `OUTPUTS` (`Requests.outputs`, the metrics included).
Two loads:
- **decode**: `--streams` sequences of `--prompt-len` random tokens, all decoding (prefilled
  first, not timed), with the prefix cache and pages given ahead as a one-GPU cluster has them:
  CPU microseconds per step and per token, warm (steps back to back) and **cold** (a quarter of
  the steps, each half of each after a sweep of 64 MiB through the caches, not counted): in a
  cluster the core sleeps while the worker's weight reads evict everything, and on the 2-core
  CI machine it spends about three times the warm figure a token, closer to the cold one (code
  run once a step costs 5-15 times its warm time cold: `docs/benchmarks.md`);
- **cached prompt**: a `--prefix`-token prefix computed once, then requests of that prefix and
  `--question` new tokens, one at a time: the core's CPU from the `SUBMIT` to the plan's frames
  (the request's queue time before its first step, less the hops), and applying its result.

Process CPU time (`time.process_time`), `--rounds` rounds of each, median and spread. `siding
bench serve` measures the same work through real sockets and processes; this one isolates it,
so that a change to the core can be measured on any machine in seconds. `--baseline DIR` runs
the same measurement over another checkout's `coordinator` and `protocol` (in a child process,
round by round in turn with this tree's), as long as their classes take the same arguments.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import Any

from protocol.help_formatter import HelpFormatter

from .report import (
    Series,
    Spread,
    format_table,
    machine_info,
    progress,
    result_paths,
    timestamp,
    write_json,
    write_plot,
)

SCENARIO = "core-step"
ROOT = Path(__file__).resolve().parents[1]  # this checkout
PAGE_SIZE = 16
VOCAB = 32000
COLD_BYTES = 64 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="siding bench core-step", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--streams", default="32,128,256", help="decoding sequences, comma-separated")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=400, help="decode steps timed a round")
    p.add_argument("--prefix", type=int, default=2000, help="cached tokens of a request")
    p.add_argument("--question", type=int, default=24, help="its tokens after the prefix")
    p.add_argument("--requests", type=int, default=100, help="cached requests timed a round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each arm timed in turn")
    p.add_argument("--baseline", metavar="DIR", default=None,
                   help="another checkout, measured in turn with this one")
    p.add_argument("--out", default="bench-results", help="directory for the JSON and PNG")
    # one round over the checkout --child names, printed as JSON
    p.add_argument("--child", metavar="DIR", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # the child's round
    a = p.parse_args(argv)
    a.streams = [int(x) for x in a.streams.split(",")]
    if min(a.streams) < 1 or min(a.prompt_len, a.steps, a.prefix, a.question, a.requests,
                                 a.rounds) < 1:
        p.error("every count must be at least 1")
    return a


def _core(streams: int):
    """A scheduler with the prefix cache, planning ahead, its requests, as a one-GPU core has
    them (the classes of whichever checkout is on the path: before planning ahead, a core
    gave pages ahead instead)."""
    import inspect
    from types import SimpleNamespace

    from coordinator.metrics import CoordinatorMetrics
    from coordinator.page_allocator import PageAllocator
    from coordinator.prefix_cache import PrefixCache
    from coordinator.requests import Requests
    from coordinator.scheduler import Scheduler

    pool = PageAllocator(1 << 16)
    cache = PrefixCache(pool, PAGE_SIZE, "bench|bfloat16|exact=False")
    ahead = {"plan_ahead": True} if "plan_ahead" in inspect.signature(Scheduler).parameters \
        else {"lookahead": 2}
    scheduler = Scheduler(pool, PageAllocator(1 << 16), PAGE_SIZE, max(64, streams), 512,
                          prefix_cache=cache, **ahead)
    scheduler.set_model(frozenset([0]), 1 << 20)
    metrics = CoordinatorMetrics()
    metrics.watch_prefix_cache(cache)
    requests = Requests(scheduler, SimpleNamespace(send=lambda *a, **k: None), metrics,
                        1 << 20, 1 << 20)
    return scheduler, requests


def _submit(requests, key: int, prompt: list[int], max_tokens: int) -> None:
    from protocol.messages import Submit
    from protocol.sampling import SamplingParams

    msg = Submit(key=key, n_prompt=len(prompt),
                 sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                 arrival=time.monotonic(), client=f"client {key}")
    requests.submit(0, msg, memoryview(array("i", prompt).tobytes()), VOCAB, None)


def _step(scheduler, requests, step: int, rng: random.Random, between=None) -> int:
    """One step through the core; the worker's tokens are random; `between()` runs between the
    plan and its result. Returns its rows."""
    from coordinator import plan
    from protocol import wire

    sched = scheduler.next_step()
    requests.scheduled(sched, time.monotonic())
    if hasattr(plan, "step_frames"):
        plan.step_frames(step, sched)
    else:  # a checkout from before the plan was written straight into its frames
        wire.encode(plan.step_plan(step, sched))
    if between is not None:
        between()
    ids = [seq.id for seq, n in sched.batch if seq.n_computed + n == len(seq.token_ids)]
    out = scheduler.update_from_output(sched, ids, [rng.randrange(1, VOCAB) for _ in ids])
    requests.outputs(out, time.monotonic())
    return sum(n for _, n in sched.batch)


def decode_round(streams: int, prompt_len: int, steps: int, seed: int,
                 cold: bool = False) -> float:
    """CPU seconds a decode step of `streams` sequences; `cold`: each step's two halves start
    with the caches evicted (`Evictor`), which is not counted."""
    rng = random.Random(seed)
    scheduler, requests = _core(streams)
    for key in range(streams):
        _submit(requests, key, [rng.randrange(1, VOCAB) for _ in range(prompt_len)], 1 << 20)
    step = 0
    while scheduler.waiting or any(s.n_remaining > 1 for s in scheduler.running):
        _step(scheduler, requests, step, rng)
        step += 1
    for _ in range(20):  # every sequence decoding
        _step(scheduler, requests, step, rng)
        step += 1
    if not cold:
        t0 = time.process_time()
        for i in range(steps):
            _step(scheduler, requests, step + i, rng)
        return (time.process_time() - t0) / steps
    evict = Evictor()
    for i in range(steps):
        evict()
        _step(scheduler, requests, step + i, rng, between=evict)
    return evict.counted / steps


class Evictor:
    """Sweeps COLD_BYTES (past the last-level cache) between the stretches it times, as the
    worker's weight reads do while the core sleeps between steps; `counted`: the process CPU
    time between its calls, less the sweeps."""

    def __init__(self) -> None:
        self.sweep = bytearray(COLD_BYTES)
        self.counted, self.last = 0.0, None

    def __call__(self) -> None:
        now = time.process_time()
        if self.last is not None:
            self.counted += now - self.last
        self.sweep[::64] = bytes(COLD_BYTES // 64)  # a write to every cache line
        self.last = time.process_time()


def cached_round(prefix: int, question: int, n: int, seed: int) -> float:
    """CPU seconds from a cached request's SUBMIT to its plan's frames and its result applied."""
    rng = random.Random(seed)
    scheduler, requests = _core(1)
    shared = [rng.randrange(1, VOCAB) for _ in range(prefix)]
    key, step = 0, 0
    _submit(requests, key, shared, 1)
    while scheduler.has_work:  # the prefix, computed and cached
        _step(scheduler, requests, step, rng)
        step += 1
    total = 0.0
    for _ in range(n):
        key += 1
        prompt = shared + [rng.randrange(1, VOCAB) for _ in range(question)]
        t0 = time.process_time()
        _submit(requests, key, prompt, 1)
        rows = _step(scheduler, requests, step, rng)
        total += time.process_time() - t0
        step += 1
        if rows != question:
            raise RuntimeError(f"a cached request ran {rows} rows, not {question}")
    return total / n


def one_round(a: argparse.Namespace, r: int) -> dict[str, Any]:
    return {"decode": {str(s): decode_round(s, a.prompt_len, a.steps, r) for s in a.streams},
            "decode_cold": {str(s): decode_round(s, a.prompt_len, max(1, a.steps // 4), r,
                                                 cold=True) for s in a.streams},
            "cached": cached_round(a.prefix, a.question, a.requests, r)}


def child_round(a: argparse.Namespace, root: str, r: int) -> dict[str, Any]:
    """A round over `root`'s coordinator and protocol, in a child process (this module, the
    measurement, stays this checkout's)."""
    argv = [sys.executable, "-m", "benchmarks", SCENARIO, "--child", root, "--seed", str(r),
            "--streams", ",".join(map(str, a.streams)), "--prompt-len", str(a.prompt_len),
            "--steps", str(a.steps), "--prefix", str(a.prefix), "--question", str(a.question),
            "--requests", str(a.requests)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.child:
        if "coordinator" in sys.modules:
            raise RuntimeError("the core was imported before its checkout was chosen")
        sys.path.insert(0, a.child)
        print(json.dumps(one_round(a, a.seed)))
        return
    stamp = timestamp()
    arms = {"siding": None, **({"baseline": a.baseline} if a.baseline else {})}
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for r in range(a.rounds):
        for arm, root in arms.items():
            rounds[arm].append(child_round(a, str(Path(root).resolve() if root else ROOT), r))
        progress(SCENARIO, f"round {r + 1} of {a.rounds}")
    results = {}
    for arm in arms:
        results[arm] = {
            "decode_us_per_token": {s: Spread.of([x["decode"][str(s)] / s * 1e6
                                                  for x in rounds[arm]]) for s in a.streams},
            "cold_us_per_token": {s: Spread.of([x["decode_cold"][str(s)] / s * 1e6
                                                for x in rounds[arm]]) for s in a.streams},
            "cached_us": Spread.of([x["cached"] * 1e6 for x in rounds[arm]]),
        }
    headers = ["arm", *(f"{s} streams us/token" for s in a.streams),
               *(f"{s} cold" for s in a.streams), "cached request us"]
    rows = [[arm, *(r["decode_us_per_token"][s].text() for s in a.streams),
             *(r["cold_us_per_token"][s].text() for s in a.streams),
             r["cached_us"].text(digits=0)] for arm, r in results.items()]
    table = format_table(headers, rows)
    record = {"scenario": SCENARIO, "command": " ".join(["siding", "bench", SCENARIO,
                                                         *(argv or sys.argv[1:])]),
              "started": stamp, "config": vars(a), "machine": machine_info("cpu"),
              "results": results, "rounds": rounds}
    json_path, png_path = result_paths(a.out, SCENARIO, stamp)
    write_json(json_path, record)
    write_plot(png_path, [
        Series(arm, a.streams, [r["decode_us_per_token"][s] for s in a.streams])
        for arm, r in results.items()],
        "engine core CPU per decode step, in process", "decoding streams",
        "CPU us per token")
    print(table)
    print(f"results: {json_path}, {png_path}")
