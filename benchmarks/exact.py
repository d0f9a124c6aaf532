"""`siding bench exact`: exact mode against default mode at 1, 4 and 32 concurrent sequences,
and the identity check.

Two clusters, one default and one `--exact`, same model, device and dtype, run side by side; for
each round, for each concurrency, the default arm then the exact arm (interleaved, so load from
other processes lands on both alike). Each point reports the median and min-max of aggregate
tokens/s, every request's new tokens over the time from sending them to the last result, and
the ratio exact/default (target >= 0.95). The requests do not stream: one reply each, so that
the client's own reading never bounds the rate (streamed, one asyncio client read 12-13k
tokens/s at 32 sequences on an H200, either arm). Identity: in the exact cluster,
request 0's tokens at every concurrency and round must equal its solo run's; the default arm's
answer to the same question is reported too, for information.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from coordinator.local_cluster import LocalCluster
from protocol import AsyncClient
from protocol.help_formatter import HelpFormatter
from worker.build import resolve_dtype
from worker.loaders import resolve

from .decode import LOWEST_PROMPT_ID, PROMPT_SEED, batch_sizes, dtype_name
from .report import (
    Series,
    Spread,
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

SCENARIO = "exact"
ARMS = ("default", "exact")


@dataclass(frozen=True)
class Sample:
    """One arm's batch of one round: its new tokens over sending them to the last result."""

    arm: str
    batch: int
    repeat: int
    tokens: int
    seconds: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "tps": self.tps}


async def _batch(endpoint: str, prompts: list[list[int]], tokens: int, arm: str, rnd: int
                 ) -> tuple[Sample, list[int]]:
    """All `prompts` at once, greedy; the timing and request 0's tokens."""
    client = AsyncClient(endpoint, timeout=600.0)
    try:
        await client.status()  # connected before the clock starts
        start = time.perf_counter()
        results = await asyncio.gather(*(
            client.generate(prompt_token_ids=p, max_tokens=tokens, ignore_eos=True,
                            temperature=0.0) for p in prompts))
        seconds = time.perf_counter() - start
    finally:
        await client.close()
    for r in results:
        if len(r.token_ids) != tokens:
            raise RuntimeError(f"{arm}: {len(r.token_ids)} tokens where {tokens} were asked")
    return Sample(arm, len(prompts), rnd, tokens * len(prompts), seconds), results[0].token_ids


def run_batch(endpoint: str, prompts: list[list[int]], tokens: int, arm: str, rnd: int = -1
              ) -> tuple[Sample, list[int]]:
    return asyncio.run(_batch(endpoint, prompts, tokens, arm, rnd))


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="siding bench exact",
                                description="exact mode against default mode, and identity",
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="synthetic:llama-1b" if cuda else "smollm2-135m",
                   help="any `siding launch --model` spec")
    p.add_argument("--device", default="cuda:0" if cuda else "cpu", help="cpu or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="as `siding launch --dtype`")
    p.add_argument("--concurrency", type=batch_sizes, default="1,4,32", help="e.g. 1,4,32")
    # On a GPU 64 tokens at 4 sequences are timed over about 0.3 s, where one stall of the host
    # moves a round by a third (docs/exact-mode.md): time longer there, and more rounds.
    p.add_argument("--tokens", type=int, default=256 if cuda else 64,
                   help="generated tokens per sequence")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--rounds", type=int, default=5 if cuda else 3, help="timed rounds of each arm")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="both clusters run decode steps eagerly (`siding launch` flag)")
    p.add_argument("--out", default="bench-results",
                   help="directory for the JSON, the PNG and each cluster's log")
    args = p.parse_args(argv)
    for name, low in (("context", 1), ("tokens", 2), ("rounds", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be at least {low}")
    return args


def summarise(c: int, samples: list[Sample], identical: dict[str, dict[int, bool]]
              ) -> dict[str, Any]:
    tps = {a: Spread.of([s.tps for s in samples if s.arm == a and s.batch == c])
           for a in ARMS}
    return {"concurrency": c, "default_tps": tps["default"], "exact_tps": tps["exact"],
            "exact_over_default": ratio(tps["exact"], tps["default"]),
            "exact_identical": identical["exact"][c],
            "default_differed": not identical["default"][c]}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    stamp = timestamp()
    model_args = resolve(args.model).args
    if args.context + args.tokens > model_args.max_context:
        raise ValueError(f"--context + --tokens exceeds the model's {model_args.max_context}")
    dtype = resolve_dtype(args.dtype, args.device)
    biggest = max(args.concurrency)
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    prompts = torch.randint(LOWEST_PROMPT_ID, model_args.vocab_size, (biggest, args.context),
                            generator=generator).tolist()
    launch = ["--model", args.model, "--devices", args.device, "--dtype", dtype_name(dtype),
              "--kv-pages", str(max(1024, biggest * -(-(args.context + args.tokens) // 16))),
              "--page-size", "16", "--max-batch-seqs", str(max(64, biggest)),
              "--max-batch-tokens", str(max(512, biggest * args.context))]
    if not args.cuda_graphs:
        launch.append("--no-cuda-graphs")
    machine = machine_info(args.device)
    progress(SCENARIO, f"starting two clusters: {' '.join(launch)} [--exact]")
    samples: list[Sample] = []
    identical = {a: dict.fromkeys(args.concurrency, True) for a in ARMS}
    logs = {a: log_path(args.out, SCENARIO, stamp, a) for a in ARMS}
    with LocalCluster(*launch, log=logs["default"]) as default, \
            LocalCluster(*launch, "--exact", log=logs["exact"]) as exact:
        endpoints = {"default": default.endpoint, "exact": exact.endpoint}
        progress(SCENARIO, "warming up; request 0 alone is the solo reference")
        solo = {a: run_batch(endpoints[a], prompts[:1], args.tokens, a)[1] for a in ARMS}
        for c in args.concurrency:
            for a in ARMS:
                run_batch(endpoints[a], prompts[:c], args.tokens, a)
        for r in range(args.rounds):
            for c in args.concurrency:
                for a in ARMS:
                    s, ids = run_batch(endpoints[a], prompts[:c], args.tokens, a, r)
                    samples.append(s)
                    identical[a][c] &= ids == solo[a]
                    progress(SCENARIO, f"round {r + 1}/{args.rounds}  C {c:>3}  {a:<7}  "
                             f"{s.tps:8.1f} tok/s  req0 as solo: {ids == solo[a]}")
    machine["load_average_end"] = list(os.getloadavg())

    points = [summarise(c, samples, identical) for c in args.concurrency]
    record = {
        "scenario": SCENARIO, "command": " ".join(["siding", "bench", SCENARIO, *argv]),
        "started": stamp, "machine": machine,
        "config": {**vars(args), "dtype": str(dtype), "cluster": launch,
                   "prompt_seed": PROMPT_SEED},
        "points": points, "samples": [s.record() for s in samples],
        "solo_tokens": solo, "exact_matches_default_solo": solo["exact"] == solo["default"],
    }
    json_path, png_path = result_paths(args.out, SCENARIO, stamp)
    write_json(json_path, record)
    write_plot(png_path, [Series(a, args.concurrency, [p[f"{a}_tps"] for p in points])
                          for a in ARMS],
               title=f"exact vs default: {args.model}, {dtype_name(dtype)}, "
                     f"{machine['device_name']}\ncontext {args.context}, {args.tokens} new tokens",
               xlabel="concurrent sequences", ylabel="aggregate tokens/s")
    print(format_table(
        ["C", "default tok/s", "exact tok/s", "exact/default", "exact identical",
         "default differed"],
        [[p["concurrency"], p["default_tps"].text(), p["exact_tps"].text(),
          f"{p['exact_over_default']:.3f}", p["exact_identical"], p["default_differed"]]
         for p in points]))
    print(f"results: {json_path}, {png_path}")
