"""`siding bench prefill`: time to first token of a batch of prompts prefilled in one step, in
process: siding's ModelRunner (device KV, the step's plan applied, its tokens sampled and read on
the host) against transformers' eager forward on the same weights (the last position's logits,
argmax read on the host), with the step's rate in tokens/s and as a fraction of the device's
bf16 matmul peak measured in the same run.

The arms alternate within each repeat, so load lands on both alike; the first round warms up
(kernel compilation, allocations) and is not counted. FLOPs count the layers' matmuls, the
causal attention's two products and the head on one row per sequence.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from protocol.help_formatter import HelpFormatter
from protocol.messages import SeqPlan, Step
from worker.build import build_runner, load_stage, make_pool, resolve_dtype
from worker.exact import apply_exact
from worker.loaders import resolve
from worker.model import ModelArgs

from .decode import LOWEST_PROMPT_ID, dtype_name
from .link import sync
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

SCENARIO = "prefill"
PAGE_SIZE = 16


def shapes(text: str) -> list[tuple[int, int]]:
    """"8x512,1x16384" -> [(8, 512), (1, 16384)]."""
    bad = argparse.ArgumentTypeError(f"shapes are BATCHxLENGTH, comma-separated: {text!r}")
    try:
        out = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise bad from None
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise bad
    return out  # type: ignore[return-value]


def prefill_flops(a: ModelArgs, batch: int, length: int) -> float:
    """Multiply-adds x 2 of one step prefilling `batch` prompts of `length` tokens."""
    per_token = a.dim * (a.q_dim + 2 * a.kv_dim) + a.q_dim * a.dim + 3 * a.dim * a.ffn_dim
    attention = 2 * a.q_dim * length * (length + 1) / 2  # q.k and p.v over the causal half
    return 2.0 * batch * (a.n_layers * (length * per_token + attention)
                          + a.vocab_size * a.dim)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of a large square matmul on `device` (CPUs: n / 4)."""
    n = n if device.type == "cuda" else n // 4
    x, y = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    x @ y
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        x @ y
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)


class SidingArm:
    def __init__(self, stage, exact: bool, batch: int, length: int, device: torch.device):
        self.per_seq = -(-length // PAGE_SIZE)
        pool = make_pool(stage, batch * self.per_seq + 1, PAGE_SIZE, device, exact=exact)
        self.runner = build_runner(stage, pool, device)
        self.batch, self.length = batch, length

    def run(self, prompts: torch.Tensor, round_: int) -> tuple[float, list[int]]:
        runner, b, n = self.runner, self.batch, self.length
        ids = prompts[:b, :n].reshape(-1).tolist()
        base = round_ * b  # fresh sequence ids each round
        plan = Step(step=round_, token_ids=ids, seqs=[
            SeqPlan(id=base + i, start=0, n=n, sample=True,
                    pages_add=list(range(i * self.per_seq, (i + 1) * self.per_seq)))
            for i in range(b)], free=[round_ * b - b + i for i in range(b)] if round_ else [])
        sync(runner.device)
        t0 = time.perf_counter()
        meta = runner.apply(plan)
        _, tokens = runner.sample(plan, meta, runner.forward(plan, meta, None))
        return time.perf_counter() - t0, tokens


class HFArm:
    def __init__(self, model, batch: int, length: int, device: torch.device):
        self.model, self.batch, self.length, self.device = model, batch, length, device

    @torch.inference_mode()
    def run(self, prompts: torch.Tensor, round_: int) -> tuple[float, list[int]]:
        ids = prompts[:self.batch, :self.length].to(self.device)
        sync(self.device)
        t0 = time.perf_counter()
        tokens = self.model(ids, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - t0, tokens


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="siding bench prefill", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="synthetic:llama-1b", help="any `siding launch --model`")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="as `siding launch --dtype`")
    p.add_argument("--shapes", type=shapes, default="8x512,32x512,1x16384",
                   help="BATCHxLENGTH prompts prefilled in one step, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each shape")
    p.add_argument("--exact", action="store_true", help="siding in exact mode")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--out", default="bench-results", help="directory for the results")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    return a


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = resolve_dtype(a.dtype, a.device)
    source = resolve(a.model)
    args = source.args
    longest = max(n for _, n in a.shapes)
    if longest > args.max_context:
        raise ValueError(f"a prompt of {longest} tokens exceeds the model's {args.max_context}")
    progress(SCENARIO, f"loading {a.model} ({dtype_name(dtype)}, {device})")
    stage = load_stage(source, dtype, device)
    hf = None
    if a.hf:
        from .hf_reference import from_stage  # transformers only when asked for
        hf = from_stage(stage)  # shares the weights: built before exact mode swaps forwards
    if a.exact:
        apply_exact(stage, device)
    peak = matmul_peak(device, dtype)
    progress(SCENARIO, f"matmul peak {peak / 1e12:.1f} TFLOP/s")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(LOWEST_PROMPT_ID, args.vocab_size,
                            (max(b for b, _ in a.shapes), longest), generator=generator)
    points: list[dict[str, Any]] = []
    for b, n in a.shapes:
        arms = {"siding": SidingArm(stage, a.exact, b, n, device)}
        if hf is not None:
            arms["hf"] = HFArm(hf, b, n, device)
        times: dict[str, list[float]] = {name: [] for name in arms}
        firsts: dict[str, list[int]] = {}
        for r in range(a.repeats + 1):
            for name, arm in arms.items():
                seconds, firsts[name] = arm.run(prompts, r)
                if r:
                    times[name].append(seconds)
        flops = prefill_flops(args, b, n)
        point = {"batch": b, "length": n, "tokens": b * n, "flops": flops}
        if "hf" in firsts:  # greedy first tokens: the same function computed
            point["first_tokens_agree"] = sum(
                x == y for x, y in zip(firsts["siding"], firsts["hf"], strict=True)) / b
        for name, ts in times.items():
            s = Spread.of(ts)
            point[name] = {"seconds": s, "tokens_per_s": b * n / s.median,
                           "of_matmul_peak": flops / s.median / peak}
        if "hf" in point:
            point["siding_over_hf"] = point["siding"]["seconds"].median / \
                point["hf"]["seconds"].median
        points.append(point)
        progress(SCENARIO, f"{b}x{n}: siding {point['siding']['seconds'].median * 1e3:.1f} ms"
                 + (f", transformers {point['hf']['seconds'].median * 1e3:.1f} ms"
                    if "hf" in point else ""))
        del arms
        if device.type == "cuda":
            torch.cuda.empty_cache()

    stamp = timestamp()
    json_path, png_path = result_paths(a.out, SCENARIO, stamp)
    write_json(json_path, {
        "scenario": SCENARIO, "model": a.model, "dtype": dtype_name(dtype), "exact": a.exact,
        "matmul_peak_flops": peak, "points": points, "machine": machine_info(a.device),
    })
    xs = list(range(len(points)))
    series = [Series("siding", xs, [p["siding"]["seconds"] for p in points])]
    if hf is not None:
        series.append(Series("transformers", xs, [p["hf"]["seconds"] for p in points]))
    write_plot(png_path, series, f"prefill time to first token, {a.model}, {device}",
               " | ".join(f"{p['batch']}x{p['length']}" for p in points), "seconds",
               log_x=False)
    rows = [[f"{p['batch']}x{p['length']}", p["siding"]["seconds"].text(1e3),
             p["hf"]["seconds"].text(1e3) if "hf" in p else "-",
             f"{p['siding_over_hf']:.2f}" if "hf" in p else "-",
             f"{p['siding']['tokens_per_s']:,.0f}", f"{p['siding']['of_matmul_peak']:.1%}",
             f"{p['first_tokens_agree']:.0%}" if "hf" in p else "-"]
            for p in points]
    print(f"matmul peak {peak / 1e12:.1f} TFLOP/s ({dtype_name(dtype)})")
    print(format_table(["shape", "siding ms", "transformers ms", "siding/hf", "siding tok/s",
                        "of matmul peak", "same first tokens"], rows))
    print(f"wrote {json_path} and {png_path}")
