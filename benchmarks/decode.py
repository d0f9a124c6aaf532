"""`siding bench decode`: decode tokens/s against batch size; siding against transformers
`generate` on the same weights, cores and device, and against the memory-bandwidth roofline.

The arms are interleaved (for each repeat, for each batch size: siding, then with `--baseline` a
second cluster run from another checkout, then transformers), so load from other processes lands
on all alike; each point reports the median and min-max.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from coordinator.config import threads_per_worker
from coordinator.local_cluster import LocalCluster, checkout_env
from protocol.help_formatter import HelpFormatter
from worker.build import resolve_dtype
from worker.loaders import DEFAULT_MODEL, resolve
from worker.model import ModelArgs

from . import decode_load
from .report import (
    Series,
    Spread,
    check_baseline_client,
    client_processes,
    client_result,
    format_table,
    log_path,
    machine_info,
    progress,
    ratio,
    result_paths,
    timestamp,
    write_json,
    write_plot,
)

SCENARIO = "decode"
PROMPT_SEED = 0
LOWEST_PROMPT_ID = 100  # ids below are special or control tokens in common vocabularies
CLIENT_START_S = 0.3  # from the go signal to the first request of client processes


@dataclass
class Sample:
    """One timed batch of one arm; times in seconds from the first request sent."""

    arm: str  # "siding", "baseline" or "hf"
    batch: int
    repeat: int
    ttft: float  # mean over the batch's sequences
    decode_tokens: int  # tokens after every sequence of the batch has its first
    decode_seconds: float  # latest first token -> last token
    total_tokens: int
    total_seconds: float  # first request sent -> last token
    first_token_skew: float  # latest first token - earliest; 0 when prefilled in one step

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds

    @property
    def e2e_tps(self) -> float:
        return self.total_tokens / self.total_seconds

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "decode_tps": self.decode_tps, "e2e_tps": self.e2e_tps}


def timed_batch(
    arm: str, batch: int, repeat: int, start: float, arrivals: list[list[float]]
) -> Sample:
    """arrivals[b]: when each token of sequence b arrived (seconds, the clock of `start`).

    Decode counts from the step that gives the batch's last first token: from there every
    sequence decodes, one token a step. When the whole batch prefilled in one step, that is every
    token after each sequence's first, over the time from the first tokens to the last token.
    """
    firsts = [times[0] for times in arrivals]
    decoding = max(firsts)
    end = max(times[-1] for times in arrivals)
    # Each sequence's token of that step is the one that arrived nearest to it: steps are far
    # further apart than the chunks of one step.
    aligned = [min(range(len(t)), key=lambda i: abs(t[i] - decoding)) for t in arrivals]
    return Sample(
        arm=arm, batch=batch, repeat=repeat,
        ttft=statistics.fmean(firsts) - start,
        decode_tokens=sum(len(t) - 1 - i for t, i in zip(arrivals, aligned)),
        decode_seconds=end - decoding,
        total_tokens=sum(len(times) for times in arrivals),
        total_seconds=end - start,
        first_token_skew=max(firsts) - min(firsts),
    )


class SidingArm:
    """`batch` concurrent streamed requests to a running cluster, timed as tokens reach its
    clients (`decode_load.py`: in this process, or dealt over `client_procs(batch, procs)`
    client processes, `procs` being `--client-procs`, run from the checkout `root` where it is
    another's); greedy, or drawn with `sampling` (temperature, top_p), each request its own
    seed."""

    def __init__(self, endpoint: str, prompts: list[list[int]], name: str = "siding",
                 sampling: dict[str, float] | None = None, procs: int | None = 1,
                 root: str | None = None):
        self.endpoint = endpoint
        self.prompts = prompts
        self.name = name  # "siding", or "baseline": a cluster run from another checkout
        self.sampling = sampling or {}
        self.procs = procs
        self.root = root  # that checkout, whose clients speak its protocol (None: this one)

    def run(self, batch: int, tokens: int, repeat: int = -1) -> Sample:
        requests = list(enumerate(self.prompts[:batch]))
        procs = min(batch, client_procs(batch, self.procs))
        if procs > 1 or self.root is not None:
            start, arrivals = in_processes(self.endpoint, requests, tokens, self.sampling, procs,
                                           self.root)
        else:
            start, arrivals = asyncio.run(decode_load.streams(self.endpoint, requests, tokens,
                                                              self.sampling))
        return timed_batch(self.name, batch, repeat, start, arrivals)


def in_processes(endpoint: str, requests: list[tuple[int, list[int]]], tokens: int,
                 sampling: dict[str, float], procs: int, root: str | None = None
                 ) -> tuple[float, list[list[float]]]:
    """`decode_load.streams`, its requests dealt over `procs` client processes that start
    together, run from the checkout `root` (None: this one)."""
    shares = [{"endpoint": endpoint, "requests": requests[k::procs], "tokens": tokens,
               "sampling": sampling} for k in range(procs)]
    with client_processes("benchmarks.decode_load", shares, CLIENT_START_S, root,
                          checkout_env(root)) as (clients, _):
        per_proc = [client_result(proc) for proc in clients]
    arrivals: list[list[float]] = [[] for _ in requests]
    for k, share in enumerate(per_proc):
        arrivals[k::procs] = share["arrivals"]
    return min(share["start"] for share in per_proc), arrivals


def client_procs(batch: int, given: int | None) -> int:
    """Client processes for a batch: `--client-procs`, or one per 8 streams, at most half the
    cores."""
    if given is not None:
        return given
    return min(-(-batch // 8), max(1, (os.cpu_count() or 1) // 2))


class HFArm:
    """transformers `generate` on the whole batch at once, greedy or drawn with `sampling`,
    exactly `tokens` new tokens, each step timed as its tokens reach the host (what a client of
    it would see)."""

    def __init__(self, model: Any, prompts: torch.Tensor, device: str,
                 sampling: dict[str, float] | None = None):
        self.model = model
        self.prompts = prompts.to(device)  # [max batch, context] int64
        self.device = device
        self.sampling = {"do_sample": True, "top_k": 0, **sampling} if sampling else \
            {"do_sample": False}

    def run(self, batch: int, tokens: int, repeat: int = -1) -> Sample:
        ids = self.prompts[:batch]
        clock = TokenClock()
        synchronize(self.device)
        start = time.perf_counter()
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
            min_new_tokens=tokens, pad_token_id=0, streamer=clock, **self.sampling,
        )
        if out.shape != (batch, ids.shape[1] + tokens) or len(clock.steps) != tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens in "
                               f"{len(clock.steps)} steps where {tokens} were asked")
        return timed_batch("hf", batch, repeat, start, [clock.steps] * batch)


class TokenClock:
    """A `generate` streamer: `put` gets the prompt, then each step's tokens, already copied
    to the host (so the step has finished on the device)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.steps: list[float] = []  # perf_counter seconds

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.steps.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def copy_bandwidth(device: str, repeats: int = 5) -> list[float]:
    """Bytes/s of one large tensor copy on `device`, read plus write bytes counted."""
    mib = 1024 if device.startswith("cuda") else 256  # far past the last-level cache
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # faults the pages in
    samples = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        samples.append(2 * src.nbytes / (time.perf_counter() - t0))
    return samples


def weight_bytes(a: ModelArgs, dtype_size: int) -> int:
    """Weights one decode step reads: every layer, the final norm and the head. The embedding
    table is only gathered (a row per sequence), so an untied one does not count."""
    per_layer = 2 * a.dim + a.dim * (a.q_dim + 2 * a.kv_dim) + a.q_dim * a.dim
    per_layer += 3 * a.dim * a.ffn_dim + (a.q_dim + 2 * a.kv_dim if a.qkv_bias else 0)
    return (a.n_layers * per_layer + a.dim + a.vocab_size * a.dim) * dtype_size


def kv_bytes(a: ModelArgs, batch: int, context: float, dtype_size: int) -> float:
    """K and V of `context` positions of `batch` sequences, every layer."""
    return batch * context * a.n_layers * 2 * a.kv_dim * dtype_size


def roofline_tps(
    a: ModelArgs, batch: int, context: float, dtype_size: int, bandwidth: float
) -> float:
    """Tokens/s if a step cost only its bytes over `bandwidth` (bytes/s)."""
    step_bytes = weight_bytes(a, dtype_size) + kv_bytes(a, batch, context, dtype_size)
    return batch * bandwidth / step_bytes


def batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers: {text}")
    return sizes


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="siding bench decode",
        description="decode tokens/s against batch size: siding, transformers, roofline",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="any `siding launch --model` spec")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (or one per worker, commas)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="as `siding launch --dtype`")
    p.add_argument("--batch-sizes", type=batch_sizes, default="1,8", help="e.g. 1,8,32")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per sequence")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each batch size")
    p.add_argument("--workers", type=int, default=1, help="worker processes (layer split)")
    p.add_argument("--kv", default="device", choices=["device", "host"],
                   help="where the workers keep KV pages (`siding launch --kv`)")
    p.add_argument("--pipeline-depth", type=int, default=1,
                   help="with --kv host: layers delivered ahead (`siding launch`)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers arm")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="draw every token at this temperature (0: greedy), in every arm")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p")
    p.add_argument("--baseline", metavar="DIR", default=None,
                   help="also time a cluster run from another checkout (say `git worktree add "
                   "DIR main`), its batches interleaved with this tree's: a side-by-side A/B")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="siding runs decode steps eagerly (`siding launch` flag)")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="decode steps enqueued ahead of their plan (`siding launch --overlap`)")
    p.add_argument("--client-procs", type=int, default=None, metavar="N",
                   help="client processes a batch's streams are dealt over (default: one per "
                   "8 streams, at most half the cores): one asyncio client reads some 10k "
                   "chunks a second, less than a GPU cluster streams at batch 32")
    p.add_argument("--out", default="bench-results",
                   help="directory for the JSON, the PNG and each cluster's log")
    args = p.parse_args(argv)
    if args.client_procs is not None and args.client_procs < 1:
        p.error("--client-procs must be at least 1")
    for name, low in (("context", 1), ("tokens", 2), ("repeats", 1), ("workers", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be at least {low}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be at least 0 and --top-p in (0, 1]")
    check_baseline_client(p, args.baseline, "decode_load.py")
    return args


def cluster_args(args: argparse.Namespace, dtype: torch.dtype, threads: int) -> list[str]:
    biggest = max(args.batch_sizes)
    page_size = 16
    pages = biggest * -(-(args.context + args.tokens) // page_size)
    return [
        "--model", args.model, "--devices", args.device, "--workers", str(args.workers),
        "--dtype", dtype_name(dtype), "--page-size", str(page_size),
        "--kv-pages", str(max(1024, pages)), "--max-batch-seqs", str(max(64, biggest)),
        # The whole batch prefills in one step, as transformers does, so its sequences decode
        # in lockstep from the first token on.
        "--max-batch-tokens", str(max(512, biggest * args.context)),
        "--worker-threads", str(threads), "--kv", args.kv,
        "--pipeline-depth", str(args.pipeline_depth), "--overlap", args.overlap,
        *([] if args.cuda_graphs else ["--no-cuda-graphs"]),
    ]


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    stamp = timestamp()
    device = args.device.split(",")[0]
    threads = threads_per_worker(args.workers)
    torch.set_num_threads(threads)  # the transformers arm gets the cores one worker gets
    model_args = resolve(args.model).args
    if args.context + args.tokens > model_args.max_context:
        raise ValueError(f"--context + --tokens exceeds the model's {model_args.max_context}")
    dtype = resolve_dtype(args.dtype, device)
    dtype_size = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    prompts = torch.randint(
        LOWEST_PROMPT_ID, model_args.vocab_size, (max(args.batch_sizes), args.context),
        generator=generator,
    )
    machine = machine_info(device)
    load, cores = machine["load_average"][0], machine["cpu_count"] or 1
    if load > cores / 2:
        progress(SCENARIO, f"warning: load average {load:.1f} on {cores} cores; other processes "
                 "will slow both arms and widen the spread")

    progress(SCENARIO, f"measuring copy bandwidth on {device}")
    bandwidth = copy_bandwidth(device)
    progress(SCENARIO, f"bandwidth {statistics.median(bandwidth) / 1e9:.1f} GB/s")
    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature \
        else None
    hf = None
    if args.hf:
        progress(SCENARIO, f"loading {args.model} in transformers ({dtype_name(dtype)}, {device})")
        hf = HFArm(load_reference(args.model, dtype, device), prompts, device, sampling)
    launch = cluster_args(args, dtype, threads)
    samples: list[Sample] = []
    with contextlib.ExitStack() as stack:
        arms: list[SidingArm | HFArm] = []
        for name, root in [("siding", None), *([("baseline", args.baseline)]
                                               if args.baseline else [])]:
            progress(SCENARIO, f"starting {name} ({root or 'this tree'}): {' '.join(launch)}")
            cluster = stack.enter_context(LocalCluster(
                *launch, root=root, log=log_path(args.out, SCENARIO, stamp, name)))
            arms.append(SidingArm(cluster.endpoint, prompts.tolist(), name, sampling,
                                  args.client_procs, root))
        if hf is not None:
            arms.append(hf)
        progress(SCENARIO, "warming up: one full run of each arm and batch size")
        for b in args.batch_sizes:
            for arm in arms:
                arm.run(b, args.tokens)
        for r in range(args.repeats):
            for b in args.batch_sizes:
                for arm in arms:
                    s = arm.run(b, args.tokens, r)
                    samples.append(s)
                    progress(SCENARIO, f"repeat {r + 1}/{args.repeats}  batch {b:>3}  "
                             f"{s.arm:<8}  decode {s.decode_tps:8.1f} tok/s  "
                             f"ttft {s.ttft * 1e3:7.1f} ms")
            # Bandwidth is sampled between rounds too, so it sees the load the arms saw.
            bandwidth += copy_bandwidth(device, repeats=3)
    machine["load_average_end"] = list(os.getloadavg())

    bw = Spread.of(bandwidth)
    kv_context = args.context + args.tokens / 2  # mean positions attended over the decode
    points = [
        summarise(b, samples, roofline_tps(model_args, b, kv_context, dtype_size, bw.median))
        for b in args.batch_sizes
    ]
    record = {
        "scenario": SCENARIO,
        "command": " ".join(["siding", "bench", SCENARIO, *argv]),
        "started": stamp,
        "config": {**vars(args), "threads": threads, "dtype": str(dtype), "cluster": launch,
                   "prompt_seed": PROMPT_SEED, "prompt_ids": [LOWEST_PROMPT_ID,
                                                              model_args.vocab_size]},
        "machine": machine,
        "model": {"spec": args.model, "args": asdict(model_args),
                  "weight_bytes_per_step": weight_bytes(model_args, dtype_size),
                  "kv_bytes_per_position": kv_bytes(model_args, 1, 1, dtype_size),
                  "kv_context": kv_context},
        "bandwidth": {"bytes_per_s": bw, "samples": bandwidth,
                      "method": "tensor copy on the device, read + write bytes"},
        "points": points,
        "samples": [s.record() for s in samples],
    }
    json_path, png_path = result_paths(args.out, SCENARIO, stamp)
    write_json(json_path, record)
    series = [Series("siding", args.batch_sizes, [p["siding"]["decode_tps"] for p in points])]
    if args.baseline:
        series.append(Series("baseline", args.batch_sizes,
                             [p["baseline"]["decode_tps"] for p in points]))
    if hf is not None:
        series.append(Series("transformers", args.batch_sizes,
                             [p["hf"]["decode_tps"] for p in points]))
    series.append(Series("roofline", args.batch_sizes,
                         [Spread.of([p["roofline_tps"]]) for p in points]))
    write_plot(
        png_path, series,
        title=f"decode: {args.model}, {dtype_name(dtype)}, {machine['device_name']}\n"
              f"context {args.context}, {args.tokens} new tokens, {threads} threads",
        xlabel="batch size (sequences)", ylabel="decode tokens/s",
    )
    print(table(points))
    print(f"bandwidth {bw.median / 1e9:.1f} GB/s; results: {json_path}, {png_path}")


def load_reference(spec: str, dtype: torch.dtype, device: str) -> Any:
    # Imported here: only the transformers arm needs transformers (`--no-hf` runs without it).
    import transformers

    from .hf_reference import reference_model

    transformers.logging.set_verbosity_error()
    # Its GGUF reader draws a bar per tensor on stderr that no setting turns off.
    with contextlib.redirect_stderr(io.StringIO()):
        return reference_model(spec, dtype, device)


def summarise(batch: int, samples: list[Sample], roofline: float) -> dict[str, Any]:
    def arm(name: str) -> dict[str, Spread] | None:
        mine = [s for s in samples if s.arm == name and s.batch == batch]
        if not mine:
            return None
        return {"decode_tps": Spread.of([s.decode_tps for s in mine]),
                "ttft_s": Spread.of([s.ttft for s in mine]),
                "e2e_tps": Spread.of([s.e2e_tps for s in mine])}

    siding, baseline, hf = arm("siding"), arm("baseline"), arm("hf")
    return {
        "batch": batch, "siding": siding, "baseline": baseline, "hf": hf,
        "siding_over_baseline": None if baseline is None else ratio(
            siding["decode_tps"], baseline["decode_tps"]),
        "siding_over_hf": None if hf is None else ratio(siding["decode_tps"], hf["decode_tps"]),
        "roofline_tps": roofline,
        "siding_roofline_fraction": siding["decode_tps"].median / roofline,
    }


def table(points: list[dict[str, Any]]) -> str:
    baseline = points[0]["baseline"] is not None
    headers = ["batch", "siding tok/s", *(["baseline tok/s", "siding/baseline"] if baseline
                                         else []),
               "hf tok/s", "siding/hf", "roofline", "of roofline", "ttft siding ms",
               *(["ttft baseline ms"] if baseline else []), "ttft hf ms"]
    rows = []
    for p in points:
        s, b, h = p["siding"], p["baseline"], p["hf"]
        rows.append([
            p["batch"], s["decode_tps"].text(),
            *([b["decode_tps"].text(), f"{p['siding_over_baseline']:.2f}x"] if baseline else []),
            "-" if h is None else h["decode_tps"].text(),
            "-" if h is None else f"{p['siding_over_hf']:.2f}x",
            f"{p['roofline_tps']:.1f}", f"{p['siding_roofline_fraction']:.1%}",
            s["ttft_s"].text(1e3, 0), *([b["ttft_s"].text(1e3, 0)] if baseline else []),
            "-" if h is None else h["ttft_s"].text(1e3, 0),
        ])
    return format_table(headers, rows)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
