"""`siding bench matmul`: a step's weight products, default mode's matmul against exact mode's
batch-invariant one, at several row counts, and each weight's row invariance.

For a model's shape (`--model`; random weights, since a product's time does not depend on the
values), every layer's four products (wqkv, wo, w13, w2) and the head, in the order a step runs
them, each with `--rows` rows: through `F.linear` (default mode: cuBLAS on CUDA) and through
exact mode's linear (`worker.exact.exact_linear`: `matmul_triton` on CUDA, `exact_cpu` on the
CPU). On CUDA the whole sequence is captured in one CUDA graph and replayed, as a step graph
replays it: no launch gaps, and every layer's weights are tensors of their own, so the L2 cache
holds none of them from one product to the next. On the CPU it runs eagerly. Each point is the
median (min-max) of `--repeats` timed runs after a warm-up, the arms in turn at each row count.

Identity, per weight shape: exact mode's first row of a launch of each row count equals the row
alone, bit for bit (what `tests/gpu/test_exact_gpu.py` promises); default mode's answer is
reported, not required.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from protocol.help_formatter import HelpFormatter
from worker.build import resolve_dtype
from worker.exact import exact_linear
from worker.loaders import resolve
from worker.model import ModelArgs

from .decode import batch_sizes, dtype_name
from .link import sync
from .report import (
    Series,
    Spread,
    format_table,
    machine_info,
    progress,
    ratio,
    result_paths,
    timestamp,
    write_json,
    write_plot,
)

SCENARIO = "matmul"
ARMS = ("default", "exact")
Linear = Callable[..., torch.Tensor]


def layer_shapes(a: ModelArgs) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of one layer's products, in a step's order."""
    return [("wqkv", a.q_dim + 2 * a.kv_dim, a.dim), ("wo", a.dim, a.q_dim),
            ("w13", 2 * a.ffn_dim, a.dim), ("w2", a.dim, a.ffn_dim)]


def step_shapes(a: ModelArgs, layers: int) -> list[tuple[str, int, int]]:
    return layer_shapes(a) * layers + [("head", a.vocab_size, a.dim)]


class StepProducts:
    """A step's products over weights of their own, run through one linear."""

    def __init__(self, shapes: list[tuple[str, int, int]], rows: int, dtype: torch.dtype,
                 device: torch.device):
        g = torch.Generator(device).manual_seed(0)
        self.weights = [torch.randn(n, k, generator=g, device=device, dtype=dtype) * k ** -0.5
                        for _, n, k in shapes]
        ins = {k for _, _, k in shapes}
        self.inputs = {k: torch.randn(rows, k, generator=g, device=device, dtype=dtype)
                       for k in ins}

    def run(self, linear: Linear) -> None:
        for w in self.weights:
            linear(self.inputs[w.shape[1]], w)


class Timed:
    """One arm's step products, as the device runs them: a CUDA graph's replay, else eager."""

    def __init__(self, products: StepProducts, linear: Linear, device: torch.device):
        self.device = device
        self.graph = None
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                products.run(linear)  # compiles and allocates outside the capture
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                products.run(linear)
        self.run = self.graph.replay if self.graph is not None else (
            lambda: products.run(linear))

    def seconds(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        self.run()
        sync(self.device)
        return time.perf_counter() - t0


def row_identity(linear: Linear, shapes: list[tuple[str, int, int]], rows: list[int],
                 dtype: torch.dtype, device: torch.device) -> dict[str, bool]:
    """Per distinct weight: does row 0 of a launch of each row count equal the row alone?"""
    out = {}
    g = torch.Generator(device).manual_seed(1)
    for name, n, k in dict.fromkeys(shapes):
        w = torch.randn(n, k, generator=g, device=device, dtype=dtype) * k ** -0.5
        x = torch.randn(max(rows), k, generator=g, device=device, dtype=dtype)
        alone = linear(x[:1], w)
        out[f"{name} {n}x{k}"] = all(torch.equal(linear(x[:m], w)[:1], alone) for m in rows)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="siding bench matmul", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="a model spec; only its shape is used (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default: %(default)s)")
    p.add_argument("--dtype", default="auto",
                   help="auto: float32 on the CPU, bfloat16 on CUDA (default: %(default)s)")
    p.add_argument("--rows", type=batch_sizes, default=[1, 4, 32, 128, 512],
                   help="rows of each product, comma-separated (default: 1,4,32,128,512)")
    p.add_argument("--layers", type=int, default=0,
                   help="layers of products a step holds; 0: the model's (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=0,
                   help="timed runs a point; 0: 15 on CUDA, 5 on the CPU (default: %(default)s)")
    p.add_argument("--out", default="bench-results", help="directory (default: %(default)s)")
    a = p.parse_args(argv)
    if a.layers < 0 or a.repeats < 0:
        p.error("--layers and --repeats take 0 (the default) or more")
    return a


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = resolve_dtype(a.dtype, a.device)
    args = resolve(a.model).args
    layers = a.layers or args.n_layers
    repeats = a.repeats or (15 if device.type == "cuda" else 5)
    shapes = step_shapes(args, layers)
    arms: dict[str, Linear] = {"default": F.linear, "exact": exact_linear(device)}
    stamp = timestamp()
    samples: dict[str, dict[int, list[float]]] = {arm: {} for arm in ARMS}
    with torch.inference_mode():
        for rows in a.rows:
            progress(SCENARIO, f"{layers} layers + head at {rows} rows")
            products = StepProducts(shapes, rows, dtype, device)
            timed = {arm: Timed(products, fn, device) for arm, fn in arms.items()}
            for t in timed.values():
                t.seconds()  # warm-up
            for _ in range(repeats):
                for arm in ARMS:
                    samples[arm].setdefault(rows, []).append(timed[arm].seconds())
            del timed, products
            if device.type == "cuda":
                torch.cuda.empty_cache()
        identity = {arm: row_identity(fn, layer_shapes(args) + [shapes[-1]], a.rows, dtype,
                                      device) for arm, fn in arms.items()}
    points = []
    for rows in a.rows:
        spread = {arm: Spread.of(samples[arm][rows]) for arm in ARMS}
        points.append({"rows": rows, **{f"{arm}_s": spread[arm] for arm in ARMS},
                       "exact_over_default": ratio(spread["exact"], spread["default"]),
                       **{f"{arm}_samples_s": samples[arm][rows] for arm in ARMS}})
    record = {
        "scenario": SCENARIO, "command": "siding bench matmul " + " ".join(argv),
        "started": stamp, "machine": machine_info(a.device),
        "config": {"model": a.model, "device": a.device, "dtype": dtype_name(dtype),
                   "layers": layers, "rows": a.rows, "repeats": repeats,
                   "shapes": [list(s) for s in dict.fromkeys(shapes)]},
        "points": points, "row_identity": identity,
    }
    json_path, png_path = result_paths(a.out, SCENARIO, stamp)
    write_json(json_path, record)
    write_plot(png_path, [Series(arm, list(a.rows), [p[f"{arm}_s"] for p in points])
                          for arm in ARMS],
               f"a step's products, {a.model} ({layers} layers + head), {a.device}",
               "rows per product", "seconds per step")
    print(format_results(record))
    print(f"results: {json_path}, {png_path}")


def format_results(record: dict) -> str:
    rows = [[p["rows"], p["default_s"].text(1e3, 3), p["exact_s"].text(1e3, 3),
             f"{p['exact_over_default']:.2f}"] for p in record["points"]]
    table = format_table(["rows", "default ms", "exact ms", "exact / default"], rows)
    identity = record["row_identity"]
    lines = [f"row alone = row in any launch, {arm}: "
             + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in identity[arm].items())
             for arm in ARMS]
    return "\n".join([table, *lines])
