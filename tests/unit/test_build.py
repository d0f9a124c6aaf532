"""The composition root (worker/build.py): a runner composed from a stage, a pool and a park
store, as tests and benchmarks compose one, is the runner `build` makes of a WorkerConfig."""

import pytest
import torch
from helpers.graph_steps import PAGE, SAMPLING, run

from protocol.worker_config import WorkerConfig
from worker.build import build, build_runner, load_stage, make_pool
from worker.metrics import WorkerMetrics


@pytest.mark.parametrize("kv,exact", [("device", False), ("device", True), ("host", False),
                                      ("host", True)])
def test_a_runner_composed_from_its_parts_gives_the_hidden_rows_and_tokens_build_gives(kv, exact):
    config = WorkerConfig(model="synthetic:tiny", kv=kv, exact=exact, page_size=PAGE,
                          kv_pages=64, park_pages=4)
    built = build(config, 0, 1, "cpu", WorkerMetrics(0, "cpu", 1, False))
    stage = load_stage("synthetic:tiny", torch.float32, "cpu", exact=exact)
    pool = make_pool(stage, 64, PAGE, "cpu", exact=exact, kv=kv,
                     ring_budget_mib=config.ring_budget_mib)
    composed = build_runner(stage, pool, "cpu", park_pages=4)
    assert (built.layers, built.dtype, built.kv_bytes_per_page) == ((0, 4), torch.float32,
                                                                   pool.bytes_per_page)
    assert type(built.runner.pool) is type(pool) and built.runner.graphs is composed.graphs is None
    for (h1, t1), (h2, t2) in zip(run(built.runner, sampling=SAMPLING),
                                  run(composed, sampling=SAMPLING), strict=True):
        assert torch.equal(h1, h2) and t1 == t2
