"""Prometheus scrape configuration for a cluster: the coordinator at port P, worker i at P+1+i.

`siding launch --write-prometheus-config` writes one for the ports it runs on; the shipped
`ops/prometheus.yml` (local cluster) and `ops/prometheus-compose.yml` (docker/compose.yaml) are
this module's output, and a test keeps them so. The job names are what `ops/alerts.yml` and the
dashboard select on.
"""

from __future__ import annotations

import random
import socket

COORDINATOR_JOB = "siding-coordinator"
WORKER_JOB = "siding-workers"


def worker_ports(metrics_port: int, n_workers: int) -> list[int]:
    return [metrics_port + 1 + i for i in range(n_workers)]


def free_metrics_port(n_workers: int, host: str = "127.0.0.1") -> int:
    """A port P with P and every worker's P+1+i free now, for clusters started side by side.

    Drawn below the kernel's ephemeral range (32768 on) and ZeroMQ's random ports (49152 on),
    so the cluster's own `*` binds do not take them in the meantime."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        if all(_free(host, p) for p in (port, *worker_ports(port, n_workers))):
            return port
    raise RuntimeError(f"no {n_workers + 1} consecutive free ports on {host}")


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def render(coordinator: str, workers: list[str], interval: str = "5s",
           rule_files: tuple[str, ...] = ()) -> str:
    """YAML for Prometheus; `coordinator` and `workers` are HOST:PORT targets."""
    lines = [
        "# Scrape configuration for a siding cluster, from coordinator/prometheus_config.py.",
        "global:",
        f"  scrape_interval: {interval}",
        f"  evaluation_interval: {interval}",
    ]
    if rule_files:
        lines += ["rule_files:", *(f'  - "{f}"' for f in rule_files)]
    lines += ["scrape_configs:"]
    for job, targets in ((COORDINATOR_JOB, [coordinator]), (WORKER_JOB, workers)):
        quoted = ", ".join(f'"{t}"' for t in targets)
        lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: [{quoted}]"]
    return "\n".join(lines) + "\n"


def for_cluster(metrics_port: int, n_workers: int, coordinator_host: str = "127.0.0.1",
                worker_hosts: list[str] | None = None, **kw) -> str:
    """The targets of a cluster whose coordinator serves metrics on `metrics_port`."""
    hosts = worker_hosts or ["127.0.0.1"] * n_workers
    ports = worker_ports(metrics_port, n_workers)
    return render(_target(coordinator_host, metrics_port),
                  [_target(h, p) for h, p in zip(hosts, ports)], **kw)


def scrape_host(bind_host: str) -> str:
    """Where a local Prometheus reaches a socket bound to `bind_host`."""
    return "127.0.0.1" if bind_host in ("", "*", "0.0.0.0", "::") else bind_host


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
