"""`status`: the cluster as the engine core sees it, for `siding status` and `Client.status`."""

from __future__ import annotations

import msgspec

from protocol.messages import ModelInfo

from .config import CoordinatorConfig
from .frontends import FrontendGroup
from .metrics import CoordinatorMetrics
from .scheduler import Scheduler
from .worker_group import WorkerGroup


def cluster_status(config: CoordinatorConfig, model: ModelInfo | None, scheduler: Scheduler,
                   workers: WorkerGroup, frontends: FrontendGroup, metrics: CoordinatorMetrics,
                   forward_seconds: list[float], outage_reason: str | None = None,
                   draining: bool = False) -> dict:
    s = scheduler
    total, steps = forward_seconds
    described = workers.describe()
    for w in described:  # the last stage's forward time comes with its results, up to date
        if w["rank"] == len(described) - 1 and steps:
            w["forward_seconds_mean"] = total / steps
    return {
        "model": model.name if model else None,
        "exact": config.worker.exact,
        "workers": described,
        "workers_up": workers.n_up,
        "workers_expected": config.workers,
        "workers_registered": workers.n_registered,  # fewer than expected: (re)grouping
        "layers": {"up": workers.layers_up, "total": model.n_layers if model else None},
        "failed": outage_reason,  # why the cluster cannot serve, if it cannot
        "draining": draining,
        "frontends": frontends.describe(),
        **metrics.figures(),
        "pool": {"page_size": config.worker.page_size, "pages_total": config.worker.kv_pages,
                 "pages_used": s.allocator.n_used, "pages_free": s.allocator.n_free},
        "park": {"slots_total": s.park_slots.n_pages, "slots_used": s.park_slots.n_used},
        "requests": {"running": len(s.running), "waiting": len(s.waiting),
                     "parked": len(s.parked)},
        "config": {k: v for k, v in msgspec.to_builtins(config).items()
                   if k not in ("curve_keys", "api_key")},
    }
