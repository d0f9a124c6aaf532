"""`siding bench kv-pipeline`: host-KV decode, ordered (depth 0) against pipelined (depths 1, 2,
4), across context lengths and batch sizes (`--batch 1,8,32`).

Runs in-process on ModelRunners over one loaded stage (no cluster), so the numbers are the
worker's and the ring's, not the sockets'. Every arm decodes the same B sequences, each at the
context length on pages of its own, from the same KV bytes (random: the context is already in
the pool), one token each a step; the arms take turns, `--steps` steps each per round, so load
from elsewhere lands on all of them alike; a turn starts with the device idle (the arm before
may have left copies in flight) and one untimed step (the primes it finds landed long ago).
Measured in the same run, per point:

- compute: the same decode with KV on the device (`--kv device`), a step without copies;
- copy: one step's deliveries alone (every layer's window of all B sequences' pages);
- ceiling: max(copy, compute), the best a pipelined step can do (ordered pays copy + compute);
- link: one large pinned host -> device copy.

The ring's slots hold up to 4 layers each by default (a captured step launches a graph per
slot's layers rather than per layer); `--slot-layers 1,2` adds an arm per depth and value whose
slots hold at most that many ("depth N x1", "depth N x2").

With `--ahead`, every arm also runs overlapped ("ahead device", "ahead ordered", "ahead depth
N"): each step is enqueued on the last step's greedy tokens while they are still on the device,
and the host reads them only after, as an overlapping worker does one step ahead
(`worker/overlap.py`, `docs/overlap-scheduling.md`). An overlapped arm's ceiling is max(copy,
the overlapped device arm), its speed-up over the overlapped ordered arm.

Every arm holds its own pool (each host pool pinned), so B x context is bounded by memory: a
point whose host pools would take more than half of this machine's memory is skipped and says
so. Reported, per (batch, context): step time (a round's mean, median over rounds) and tokens/s
per arm (B tokens a step), single steps' p50/p90/p99 (a slow step in a round shows there, not
in the mean), speed-up over ordered, fraction of the ceiling, achieved H2D bandwidth (a step's
KV bytes over the copy time, and over each arm's step time) against the link, bytes per copy,
ring bytes, compute-side waits, declines, and whether every arm produced the same tokens (and if
not, where each first differs).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coordinator.page_allocator import pages_for
from protocol.help_formatter import HelpFormatter
from protocol.messages import SeqPlan, Step
from worker.build import build_runner, load_stage, make_pool
from worker.kv.device_pool import KVPool
from worker.kv.host_pool import HostKVPool
from worker.loaders import resolve
from worker.overlap import TokenCopy
from worker.runner import ModelRunner

from .link import pinned_bandwidth, sync
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

SCENARIO = "kv-pipeline"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_SEED = 0
FIRST_TOKEN = 1000  # the decode's first input token (modulo the vocabulary)
PROFILE_STEPS = 4  # a trace of more is too large to be read comfortably
PHASES = ("apply", "forward", "sample", "device forward")
STEP_QUANTILES = (50, 90, 99)


@dataclass
class Arm:
    name: str  # "device", "ordered", "depth N" or "depth N xG", "ahead ..." when overlapped
    runner: ModelRunner
    pool: KVPool | HostKVPool
    pages: list[list[int]]  # each sequence's
    position: int  # every sequence's
    inputs: list[int]  # each sequence's next input token
    # Overlapped steps (docs/overlap-scheduling.md): each step is enqueued on the last one's
    # greedy tokens, still on the device, before the host reads them.
    ahead: bool = False
    next_input: torch.Tensor | None = None  # the last step's tokens, on the device
    unread: TokenCopy | None = None  # their copy to the host, not read yet
    steps: int = 0
    tokens: list[list[int]] = field(default_factory=list)  # each step's, every sequence's
    step_seconds: list[float] = field(default_factory=list)  # one sample per round
    each_step: list[float] = field(default_factory=list)  # every timed step's wall time
    # seconds summed over timed steps: host time in apply, in forward (enqueueing the step), in
    # sample (the wait for the device included), and the device's time from the forward's
    # first enqueued work to its last (CUDA events)
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    timed: int = 0
    # CUDA events around each timed step's forward, read at the round's end: an overlapped
    # step's have not completed when the next step is enqueued
    forward_events: list[tuple[Any, Any]] = field(default_factory=list)

    def step(self, timed: bool = False) -> None:
        first = self.steps == 0
        plan = Step(step=self.steps, token_ids=list(self.inputs), seqs=[SeqPlan(
            id=b + 1, start=self.position, n=1, pages_add=pages if first else [], sample=True)
            for b, pages in enumerate(self.pages)])
        cuda = self.runner.device.type == "cuda"
        t0 = time.perf_counter()
        meta = self.runner.apply(plan)
        t1 = time.perf_counter()
        if cuda:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        if not self.ahead:
            hidden = self.runner.forward(plan, meta, None)
        else:  # the plan's tokens are used only by the first step
            hidden = self.runner.forward(plan, meta, None, self.next_input)
            self.next_input = self.runner.draw(plan, meta, hidden)
        if cuda:
            events[1].record()
        t2 = time.perf_counter()
        if not self.ahead:
            _, self.inputs = self.runner.sample(plan, meta, hidden)  # waits for the device
            self.tokens.append(self.inputs)
        else:  # the last step's tokens: this step is already enqueued behind them
            self.read()
            self.unread = TokenCopy.start(self.next_input)
        t3 = time.perf_counter()
        if timed:
            self.timed += 1
            for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                self.phases[name] += seconds
            if cuda:
                self.forward_events.append(events)
        self.position += 1
        self.steps += 1

    def read(self) -> None:
        """An overlapped arm's last tokens, once the device has them; a no-op when read."""
        if self.unread is not None:
            self.inputs = self.unread.read()
            self.tokens.append(self.inputs)
            self.unread = None

    def round(self, steps: int) -> float:
        """`steps` timed steps after one untimed one, so that the timed ones run as in a
        steady state: each pays for the primes it uses (the untimed step's primes land during
        the first) and leaves its own in flight."""
        sync(self.runner.device)  # the last arm's copies would hold the link at this turn's start
        self.step()
        t0 = t = time.perf_counter()
        for _ in range(steps):
            self.step(timed=True)
            self.each_step.append(-t + (t := time.perf_counter()))
        sync(self.runner.device)
        device_ms = sum(a.elapsed_time(b) for a, b in self.forward_events)
        self.phases["device forward"] += device_ms / 1e3
        self.forward_events.clear()
        return (t - t0) / steps


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="siding bench kv-pipeline", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="synthetic:llama-1b" if cuda else "synthetic:smollm2-135m",
                   help="any --model spec (synthetic shapes need no checkpoint)")
    p.add_argument("--device", default="cuda:0" if cuda else "cpu", help="cpu or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="as `siding launch --dtype`")
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768" if cuda
                   else "256,1024,2048", help="context lengths, comma-separated")
    p.add_argument("--depths", default="1,2,4", help="pipelined depths, comma-separated")
    p.add_argument("--batch", default="1",
                   help="sequences decoded together, comma-separated (each at every context)")
    p.add_argument("--slot-layers", default="",
                   help="the most layers a ring slot holds, comma-separated: each value adds an "
                   "arm per depth, named 'depth N xG', beside the default slots")
    p.add_argument("--steps", type=int, default=16, help="decode steps per arm per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of every arm")
    p.add_argument("--warmup", type=int, default=4, help="decode steps per arm before timing")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--ring-budget-mib", type=int, default=512, help="as `siding launch`")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--transport-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--profile", type=int, default=0, metavar="CONTEXT",
                   help="at this context, also profile a few steps of the ordered arm and of the "
                   "first depth (torch.profiler: tables and Chrome traces under --out)")
    p.add_argument("--ahead", action="store_true",
                   help="also run every arm overlapped: each step enqueued on the last one's "
                   "token still on the device, before the host reads it (greedy)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly, as `siding launch --no-cuda-graphs`")
    p.add_argument("--out", default="bench-results", help="directory for the results")
    a = p.parse_args(argv)
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.depths = [int(x) for x in a.depths.split(",")]
    a.batch = [int(x) for x in a.batch.split(",")]
    a.slot_layers = [int(x) for x in a.slot_layers.split(",") if x]
    if (min(a.contexts) < 1 or min(a.depths) < 1 or min(a.batch) < 1
            or min(a.slot_layers, default=1) < 1 or a.steps < 1 or a.rounds < 1):
        p.error("contexts, depths, --batch, --slot-layers, --steps and --rounds must be positive")
    return a


def host_arms(a: argparse.Namespace) -> list[tuple[str, int, int | None]]:
    """The host-KV arms: (name, ring depth, most layers a slot holds or None)."""
    return [("ordered", 0, None), *((f"depth {d}" + (f" x{g}" if g else ""), d, g)
                                    for d in a.depths for g in [None, *a.slot_layers])]


def arm_names(a: argparse.Namespace) -> list[str]:
    """The arms `build_arms` makes, in order: the device arm first, the host arms after it."""
    names = ["device", *(name for name, _, _ in host_arms(a))]
    return names + [f"ahead {n}" for n in names] if a.ahead else names


def build_arms(stage, args, context: int, total_steps: int, dtype: torch.dtype,
               device: torch.device, a: argparse.Namespace,
               graphs: bool = False, batch: int = 1) -> list[Arm]:
    """A device-KV arm, an ordered arm and one per depth, and with `--ahead` an overlapped twin
    of each, every pool holding the same KV for `batch` sequences of `context` positions; each
    with step graphs of its own when `graphs`."""
    per_seq = pages_for(context + total_steps, a.page_size)  # a sequence's
    n_pages = batch * per_seq
    pools: dict[str, KVPool | HostKVPool] = {}
    for prefix in ("", "ahead ") if a.ahead else ("",):
        pools[prefix + "device"] = make_pool(stage, n_pages, a.page_size, device)
        for name, depth, group in host_arms(a):
            pools[prefix + name] = make_pool(
                stage, n_pages, a.page_size, device, kv="host", depth=depth,
                ring_budget_mib=a.ring_budget_mib, slot_layers=group,
                delay_ms=a.transport_delay_ms)
    first = pools["ordered"]
    g = torch.Generator().manual_seed(KV_SEED)
    for layer in range(args.n_layers):  # a layer at a time: a float32 draw of it all is large
        first.kv[layer] = torch.randn(first.kv[layer].shape, generator=g).to(dtype)
    for pool in pools.values():
        if pool is not first:
            pool.k.copy_(first.k)
            pool.v.copy_(first.v)
    pages = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    inputs = [(FIRST_TOKEN + b) % args.vocab_size for b in range(batch)]
    return [Arm(name, build_runner(stage, pool, device, graphs=graphs), pool, pages, context,
                inputs, ahead=name.startswith("ahead "))
            for name, pool in pools.items()]


def copy_seconds(pool: HostKVPool, windows: list[range], device: torch.device,
                 repeats: int = 5) -> list[float]:
    """One step's deliveries alone: every layer's window of each sequence's pages (`windows`,
    contiguous page ids each), one copy each."""
    dst = torch.empty((sum(map(len, windows)), *pool.kv.shape[2:]), dtype=pool.kv.dtype,
                      device=device)
    parts = dst.split([len(w) for w in windows])
    samples = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        for layer in range(pool.kv.shape[0]):
            for part, w in zip(parts, windows):
                part.copy_(pool.kv[layer, w.start:w.stop], non_blocking=True)
        sync(device)
        samples.append(time.perf_counter() - t0)
    return samples[1:]  # the first pays for warm-up


def total_steps(context: int, a: argparse.Namespace) -> int:
    """Steps each arm decodes at `context`: warm-up, rounds, and a profile's."""
    return a.warmup + (1 + a.steps) * a.rounds + (1 + PROFILE_STEPS) * (context == a.profile)


def host_bytes(args, batch: int, context: int, a: argparse.Namespace, dtype: torch.dtype) -> int:
    """Pinned memory the point's host pools take: each holds every layer's K and V."""
    pages = batch * pages_for(context + total_steps(context, a), a.page_size)
    per_pool = 2 * args.n_layers * pages * a.page_size * args.n_kv_heads * args.head_dim * (
        dtype.itemsize)
    return per_pool * len(host_arms(a)) * (2 if a.ahead else 1)


def run_context(stage, args, context: int, dtype, device, a, link: Spread,
                graphs: bool, batch: int = 1) -> dict[str, Any]:
    arms = build_arms(stage, args, context, total_steps(context, a), dtype, device, a, graphs,
                      batch)
    ordered = arms[1].pool
    per_seq = pages_for(context + 1, a.page_size)  # a sequence's pages in the first timed step
    window = batch * per_seq
    kv_bytes = args.n_layers * window * ordered.ring.page_bytes  # a step's deliveries
    copy = Spread.of(copy_seconds(ordered, [range(p[0], p[0] + per_seq) for p in arms[1].pages],
                                  device))
    for arm in arms:
        for _ in range(a.warmup):
            arm.step()
    for r in range(a.rounds):
        for arm in arms:
            arm.step_seconds.append(arm.round(a.steps))
        progress(SCENARIO, f"batch {batch}, context {context}: round {r + 1}/{a.rounds}  "
                 + "  ".join(f"{arm.name} {arm.step_seconds[-1] * 1e3:.2f} ms" for arm in arms))
    for arm in arms:
        arm.read()  # an overlapped arm's last token
    timed = a.warmup + a.rounds * (1 + a.steps)
    if context == a.profile:
        for arm in arms[:3]:
            profile(arm, PROFILE_STEPS, device, f"{a.out}/{SCENARIO}-{timestamp()}-{context}-"
                    f"{arm.name.replace(' ', '')}")
    by_name = {arm.name: arm for arm in arms}
    compute = Spread.of(arms[0].step_seconds)
    # an overlapped arm against the overlapped device arm and ordered path
    kind = {prefix: (max(copy.median, Spread.of(by_name[prefix + "device"].step_seconds).median),
                     Spread.of(by_name[prefix + "ordered"].step_seconds).median)
            for prefix in ("", "ahead ") if prefix + "device" in by_name}
    ceiling = kind[""][0]  # max(copy, compute)
    mismatch = {}  # arm -> the first step whose token is not the device arm's
    for arm in arms:
        for i, (x, y) in enumerate(zip(arm.tokens[:timed], arms[0].tokens[:timed], strict=True)):
            if x != y:
                mismatch[arm.name] = i
                break
    out: dict[str, Any] = {
        "batch": batch, "context": context, "window_pages": window, "kv_bytes_per_step": kv_bytes,
        "copy_s": copy, "copy_bytes_per_s": kv_bytes / copy.median,
        "copy_of_link": kv_bytes / copy.median / link.median,
        "compute_s": compute, "ceiling_s": ceiling, "ordered_model_s": copy.median + compute.median,
        "identical_tokens": not mismatch,
        "first_mismatch": mismatch,
        "arms": {},
    }
    if "ahead " in kind:
        out["ahead_ceiling_s"] = kind["ahead "][0]
    for arm in arms:
        t = Spread.of(arm.step_seconds)
        arm_ceiling, ordered_time = kind["ahead " if arm.ahead else ""]
        rec: dict[str, Any] = {"step_s": t, "tokens_per_s": batch / t.median,
                               "over_ordered": ordered_time / t.median,
                               "of_ceiling": arm_ceiling / t.median,
                               "effective_bytes_per_s": kv_bytes / t.median,
                               "step_quantiles_s": quantiles(arm.each_step),
                               "phase_s_per_step": {k: v / max(arm.timed, 1)
                                                    for k, v in arm.phases.items()}}
        if isinstance(arm.pool, HostKVPool):
            ring = arm.pool.ring
            arm.pool.settle()
            s = ring.stats
            copies = sum(s.copies[p] for p in ("ahead", "ordered"))
            rec.update(ring_bytes=ring.capacity * ring.page_bytes, ring_slots=ring.n_slots,
                       slot_layers=ring.group,
                       declines=dict(s.declines), ring_steps=s.ring_steps,
                       ordered_steps=s.ordered_steps, primed_steps=s.primed_steps,
                       bytes_per_copy=sum(s.bytes[p] for p in ("ahead", "ordered")) / copies,
                       wait_s_per_step=s.wait_seconds / arm.steps)
        out["arms"][arm.name] = rec
    return out


def profile(arm: Arm, steps: int, device: torch.device, stem: str) -> None:
    """`steps` steps of `arm` under torch.profiler: host and device time by op (cudaMemcpyAsync,
    cudaStreamWaitEvent, synchronizations, kernels), written to stem.txt and stem.trace.json."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with torch_profile(activities=activities) as prof:
        arm.round(steps)
        sync(device)
    averages = prof.key_averages()
    text = [f"{arm.name}, {steps} steps"]
    for key in ("self_cpu_time_total", "self_device_time_total")[:len(activities)]:
        text.append(averages.table(sort_by=key, row_limit=25))
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.txt").write_text("\n".join(text) + "\n")
    prof.export_chrome_trace(f"{stem}.trace.json")
    progress(SCENARIO, f"profile of {arm.name}: {stem}.txt")


def table(points: list[dict[str, Any]], link: Spread) -> str:
    headers = ["batch", "context", "arm", "ms/step", "tok/s", "x ordered", "of ceiling", "eff GB/s",
               "of link", "MiB/copy", "ring MiB", "layers/slot", "declines", "primed", "wait ms"]
    rows = []
    for p in points:
        rows.append([p["batch"], p["context"], "copy alone", p["copy_s"].text(1e3, 2), "", "", "",
                     f"{p['copy_bytes_per_s'] / 1e9:.1f}", f"{p['copy_of_link']:.2f}", "", "",
                     "", "", "", ""])
        for name, r in p["arms"].items():
            ring = "ring_bytes" in r
            rows.append([
                "", "", name, r["step_s"].text(1e3, 2), f"{r['tokens_per_s']:.1f}",
                f"{r['over_ordered']:.2f}", f"{r['of_ceiling']:.2f}",
                f"{r['effective_bytes_per_s'] / 1e9:.1f}",
                f"{r['effective_bytes_per_s'] / link.median:.2f}",
                f"{r['bytes_per_copy'] / 2**20:.2f}" if ring else "",
                f"{r['ring_bytes'] / 2**20:.0f}" if ring else "",
                r["slot_layers"] if ring else "",
                sum(r["declines"].values()) if ring else "",
                f"{r['primed_steps'] / (r['ring_steps'] + r['ordered_steps']):.2f}"
                if ring else "",
                f"{r['wait_s_per_step'] * 1e3:.2f}" if ring else "",
            ])
    return format_table(headers, rows)


def quantiles(samples: list[float]) -> dict[str, float]:
    """p50, p90 and p99 of the samples (nearest rank)."""
    ordered, n = sorted(samples), len(samples)
    return {f"p{q}": ordered[min(n - 1, n * q // 100)] for q in STEP_QUANTILES}


def phase_table(points: list[dict[str, Any]]) -> str:
    """Where a timed step's wall time goes, per arm: host time in each phase, and the device's
    span of the forward (longer than its host time: the step is the device's or the link's);
    then the spread of single steps (a round's mean mixes the steady state with slow steps)."""
    arms = [(f"{p['batch']} x {p['context']}" if i == 0 else "", name, r["phase_s_per_step"],
             r["step_quantiles_s"])
            for p in points for i, (name, r) in enumerate(p["arms"].items())]
    phases = PHASES if any(t["device forward"] for _, _, t, _ in arms) else PHASES[:-1]  # CUDA
    rows = [[c, name, *(f"{t[k] * 1e3:.2f}" for k in phases),
             *(f"{v * 1e3:.2f}" for v in q.values())] for c, name, t, q in arms]
    return format_table(["batch x context", "arm", *(f"{k} ms" for k in phases),
                         *(f"step p{q} ms" for q in STEP_QUANTILES)], rows)


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = DTYPES.get(a.dtype, torch.float32 if device.type == "cpu" else torch.bfloat16)
    source = resolve(a.model)
    args = source.args
    progress(SCENARIO, f"loading {a.model} ({dtype}, {device})")
    stage = load_stage(source, dtype, device)
    graphs = a.cuda_graphs and device.type == "cuda"
    link = pinned_bandwidth(device, "h2d", nbytes=1 << 30 if device.type == "cuda" else 1 << 28)
    progress(SCENARIO, f"pinned link h2d {link.text(1e-9, 1)} GB/s")
    points, skipped = [], []
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for batch in a.batch:
        for context in a.contexts:
            need = host_bytes(args, batch, context, a, dtype)
            if need > memory // 2:
                skipped.append({"batch": batch, "context": context, "host_bytes": need})
                progress(SCENARIO, f"batch {batch}, context {context} skipped: its host pools "
                         f"would take {need / 2**30:.1f} GiB of {memory / 2**30:.1f}")
                continue
            points.append(run_context(stage, args, context, dtype, device, a, link, graphs,
                                      batch))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last point's pools go before the next one's come
    if not points:
        raise SystemExit("kv-pipeline: every point was skipped (see above)")
    stamp = timestamp()
    json_path, png_path = result_paths(a.out, SCENARIO, stamp)
    write_json(json_path, {
        "scenario": SCENARIO, "command": " ".join(["siding", "bench", SCENARIO, *argv]),
        "started": stamp, "config": vars(a) | {"dtype": str(dtype)},
        "method": "in-process ModelRunners, arms interleaved per round",
        "link_h2d_bytes_per_s": link, "points": points, "skipped": skipped,
        "machine": machine_info(a.device),
    })
    series = []
    for batch in sorted({p["batch"] for p in points}):
        mine = [p for p in points if p["batch"] == batch]
        xs = [p["context"] for p in mine]
        tag = f", batch {batch}" if len(a.batch) > 1 else ""
        series += [Series(n + tag, xs, [Spread.of([batch / s for s in (
            p["arms"][n]["step_s"].min, p["arms"][n]["step_s"].median,
            p["arms"][n]["step_s"].max)]) for p in mine]) for n in mine[0]["arms"]]
        series.append(Series("ceiling batch / max(copy, compute)" + tag, xs,
                             [Spread.of([batch / p["ceiling_s"]]) for p in mine]))
    write_plot(png_path, series, f"host KV decode, {a.model} {dtype}, batch "
               f"{','.join(map(str, a.batch))}, {machine_info(a.device)['device_name']}",
               "context (tokens)", "tokens/s")
    print(f"pinned link h2d {link.text(1e-9, 1)} GB/s")
    print(table(points, link))
    print(phase_table(points))
    print("identical tokens in every arm: " + ", ".join(
        f"{p['batch']} x {p['context']}: {p['identical_tokens']}" for p in points))
    for p in points:
        for name, step in p["first_mismatch"].items():
            print(f"  {p['batch']} x {p['context']}: {name} first differs at step {step}")
    for x in skipped:
        print(f"skipped {x['batch']} x {x['context']}: its host pools would take "
              f"{x['host_bytes'] / 2**30:.1f} GiB")
    print(f"wrote {json_path} and {png_path}")
