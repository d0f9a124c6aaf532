"""`siding bench park`: park and restore bandwidth of a worker's park store against the link.

Runs in-process on one worker's KV pool and park store (no cluster): a park gathers a
sequence's pages on the device and copies them to pinned host slots; a restore copies them back
and scatters them into other pages. Reported per size: bytes per copy, GB/s each way, and the
fraction of the pinned link measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from protocol.help_formatter import HelpFormatter
from worker.attention import choose_attention
from worker.kv.device_pool import KVPool
from worker.kv.park_store import ParkStore
from worker.loaders import resolve

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

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="siding bench park", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="synthetic:llama-1b", help="only its shape is used")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="as `siding launch --dtype`")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--pages", default="16,64,256,1024", help="pages parked at once")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each point")
    p.add_argument("--out", default="bench-results", help="directory for the results")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = DTYPES.get(a.dtype, torch.float32 if device.type == "cpu" else torch.bfloat16)
    args = resolve(a.model).args
    sizes = [int(x) for x in a.pages.split(",")]
    n_pages = 2 * max(sizes)
    pool = KVPool(args.n_layers, n_pages, a.page_size, args.n_kv_heads, args.head_dim, dtype,
                  device, choose_attention(False, device, args.head_dim))
    pool.k.normal_()
    pool.v.normal_()
    store = ParkStore(pool, max(sizes))
    progress("park", f"{args.n_layers} layers x {pool.bytes_per_page} B/page, {dtype}, {device}")

    link = {d: pinned_bandwidth(device, d) for d in ("d2h", "h2d")}
    samples: dict[int, dict[str, list[float]]] = {n: {"out": [], "in": []} for n in sizes}
    for r in range(a.repeats + 1):
        for n in sizes:
            pages = list(range(n))
            slots = list(range(n))
            sync(device)
            t0 = time.perf_counter()
            nbytes = store.park(7, pages, slots)
            sync(device)
            t1 = time.perf_counter()
            store.restore(7, slots, list(range(n_pages - n, n_pages)))
            sync(device)
            t2 = time.perf_counter()
            if r:  # the first round warms up allocations and kernels
                samples[n]["out"].append(nbytes / (t1 - t0))
                samples[n]["in"].append(nbytes / (t2 - t1))
        progress("park", f"round {r}/{a.repeats}")

    rows, points = [], {}
    for n in sizes:
        out, inn = Spread.of(samples[n]["out"]), Spread.of(samples[n]["in"])
        nbytes = n * pool.bytes_per_page
        points[n] = {"bytes": nbytes, "bytes_per_copy": nbytes // 2, "park": out, "restore": inn,
                     "park_of_link": out.median / link["d2h"].median,
                     "restore_of_link": inn.median / link["h2d"].median}
        rows.append([n, f"{nbytes / 2**20:.1f}", f"{nbytes / 2 / 2**20:.1f}",
                     out.text(1e-9, 2), inn.text(1e-9, 2),
                     f"{points[n]['park_of_link']:.2f}", f"{points[n]['restore_of_link']:.2f}"])
    stamp = timestamp()
    json_path, png_path = result_paths(a.out, "park", stamp)
    write_json(json_path, {
        "scenario": "park", "model": a.model, "dtype": str(dtype), "page_size": a.page_size,
        "bytes_per_page": pool.bytes_per_page, "copies_per_park": 2,
        "link_bytes_per_s": link, "points": points, "machine": machine_info(a.device),
    })
    write_plot(png_path, [
        Series("park (device -> host)", sizes, [points[n]["park"] for n in sizes]),
        Series("restore (host -> device)", sizes, [points[n]["restore"] for n in sizes]),
        Series("pinned link d2h", sizes, [link["d2h"]] * len(sizes)),
        Series("pinned link h2d", sizes, [link["h2d"]] * len(sizes)),
    ], f"park and restore, {a.model} shape, {device}", "pages moved at once", "bytes/s")
    print(f"link: d2h {link['d2h'].text(1e-9, 2)} GB/s, h2d {link['h2d'].text(1e-9, 2)} GB/s")
    print(format_table(["pages", "MiB", "MiB/copy", "park GB/s", "restore GB/s", "park/link",
                        "restore/link"], rows))
    print(f"wrote {json_path} and {png_path}")
