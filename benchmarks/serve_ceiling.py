"""`siding bench serve`'s ceilings, the worker's own step rate in this process at a point's batch,
which the cluster's tokens/s is reported against (`add_ceilings`):

- decode: decode steps only, every row a decode row at the prompt's context;
- same work: the same steps with the loop's prompts mixed in as a serving cluster's steps carry
  them. A request of output length O takes one step as a prompt (its P rows give its first
  token) and O - 1 as a decode row, so at batch B a step carries B / O prompts on average, each
  in the place of a decode row: B tokens a step either way, but a step past a few hundred rows
  is bound by the matmuls' compute, and prompt rows cost what a decode step cannot hide.

Both run steps one after another, each waiting for its tokens before the next is planned: the
host's work for a step is not hidden behind the device's, as a cluster's worker hides it when
it plans ahead. Where that host work is large (a step's 256 prompt rows) the cluster passes
the same-work rate (1.16-1.21x on an H100 at 32-256 streams, docs/benchmarks.md): a ratio
above 1 says the engine core and the frontends took nothing measurable from the worker.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

import torch

from protocol.messages import SeqPlan, Step
from worker.build import build_runner, load_stage, make_pool
from worker.model import StageModel
from worker.runner import ModelRunner

from .decode import LOWEST_PROMPT_ID, dtype_name
from .link import sync
from .proc_cpu import cpu_seconds, machine_busy
from .report import progress

PAGE_SIZE = 16  # `siding launch`'s default, for sizing --kv-pages and the in-process pool
INPROCESS_WARMUP = 4  # untimed decode steps before the timed ones (graphs captured there)
INPROCESS_ROUNDS = 3  # rounds of --inprocess-steps timed steps; the ceiling is their median


def add_ceilings(points: list[dict[str, Any]], xname: str, a: argparse.Namespace,
                 dtype: torch.dtype, device: torch.device, scenario: str) -> None:
    """Each point's in-process rates and its ratios to them, `inprocess` (decode) and
    `inprocess_work` (the same work): one measurement of each per batch size."""
    progress(scenario, f"in-process steps: loading {a.model} ({dtype_name(dtype)}, {device})")
    stage = load_stage(a.model, dtype, device)
    ceilings: dict[tuple[int, float], dict[str, Any]] = {}
    for p in points:
        batch = p[xname] if a.mode == "closed" else min(
            a.max_batch_seqs, max(1, round(p["mean_in_flight"])))
        for key, prompts in (("inprocess", 0.0), ("inprocess_work", batch / a.output_len)):
            if (batch, prompts) not in ceilings:
                c = inprocess_steps(stage, batch, a.prompt_len, prompts, a.inprocess_steps,
                                    device, a.cuda_graphs, scenario)
                ceilings[batch, prompts] = c
                progress(scenario, f"in-process batch {batch}, {prompts:g} prompts a step: "
                         f"{c['tps']:.1f} tok/s (the rest of the machine: "
                         f"{c['others_cores']:.2f} cores)")
            p[key] = ceilings[batch, prompts]
        p["of_inprocess"] = p["output_tps"] / p["inprocess"]["tps"]
        p["of_inprocess_work"] = p["output_tps"] / p["inprocess_work"]["tps"]
    del stage
    if device.type == "cuda":
        torch.cuda.empty_cache()


def inprocess_steps(stage: StageModel, batch: int, context: int, prompts: float, steps: int,
                    device: torch.device, cuda_graphs: bool, scenario: str) -> dict[str, Any]:
    """Steps of `batch` rows that sample, as the worker runs them: a ModelRunner over device KV
    (zeros: the values do not change a step's time), graphs on CUDA. `prompts` a step on
    average (step k carries floor((k + 1) p) - floor(k p)) are prompts of `context` tokens,
    each a new sequence forgotten the step after, in the place of a decode row; the rest are
    decode rows of sequences at `context` and on. Each step waits for its tokens; the rate is
    the median of INPROCESS_ROUNDS rounds of `steps` steps (a round of a few dozen steps moved
    by a quarter from one bench process to the next)."""
    a = stage.args
    total = INPROCESS_WARMUP + INPROCESS_ROUNDS * steps
    per_seq = -(-(context + total) // PAGE_SIZE)
    most = min(batch, math.ceil(prompts))  # prompts in one step
    per_prompt = -(-context // PAGE_SIZE)
    decode_pages = batch * per_seq
    # two sets of prompt pages: one step's prompts are forgotten by the next, which uses the other
    pool = make_pool(stage, decode_pages + 2 * most * per_prompt, PAGE_SIZE, device)
    runner = build_runner(
        stage, pool, device, graphs=cuda_graphs and device.type == "cuda",
        max_rows=batch + most * max(0, context - 1),
        refused=lambda e: progress(scenario, f"in-process steps run eagerly: {e}"))
    token = LOWEST_PROMPT_ID % a.vocab_size
    last: list[int] = []  # the prompts of the step before
    paged: set[int] = set()  # decode sequences given their pages (on the first step they run)

    def step(runner: ModelRunner, k: int) -> None:
        nonlocal last
        n = min(batch, math.floor((k + 1) * prompts) - math.floor(k * prompts))
        base = decode_pages + (k % 2) * most * per_prompt
        ids = [batch + k * most + j for j in range(n)]
        seqs = [SeqPlan(id=i, start=context + k, n=1, sample=True,
                        pages_add=[] if i in paged else list(range(i * per_seq, (i + 1) * per_seq)))
                for i in range(batch - n)]
        paged.update(range(batch - n))
        seqs += [SeqPlan(id=s, start=0, n=context, sample=True,
                         pages_add=list(range(base + j * per_prompt, base + (j + 1) * per_prompt)))
                 for j, s in enumerate(ids)]
        plan = Step(step=k, token_ids=[token] * sum(s.n for s in seqs), seqs=seqs, free=last)
        meta = runner.apply(plan)
        runner.sample(plan, meta, runner.forward(plan, meta, None))
        last = ids

    for k in range(INPROCESS_WARMUP):
        step(runner, k)
    sync(device)
    t0, busy, mine = time.perf_counter(), machine_busy(), cpu_seconds(os.getpid())
    rounds = []
    for r in range(INPROCESS_ROUNDS):
        start = time.perf_counter()
        for k in range(steps):
            step(runner, INPROCESS_WARMUP + r * steps + k)
        sync(device)
        rounds.append(time.perf_counter() - start)
    seconds = time.perf_counter() - t0
    others = machine_busy() - busy - (cpu_seconds(os.getpid()) - mine)
    del runner, pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rates = [batch * steps / t for t in rounds]  # in the order run: a rise says warm-up was short
    return {"batch": batch, "context": context, "prompts_per_step": prompts, "steps": steps,
            "seconds": seconds, "rounds_tps": rates, "tps": statistics.median(rates),
            "others_cores": max(0.0, others / seconds)}
