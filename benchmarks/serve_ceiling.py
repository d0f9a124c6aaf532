"""`siding bench serve`'s ceiling: the worker's own decode step rate, in this process, at a
point's batch (`add_ceilings`), which the cluster's tokens/s is reported against."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from protocol.messages import SeqPlan, Step
from worker.attention import choose_attention
from worker.cuda_graphs import StepGraphs
from worker.kv.device_pool import KVPool
from worker.kv.park_store import ParkStore
from worker.loaders import resolve
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
    """Each point's in-process decode rate (one measurement per batch size) and its ratio."""
    progress(scenario, f"in-process decode: loading {a.model} ({dtype_name(dtype)}, {device})")
    source = resolve(a.model)
    stage = source.load_stage(0, source.args.n_layers, dtype, device)
    ceilings: dict[int, dict[str, Any]] = {}
    for p in points:
        batch = p[xname] if a.mode == "closed" else min(
            a.max_batch_seqs, max(1, round(p["mean_in_flight"])))
        if batch not in ceilings:
            ceilings[batch] = inprocess_decode(stage, batch, a.prompt_len, a.inprocess_steps,
                                               dtype, device, a.cuda_graphs, scenario)
            progress(scenario, f"in-process batch {batch}: {ceilings[batch]['tps']:.1f} tok/s "
                     f"(the rest of the machine: {ceilings[batch]['others_cores']:.2f} cores)")
        p["inprocess"] = ceilings[batch]
        p["of_inprocess"] = p["output_tps"] / ceilings[batch]["tps"]
    del stage
    if device.type == "cuda":
        torch.cuda.empty_cache()



def inprocess_decode(stage: StageModel, batch: int, context: int, steps: int, dtype: torch.dtype,
                     device: torch.device, cuda_graphs: bool, scenario: str) -> dict[str, Any]:
    """Decode steps of `batch` sequences at `context`, as the worker runs them: a ModelRunner
    over device KV (zeros: the values do not change a step's time), graphs on CUDA. Each step
    waits for its tokens; the rate is the median of INPROCESS_ROUNDS rounds of `steps` steps
    (a round of a few dozen steps moved by a quarter from one bench process to the next)."""
    a = stage.args
    total = INPROCESS_WARMUP + INPROCESS_ROUNDS * steps
    per_seq = -(-(context + total) // PAGE_SIZE)
    pool = KVPool(a.n_layers, batch * per_seq, PAGE_SIZE, a.n_kv_heads, a.head_dim, dtype,
                  device, choose_attention(False, device, a.head_dim))
    graphs = None
    if cuda_graphs and device.type == "cuda":
        try:
            graphs = StepGraphs(stage, pool, device)
        except ValueError as e:
            progress(scenario, f"in-process decode runs eagerly: {e}")
    runner = ModelRunner(stage, pool, ParkStore(pool, 1), device, graphs)
    tokens = [LOWEST_PROMPT_ID % a.vocab_size] * batch

    def decode(runner: ModelRunner, k: int) -> None:
        nonlocal tokens
        plan = Step(step=k, token_ids=tokens, seqs=[
            SeqPlan(id=i, start=context + k, n=1, sample=True,
                    pages_add=list(range(i * per_seq, (i + 1) * per_seq)) if k == 0 else [])
            for i in range(batch)])
        meta = runner.apply(plan)
        _, tokens = runner.sample(plan, meta, runner.forward(plan, meta, None))

    for k in range(INPROCESS_WARMUP):
        decode(runner, k)
    sync(device)
    t0, busy, mine = time.perf_counter(), machine_busy(), cpu_seconds(os.getpid())
    rounds = []
    for r in range(INPROCESS_ROUNDS):
        start = time.perf_counter()
        for k in range(steps):
            decode(runner, INPROCESS_WARMUP + r * steps + k)
        sync(device)
        rounds.append(time.perf_counter() - start)
    seconds = time.perf_counter() - t0
    others = machine_busy() - busy - (cpu_seconds(os.getpid()) - mine)
    del runner, graphs, pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rates = [batch * steps / t for t in rounds]  # in the order run: a rise says warm-up was short
    return {"batch": batch, "context": context, "steps": steps, "seconds": seconds,
            "rounds_tps": rates, "tps": statistics.median(rates),
            "others_cores": max(0.0, others / seconds)}
