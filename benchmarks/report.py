"""What every benchmark scenario writes: spread statistics, the machine it ran on, the JSON record
and PNG plot under `bench-results/<scenario>-<timestamp>.*`, and the table it prints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("a spread needs at least one sample")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def text(self, scale: float = 1.0, digits: int = 1) -> str:
        """`median (min-max)`, each times `scale`."""
        m, lo, hi = (f"{v * scale:.{digits}f}" for v in (self.median, self.min, self.max))
        return f"{m} ({lo}-{hi})"


def ratio(a: Spread, b: Spread) -> float:
    """a's median over b's; nan when b's is zero."""
    return a.median / b.median if b.median else math.nan


@dataclass(frozen=True)
class Series:
    """One line of a plot: a median and min-max error bar per x."""

    label: str
    x: list[float]
    y: list[Spread]


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def result_paths(out_dir: str | Path, scenario: str, stamp: str) -> tuple[Path, Path]:
    """(json, png) paths for one run, creating `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{scenario}-{stamp}.json", out / f"{scenario}-{stamp}.png"


def log_path(out_dir: str | Path, scenario: str, stamp: str, arm: str) -> Path:
    """Where a run's cluster for `arm` logs (its processes' stderr), beside the record;
    creates `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{scenario}-{stamp}-{arm}.log"


def machine_info(device: str) -> dict[str, Any]:
    if device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(torch.device(device))
    else:
        device_name = cpu_model()
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "device": device,
        "device_name": device_name,
        "load_average": list(os.getloadavg()),  # 1, 5, 15 min
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_json(path: Path, record: dict[str, Any]) -> None:
    def plain(obj: Any) -> Any:
        if is_dataclass(obj) and not isinstance(obj, type):
            return asdict(obj)
        raise TypeError(f"{type(obj).__name__} is not JSON serialisable")

    path.write_text(json.dumps(record, indent=2, default=plain) + "\n")


def write_plot(
    path: Path, series: Sequence[Series], title: str, xlabel: str, ylabel: str,
    log_x: bool = True,
) -> None:
    # A bare Figure (no pyplot): no global backend state, renders with Agg.
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for s in series:
        med = [p.median for p in s.y]
        err = [[p.median - p.min for p in s.y], [p.max - p.median for p in s.y]]
        ax.errorbar(s.x, med, yerr=err, label=s.label, marker="o", capsize=4)
    xs = sorted({x for s in series for x in s.x})
    if log_x and len(xs) > 1 and xs[0] > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the rest right-aligned."""
    cells = [list(map(str, headers)), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        first = row[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))]).rstrip()

    return "\n".join(line(row) for row in cells)


def check_baseline_client(parser: Any, baseline: str | None, client: str) -> None:
    """Refuse (`parser.error`) a `--baseline` checkout without the bench's client module
    `benchmarks/<client>`: a baseline's clients run from its checkout, since a client speaks
    its own tree's protocol."""
    if baseline and not os.path.isfile(os.path.join(baseline, "benchmarks", client)):
        parser.error(f"--baseline {baseline}: its clients run from that checkout, which has no "
                     f"benchmarks/{client} (a tree from before it: copy this tree's there; its "
                     "protocol's AsyncClient is what it calls)")


@contextlib.contextmanager
def client_processes(module: str, shares: Sequence[Any], start_s: float, cwd: str | None = None,
                     env: dict[str, str] | None = None) -> Iterator[tuple[list, float]]:
    """Client processes (`python -m module`) started together, one per share (a JSON line on its
    stdin): each says `ready` once connected, then reads the moment to begin, `start_s` after
    the last is ready (a time.monotonic() value: one clock for every process of the machine).
    Yields (the processes, that moment); any still running at the end is killed."""
    clients = [subprocess.Popen([sys.executable, "-m", module], cwd=cwd, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in shares]
    try:
        for proc, share in zip(clients, shares):
            proc.stdin.write(json.dumps(share) + "\n")
            proc.stdin.flush()
        for proc in clients:
            expect(proc, "ready")
        begin = time.monotonic() + start_s
        for proc in clients:
            proc.stdin.write(f"{begin!r}\n")
            proc.stdin.close()
        yield clients, begin
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def client_result(proc: subprocess.Popen) -> Any:
    """The JSON a client process wrote last, once it has exited cleanly."""
    out = proc.stdout.read()
    if proc.wait():
        raise RuntimeError(f"a client process exited with status {proc.returncode} (its "
                           "errors are above)")
    return json.loads(out)


def expect(proc: subprocess.Popen, word: str) -> None:
    """The next line a client process writes (stdout) must be `word`."""
    line = proc.stdout.readline().strip()
    if line != word:
        raise RuntimeError(f"a client process said {line!r} where {word!r} was due (its "
                           "errors, if any, are above)")


def progress(scenario: str, message: str) -> None:
    print(f"bench {scenario}: {message}", file=sys.stderr, flush=True)
