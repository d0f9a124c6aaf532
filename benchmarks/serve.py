"""`siding bench serve`: a running cluster as a serving engine, measured at its client endpoint
by concurrent streaming clients, beside the worker's own decode step rate at the same batch.

Load comes from `--client-procs` client processes (`python -m benchmarks.serve_load`; auto: one
per 8 streams, as the cores allow, benchmarks/client_procs.py), each running its share of the
streams and handing its per-request records back as JSON; client i uses endpoint i % N of the
(comma-separated) endpoints the cluster reports. `--api zmq` streams through
`protocol.AsyncClient`s, `--api http` through the OpenAI API with the official `openai` client
(`AsyncOpenAI`, completions with token-id prompts), `--api zmq,http` both on one cluster.
Two modes:

- closed (`--concurrency 16,64`): C clients, each sending its next request when its last one
  ends, starting spread over the first half of the warm-up (so that, with fixed lengths, they do
  not finish and prefill in lockstep ever after);
- open (`--rate 2,8`): Poisson arrivals at R requests/s, each request a task of its own.

Every request is random token ids (no prefix is shared), `ignore_eos`, greedy, `max_tokens` its
output length; lengths are fixed or uniform in [len/2, 3*len/2] (`--len-dist`), seeded. Each point
runs `--warmup` seconds, not counted, then a measured window of `--duration` seconds (or until
each client has sent `--requests-per-client` requests after the warm-up); requests in flight at
its end finish (or, past DRAIN_S, are aborted) but their later tokens do not count. All clocks
are CLOCK_MONOTONIC, which Linux shares across processes.

Columns, per concurrency or rate:
- in flight: requests sent and not yet ended, averaged over the window;
- tok/s: tokens received by the clients in the window over its length; req/s: requests that
  ended in it without an error;
- in-proc tok/s: a ceiling, decode steps of the whole model in this process, batch the
  concurrency (open loop: the mean in flight, at most --max-batch-seqs), context the prompt
  length, KV on the device, CUDA graphs on CUDA; timed apart from the cluster, never while it
  runs; "of in-proc" is tok/s over it;
- same-work tok/s: the same steps with the load's prompts in them, batch / output length
  prompts a step on average, each in the place of a decode row (benchmarks/serve_ceiling.py):
  the worker's rate on the work the cluster does, steps run one after another as in the
  decode ceiling (a cluster that plans ahead can pass it); "of same-work" is tok/s over it;
- ttft, itl (gaps between successive chunks of tokens of one request), e2e: p50 and p99 over
  the requests sent in the window;
- CPU microseconds per output token of the engine core, the frontends, the workers, and of all
  but the workers (non-worker), from utime + stime in /proc/<pid>/stat at the window's ends
  (the idle cluster's cores, read once before the first point, after the busy-poll window its
  start-up opened, are in the record: at low rates they are a good part of it); a second table
  gives each process, with the bench's own client processes, and the cores it kept busy;
- others cores: the cores the rest of the machine kept busy meanwhile (/proc/stat's busy time
  less all of the above): on a shared machine, the load that skews the point;
- step busy: the share of the window the last stage spent in steps (its
  `siding_forward_seconds`, scraped from its metrics at the window's ends): near 1, the cluster
  runs as fast as its steps, and the engine core and frontends do not hold the worker back;
- clients: the client processes, "limited" where one kept more than 0.9 of a core busy in the
  window (its one Python thread saturated: the bench, not the cluster, set the rate; the record's
  `client_limited` and `client_limited_why` say so and what to rerun with);
- errors: requests sent in the window that failed or were cut off.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shlex
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.cli import build_parser
from coordinator.config import threads_per_worker, usable_cores
from coordinator.local_cluster import LocalCluster, checkout_env
from coordinator.prometheus_config import free_metrics_port, worker_ports
from protocol.busy_poll import busy_seconds
from protocol.help_formatter import HelpFormatter
from worker.build import resolve_dtype
from worker.loaders import DEFAULT_MODEL, resolve

from .client_procs import STREAMS_PER_CLIENT, auto_client_procs, client_limit
from .decode import dtype_name
from .kv_pipeline import quantiles
from .proc_cpu import (
    cluster_processes,
    cpu_by_kind,
    cpu_use,
    idle_cores,
    machine_busy,
    read_cpu,
)
from .report import (
    Series,
    Spread,
    check_baseline_client,
    client_processes,
    client_result,
    expect,
    format_table,
    log_path,
    machine_info,
    progress,
    result_paths,
    timestamp,
    write_json,
    write_plot,
)
from .serve_ceiling import INPROCESS_ROUNDS, PAGE_SIZE, add_ceilings
from .serve_load import poisson_arrivals

SCENARIO = "serve"
START_S = 0.5  # from the go signal to the clients' first requests
OTHERS_BUSY = 0.2  # cores the rest of the machine may keep busy before a point is called skewed


def forward_seconds(port: int) -> float:
    """The seconds a worker has spent in steps so far (its metrics on `port`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "siding_forward_seconds_sum")


def run_point(spec: dict[str, Any], procs: int, core: int, last_stage: int,
              root: str | None = None) -> dict[str, Any]:
    """One concurrency or rate: `procs` client processes (from the checkout `root`, as its
    cluster: a client speaks its own tree's protocol), the CPU of every cluster process and of
    theirs around the window, the last stage's step time in it (its metrics port
    `last_stage`), and the window's records."""
    shares = []
    for k in range(procs):
        share = dict(spec)
        if spec["mode"] == "closed":
            share["clients"] = list(range(k, spec["concurrency"], procs))
        else:
            share["arrivals"] = spec["arrivals"][k::procs]
        shares.append(share)
    with client_processes("benchmarks.serve_load", shares, START_S, root,
                          checkout_env(root)) as (clients, begin):
        t0 = begin + spec["warmup"]
        time.sleep(max(0.0, t0 - time.monotonic()))
        names = cluster_processes(core) | {p.pid: f"bench client {k}"
                                           for k, p in enumerate(clients)}
        def snapshot() -> tuple:  # processes' CPU, the machine's, the last stage's step time
            return (read_cpu(names | cluster_processes(core)), machine_busy(),
                    forward_seconds(last_stage))

        start = snapshot()
        if spec["duration"] is not None:
            t1 = t0 + spec["duration"]
            time.sleep(max(0.0, t1 - time.monotonic()))
            end = snapshot()
        for proc in clients:
            expect(proc, "done")
        if spec["duration"] is None:
            end = snapshot()
        records = [r for proc in clients for r in client_result(proc)]
    if spec["duration"] is None:
        t1 = max(r["end"] for r in records if r["sent"] >= t0)
    point = summarise(records, t0, t1)
    point["cpu"] = cpu_use(start[0], end[0], point["output_tokens"], t1 - t0)
    point["machine_cores"] = (end[1] - start[1]) / (t1 - t0)
    ours = sum(c["cores"] or 0.0 for c in point["cpu"])
    point["others_cores"] = max(0.0, point["machine_cores"] - ours)  # whole ticks: may dip below
    point["step_busy"] = (end[2] - start[2]) / (t1 - t0)
    return point | cpu_by_kind(point["cpu"], point["output_tokens"])


def summarise(records: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """A point's figures from its requests' records; the window is [t0, t1]."""
    window = t1 - t0
    tokens = sum(n for r in records for t, n in r["chunks"] if t0 <= t <= t1)
    ended = [r for r in records
             if r["error"] is None and r["end"] is not None and t0 <= r["end"] <= t1]
    in_flight = sum(max(0.0, min(t1, r["end"] or t1) - max(t0, r["sent"])) for r in records)
    measured = [r for r in records if t0 <= r["sent"] <= t1]
    complete = [r for r in measured if r["error"] is None and r["end"] is not None]
    ttft = [r["chunks"][0][0] - r["sent"] for r in complete if r["chunks"]]
    itl = [b[0] - a[0] for r in complete for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["end"] - r["sent"] for r in complete]
    return {
        "window_s": window, "output_tokens": tokens, "output_tps": tokens / window,
        "requests_ended": len(ended), "requests_per_s": len(ended) / window,
        "mean_in_flight": in_flight / window,
        "ttft_s": quantiles(ttft) if ttft else None, "itl_s": quantiles(itl) if itl else None,
        "e2e_s": quantiles(e2e) if e2e else None,
        "errors": sum(r["error"] is not None for r in measured),
        "cut_off": sum(r["end"] is None for r in measured),
        "requests": [{"client": r["client"], "sent_s": r["sent"] - t0,
                      "e2e_s": None if r["end"] is None else r["end"] - r["sent"],
                      "ttft_s": r["chunks"][0][0] - r["sent"] if r["chunks"] else None,
                      "tokens": sum(n for _, n in r["chunks"]), "output_len": r["output_len"],
                      "prompt_len": r["prompt_len"], "error": r["error"]} for r in measured],
    }


# ---- the command --------------------------------------------------------------------------

def positive_list(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            values = sorted({kind(x) for x in text.split(",") if x.strip()})
        except ValueError:
            raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text}") from None
        if not values or values[0] <= 0:
            raise argparse.ArgumentTypeError(f"values must be positive: {text}")
        return values
    return parse


def procs_arg(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--client-procs takes auto or a count, not {text!r}")
    return int(text)


def api_list(text: str) -> list[str]:
    apis = [x.strip() for x in text.split(",") if x.strip()]
    if not apis or any(x not in ("zmq", "http") for x in apis) or len(set(apis)) < len(apis):
        raise argparse.ArgumentTypeError(f"--api takes zmq, http or zmq,http, not {text!r}")
    return apis


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="siding bench serve", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="any `siding launch --model` spec")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (or one per worker, commas)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="as `siding launch --dtype`")
    p.add_argument("--workers", type=int, default=1, help="worker processes (layer split)")
    p.add_argument("--worker-threads", type=int, default=0,
                   help="torch threads per worker and in-process (0: the cores shared out)")
    p.add_argument("--frontends", type=int, default=1, help="`siding launch --frontends`")
    p.add_argument("--kv-pages", type=int, default=0, help="0: enough for every sequence")
    p.add_argument("--max-batch-seqs", type=int, default=0,
                   help="0: 64, or the largest concurrency if more")
    p.add_argument("--extra", default="", help="more `siding launch` flags, one string")
    p.add_argument("--api", type=api_list, default="zmq",
                   help="zmq (siding's client), http (the OpenAI API through the `openai` "
                   "client), or both, comma-separated: each on the same cluster, point by point")
    p.add_argument("--mode", default="closed", choices=["closed", "open"],
                   help="closed: clients send the next request when one ends; open: at --rate")
    p.add_argument("--concurrency", type=positive_list(int), default="16,64",
                   help="closed loop: concurrent clients, comma-separated")
    p.add_argument("--rate", type=positive_list(float), default=None,
                   help="open loop: requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds per point before it")
    p.add_argument("--requests-per-client", type=int, default=None,
                   help="closed loop: stop each client after this many requests past the "
                   "warm-up instead of after --duration")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--len-dist", default="fixed", choices=["fixed", "uniform"],
                   help="uniform: each length in [len/2, 3*len/2]")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths")
    p.add_argument("--streams-per-socket", type=int, default=1,
                   help="closed loop, zmq: streams of a client process sharing one AsyncClient "
                   "(as an application multiplexes them); 1: a socket each")
    p.add_argument("--client-procs", type=procs_arg, default="auto", metavar="auto|N",
                   help="client processes the streams are dealt over; auto: one per "
                   f"{STREAMS_PER_CLIENT} streams (closed loop: the concurrency; open: "
                   "--max-batch-seqs), at most the cores this process may use less one per "
                   "cluster process (engine core, frontends, workers), at least 1. A client is "
                   "one asyncio thread: more streams than that can saturate it at a GPU's rate "
                   "(benchmarks/client_procs.py), which the point then reports")
    p.add_argument("--inprocess-steps", type=int, default=64,
                   help="timed in-process steps a round (each ceiling: the median of "
                   f"{INPROCESS_ROUNDS} rounds)")
    p.add_argument("--no-inprocess", dest="inprocess", action="store_false",
                   help="skip the in-process ceilings")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="in-process steps run eagerly (pass the launch flag with --extra)")
    p.add_argument("--baseline", metavar="DIR", default=None,
                   help="also load a cluster run from another checkout (say `git worktree add "
                   "DIR main`), point by point beside this tree's, first at every other point: a "
                   "side-by-side A/B")
    p.add_argument("--out", default="bench-results",
                   help="directory for the JSON, the PNG and each cluster's log")
    a = p.parse_args(argv)
    if a.mode == "open" and a.rate is None:
        p.error("--mode open needs --rate")
    if a.mode == "open" and a.requests_per_client is not None:
        p.error("--requests-per-client is for the closed loop")
    check_baseline_client(p, a.baseline, "serve_load.py")
    for name in ("prompt_len", "output_len", "workers", "frontends", "inprocess_steps",
                 "requests_per_client", "streams_per_socket"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.duration <= 0 or a.warmup < 0:
        p.error("--duration must be positive and --warmup not negative")
    biggest = max(a.concurrency) if a.mode == "closed" else 0
    a.max_batch_seqs = a.max_batch_seqs or max(64, biggest)
    return a


def longest_request(a: argparse.Namespace) -> int:
    """Prompt plus output positions of the longest request `draw_request` can draw."""
    if a.len_dist == "uniform":
        return a.prompt_len * 3 // 2 + a.output_len * 3 // 2
    return a.prompt_len + a.output_len


def cluster_args(a: argparse.Namespace, dtype: torch.dtype, threads: int) -> list[str]:
    pages = a.kv_pages or max(1024, a.max_batch_seqs * -(-longest_request(a) // PAGE_SIZE))
    return [
        "--model", a.model, "--devices", a.device, "--workers", str(a.workers),
        "--dtype", dtype_name(dtype), "--kv-pages", str(pages),
        "--max-batch-seqs", str(a.max_batch_seqs), "--worker-threads", str(threads),
        *(["--frontends", str(a.frontends)] if a.frontends != 1 else []),
        *shlex.split(a.extra),
    ]


def run_order(xs: list, runs: list[tuple[str, str]]) -> list[tuple[Any, tuple[str, str]]]:
    """(point, run) in the order they run: point by point, the runs in turn, their order
    reversed at every other point, so that where the run after a pause is the slower (as on a
    2-core VM, docs/benchmarks.md) no arm is always first."""
    return [(x, run) for i, x in enumerate(xs) for run in (runs if i % 2 == 0 else runs[::-1])]


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    stamp = timestamp()
    device = torch.device(a.device.split(",")[0])
    dtype = resolve_dtype(a.dtype, str(device))
    threads = a.worker_threads or threads_per_worker(a.workers)
    model_args = resolve(a.model).args
    if longest_request(a) > model_args.max_context:
        raise ValueError(f"a prompt and its output may exceed the model's context of "
                         f"{model_args.max_context}")
    launch = cluster_args(a, dtype, threads)
    xs = a.concurrency if a.mode == "closed" else a.rate
    xname = "concurrency" if a.mode == "closed" else "rate"
    base = {"mode": a.mode, "warmup": a.warmup, "prompt_len": a.prompt_len,
            "output_len": a.output_len, "len_dist": a.len_dist, "seed": a.seed,
            "vocab_size": model_args.vocab_size,
            "duration": a.duration if a.requests_per_client is None else None,
            "requests_per_client": a.requests_per_client,
            "streams_per_socket": a.streams_per_socket}
    machine = machine_info(str(device))
    arms = {"siding": None, **({"baseline": a.baseline} if a.baseline else {})}
    runs = [(arm, api) for arm in arms for api in (a.api if arm == "siding" else ["zmq"])]
    labels = {run: run[0] if run[0] != "siding" or a.api == ["zmq"] else " ".join(run)
              for run in runs}
    points = []
    idle = {}
    # how long a process polls in a loop after a message (--busy-poll): the idle cores are read
    # once a cluster's processes have stopped spinning for their start-up
    spin = busy_seconds(build_parser().parse_args(["launch", *launch]).busy_poll,
                        a.device.split(","))
    with contextlib.ExitStack() as stack:
        clusters, last_stage = {}, {}
        for arm, root in arms.items():
            port = free_metrics_port(a.workers)
            last_stage[arm] = worker_ports(port, a.workers)[-1]
            args = [*launch, *(["--http", "127.0.0.1:0"] if arm == "siding" and "http" in a.api
                               else []), "--metrics-port", str(port)]
            progress(SCENARIO, f"starting {arm} ({root or 'this tree'}): {' '.join(args)}")
            clusters[arm] = stack.enter_context(LocalCluster(
                *args, root=root, log=log_path(a.out, SCENARIO, stamp, arm)))
            time.sleep(spin)  # the windows its start-up's last messages opened
            idle[arm] = idle_cores(clusters[arm].proc.pid)
            progress(SCENARIO, f"idle {arm} cluster: " + ", ".join(
                f"{name} {cores:.3f}" for name, cores in idle[arm].items()) + " cores")
        for x, (arm, api) in run_order(xs, runs):
            cluster, label = clusters[arm], labels[arm, api]
            endpoints = (cluster.http if api == "http" else cluster.endpoint).split(",")
            spec = dict(base, api=api, concurrency=x, endpoints=endpoints) \
                if a.mode == "closed" else dict(
                base, api=api, rate=x, endpoints=endpoints,
                arrivals=list(enumerate(poisson_arrivals(
                    x, a.warmup + a.duration, random.Random(f"{a.seed}-arrivals-{x}")))))
            streams = x if a.mode == "closed" else a.max_batch_seqs
            procs = a.client_procs if a.client_procs != "auto" else auto_client_procs(
                streams, 1 + a.frontends + a.workers, usable_cores())
            progress(SCENARIO, f"{label}, {xname} {x:g}: {a.warmup:g} s warm-up, then "
                     + (f"{a.duration:g} s" if spec["duration"] else f"{a.requests_per_client} "
                        "requests per client") + f", {procs} client process(es)")
            point = {"arm": label, "api": api, xname: x, "client_procs": procs,
                     **run_point(spec, procs, cluster.proc.pid, last_stage[arm], arms[arm])}
            why = client_limit(point["cpu"], procs, streams)
            point |= {"client_limited": why is not None, "client_limited_why": why}
            points.append(point)
            progress(SCENARIO, f"{label}, {xname} {x:g}: {point['output_tps']:.1f} tok/s, "
                     f"{point['requests_per_s']:.2f} req/s, {point['errors']} errors")
            if why:
                progress(SCENARIO, f"warning: {why}")
            if point["others_cores"] > OTHERS_BUSY:
                progress(SCENARIO, f"warning: other processes kept {point['others_cores']:.2f} "
                         "cores busy in the window; this point is skewed")
    if a.inprocess:
        torch.set_num_threads(threads)
        add_ceilings(points, xname, a, dtype, device, SCENARIO)

    machine["load_average_end"] = list(os.getloadavg())
    record = {
        "scenario": SCENARIO, "command": " ".join(["siding", "bench", SCENARIO, *argv]),
        "started": stamp, "config": vars(a) | {"dtype": str(dtype), "threads": threads,
                                               "cluster": launch},
        "machine": machine, "idle_cores": idle, "baseline": a.baseline,
        "model": {"spec": a.model, "vocab_size": model_args.vocab_size},
        "points": points,
    }
    json_path, png_path = result_paths(a.out, SCENARIO, stamp)
    write_json(json_path, record)
    series = [Series(f"{label} cluster (clients)", xs, [Spread.of([p["output_tps"]])
                                                        for p in points if p["arm"] == label])
              for label in labels.values()]
    if a.inprocess:
        first = labels[runs[0]]
        for key, name in (("inprocess", "in-process decode"),
                          ("inprocess_work", "in-process, same work")):
            series.append(Series(name, xs, [Spread.of([p[key]["tps"]])
                                            for p in points if p["arm"] == first]))
    write_plot(png_path, series,
               title=f"serve ({a.mode} loop): {a.model}, {dtype_name(dtype)}, "
                     f"{machine['device_name']}\nprompt {a.prompt_len}, output {a.output_len} "
                     f"({a.len_dist}), {a.workers} worker(s), {a.frontends} frontend(s)",
               xlabel="concurrent clients" if a.mode == "closed" else "arrivals (requests/s)",
               ylabel="output tokens/s")
    print(table(points, xname))
    print(process_table(points, xname))
    for p in points:
        if p["client_limited"]:
            print(f"warning: {p['arm']}, {xname} {p[xname]:g}: {p['client_limited_why']}")
    print(f"results: {json_path}, {png_path}")


def table(points: list[dict[str, Any]], xname: str) -> str:
    def ms(q: dict[str, float] | None, scale: float = 1e3, digits: int = 0) -> str:
        return "-" if q is None else f"{q['p50'] * scale:.{digits}f}/{q['p99'] * scale:.{digits}f}"

    def us(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    headers = ["arm", xname, "in flight", "tok/s", "in-proc tok/s", "of in-proc",
               "same-work tok/s", "of same-work", "req/s",
               "ttft p50/p99 ms", "itl p50/p99 ms", "e2e p50/p99 s", "core us/tok",
               "frontend us/tok", "worker us/tok", "non-worker us/tok", "step busy",
               "others cores", "clients", "errors"]
    rows = [[
        p["arm"], f"{p[xname]:g}", f"{p['mean_in_flight']:.1f}", f"{p['output_tps']:.1f}",
        f"{p['inprocess']['tps']:.1f}" if "inprocess" in p else "-",
        f"{p['of_inprocess']:.1%}" if "inprocess" in p else "-",
        f"{p['inprocess_work']['tps']:.1f}" if "inprocess" in p else "-",
        f"{p['of_inprocess_work']:.1%}" if "inprocess" in p else "-",
        f"{p['requests_per_s']:.2f}", ms(p["ttft_s"]), ms(p["itl_s"], digits=1),
        ms(p["e2e_s"], 1, 2), us(p["core_us_per_token"]), us(p["frontend_us_per_token"]),
        us(p["worker_us_per_token"]), us(p["non_worker_us_per_token"]),
        f"{p['step_busy']:.2f}",
        f"{p['others_cores']:.2f}",
        f"{p['client_procs']}{' limited' if p['client_limited'] else ''}",
        p["errors"] + p["cut_off"],
    ] for p in points]
    return format_table(headers, rows)


def process_table(points: list[dict[str, Any]], xname: str) -> str:
    rows = [[f"{p['arm']} {p[xname]:g}" if i == 0 else "", c["name"], c["pid"],
             "-" if c["cpu_s"] is None else f"{c['cpu_s']:.2f}",
             "-" if c["cores"] is None else f"{c['cores']:.2f}",
             "-" if c["us_per_token"] is None else f"{c['us_per_token']:.0f}"]
            for p in points for i, c in enumerate(p["cpu"])]
    return format_table([xname, "process", "pid", "cpu s", "cores", "us/tok"], rows)


if __name__ == "__main__":
    main(sys.argv[1:])
