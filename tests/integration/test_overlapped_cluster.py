"""Steps planned ahead (worker/overlap.py; `--overlap on`, which a CPU cluster lacks by
default): an engine core that plans each sequence's next row on a token still in flight, and a
worker that takes it from its device, give the same token ids as a layer split, which plans one
step a stage, with device and host KV, alone and (in exact mode) in a crowd whose batch changes
every few steps, and a request that ends on a stop token as well; the counts say so."""

from __future__ import annotations

import pytest
from helpers.cluster_tokens import CROWD, MODEL, crowd, exact_crowd, outputs, scrape

from coordinator.prometheus_config import free_metrics_port, worker_ports
from protocol.client import Client

STOPPED = {"prompt": "The capital of France is", "max_tokens": 8}


@pytest.fixture(scope="module")
def reference(launch) -> tuple[list[list[int]], list[int]]:
    c = launch(*MODEL, "--workers", "2")  # two stages: nothing is planned ahead
    out = outputs(c.endpoint), stopped(c.endpoint)
    c.stop()
    return out


def stopped(endpoint: str) -> list[int]:
    """A request that stops at its third token, as a stop token id: only the result shows it."""
    with Client(endpoint, timeout=300) as c:
        third = c.generate(**STOPPED, ignore_eos=True).token_ids[2]
        return c.generate(**STOPPED, ignore_eos=True, stop_token_ids=[third]).token_ids


@pytest.mark.parametrize("kv", [
    ("--kv", "device"),
    ("--kv", "host", "--pipeline-depth", "1"),
    # every sequence parked and restored elsewhere every 3 decode steps: a due park waits for
    # the steps in flight, so plans ahead stop and start again around it
    ("--kv", "host", "--pipeline-depth", "2", "--preempt-every", "3"),
])
def test_steps_planned_ahead_give_the_tokens_of_plain_ones(launch, reference, kv):
    port = free_metrics_port(1)
    c = launch(*MODEL, *kv, "--overlap", "on", "--metrics-port", str(port))
    assert (outputs(c.endpoint), stopped(c.endpoint)) == reference
    core, (worker,) = scrape(port), worker_ports(port, 1)
    # greedy requests of 4 and 8 tokens and the three choices of one: most of their tokens were
    # planned on one in flight (how many depends on when results reach the core; a row past the
    # stop token is planned only when its result comes after the next plan's turn)
    assert core["siding_ahead_rows_total", "used"] >= 8
    w = scrape(worker)
    assert w["siding_ahead_steps_total", "queued"] + w["siding_ahead_steps_total", "idle"] >= 20
    c.stop()


def test_steps_planned_ahead_keep_exact_mode_exact_for_a_crowd(launch):
    expected = exact_crowd(launch)
    port = free_metrics_port(1)
    overlapped = launch(*MODEL, "--exact", "--kv", "host", "--overlap", "on", "--metrics-port",
                        str(port))
    assert crowd(overlapped.endpoint) == expected
    # the batch shrinks as requests end, and new rows join rows planned ahead
    assert scrape(port)["siding_ahead_rows_total", "used"] >= sum(
        kw["max_tokens"] - 2 for kw in CROWD)
    overlapped.stop()
