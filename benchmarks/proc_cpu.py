"""CPU time of a cluster's processes, from /proc: which process is which (the engine core, its
frontends, its workers, other helpers), their utime + stime, and the machine's busy time, for
`siding bench serve`'s CPU per token."""

from __future__ import annotations

import os
import time
from typing import Any

CLOCK_TICK = os.sysconf("SC_CLK_TCK")
IDLE_S = 2.0  # how long the idle cluster's CPU is read before the first point


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (state) on; the name before it may hold spaces."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of every thread of `pid` (fields 14 and 15); None once it has gone."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def cluster_processes(core: int) -> dict[int, str]:
    """pid -> name of `core` ("core") and every process below it: "worker R" (`-m worker`,
    `--rank R`), "frontend I" (`--index I`), or "other PID" (helpers: counted as non-worker)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(stat_fields(int(entry))[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [], [core]
    while frontier:
        tree += frontier
        frontier = sorted(p for p, parent in parents.items() if parent in frontier)
    names = {core: "core"}
    for pid in tree[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        line = " ".join(argv)
        if " -m worker" in line:
            names[pid] = f"worker {flag(argv, '--rank', f'pid {pid}')}"
        elif "frontend" in line:
            names[pid] = f"frontend {flag(argv, '--index', f'pid {pid}')}"
        else:
            names[pid] = f"other {pid}"
    return names


def flag(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


def cpu_use(start: dict[int, tuple[str, float | None]], end: dict[int, tuple[str, float | None]],
            tokens: int, window: float) -> list[dict[str, Any]]:
    """Per process, CPU seconds between two readings, per output token and as busy cores. A
    process first seen at the end started in the window: all its time is the window's."""
    out = []
    for pid, (name, last) in end.items():
        first = start.get(pid, (name, 0.0))[1]
        used = None if last is None or first is None else last - first
        out.append({"pid": pid, "name": name, "cpu_s": used,
                    "us_per_token": None if used is None or not tokens else used * 1e6 / tokens,
                    "cores": None if used is None else used / window})
    return out


def read_cpu(names: dict[int, str]) -> dict[int, tuple[str, float | None]]:
    return {pid: (name, cpu_seconds(pid)) for pid, name in names.items()}


def idle_cores(core: int, seconds: float = IDLE_S) -> dict[str, float]:
    """Cores each cluster process keeps busy over the next `seconds` with nothing to do: the
    part of its per-token CPU that is not per token."""
    names = cluster_processes(core)
    start = read_cpu(names)
    time.sleep(seconds)
    return {c["name"]: c["cores"] for c in cpu_use(start, read_cpu(names), 0, seconds)}


def machine_busy() -> float:
    """CPU seconds every core of the machine has spent busy (/proc/stat: user, nice, system,
    irq, softirq), whoever it was for."""
    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / CLOCK_TICK


def cpu_by_kind(cpu: list[dict[str, Any]], tokens: int) -> dict[str, float | None]:
    """CPU microseconds per token of the cluster's core, frontends, workers, other processes,
    and of all but the workers; None where nothing was measured (no such process, one gone, no
    tokens). The bench's own clients are not the cluster's."""
    kinds = {kind: [p["cpu_s"] for p in cpu if p["name"].startswith(kind)]
             for kind in ("core", "frontend", "worker", "other")}
    kinds["non_worker"] = kinds["core"] + kinds["frontend"] + kinds["other"]
    return {f"{kind}_us_per_token": None if not used or None in used or not tokens
            else sum(used) * 1e6 / tokens for kind, used in kinds.items()}


