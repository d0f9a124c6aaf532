"""Overlapped decode steps (worker/overlap.py; `--overlap on`, which a CPU cluster lacks by
default): a worker that enqueues each step's successor before its plan arrives gives the same
token ids as workers that do not, with device and host KV, alone and (in exact mode) in a crowd
whose batch changes every few steps; it reports the steps it used whole, in part and dropped."""

from __future__ import annotations

import pytest
from helpers.cluster_tokens import CROWD, MODEL, crowd, exact_crowd, outputs, scrape

from coordinator.prometheus_config import free_metrics_port, worker_ports


@pytest.fixture(scope="module")
def reference(launch) -> list[list[int]]:
    c = launch(*MODEL, "--workers", "2")  # two stages: no step is ever guessed
    out = outputs(c.endpoint)
    c.stop()
    return out


@pytest.mark.parametrize("kv", [
    ("--kv", "device"),
    ("--kv", "host", "--pipeline-depth", "1"),
    # every sequence parked and restored elsewhere every 3 decode steps: plans that park, and
    # the steps after them, never match a guess
    ("--kv", "host", "--pipeline-depth", "2", "--preempt-every", "3"),
])
def test_overlapped_steps_give_the_tokens_of_plain_ones(launch, reference, kv):
    port = free_metrics_port(1)
    c = launch(*MODEL, *kv, "--overlap", "on", "--metrics-port", str(port))
    assert outputs(c.endpoint) == reference
    (worker,) = worker_ports(port, 1)
    m = scrape(worker)
    # greedy requests of 4 and 8 tokens, one after another: guesses from the first step on, and
    # one not used when each ends (the next plan is another request's; parks drop guesses)
    assert m["siding_ahead_steps_total", "used"] >= 4
    assert m["siding_ahead_steps_total", "dropped"] >= 1
    c.stop()


def test_overlapped_steps_keep_exact_mode_exact_for_a_crowd(launch):
    expected = exact_crowd(launch)
    port = free_metrics_port(1)
    overlapped = launch(*MODEL, "--exact", "--kv", "host", "--overlap", "on", "--metrics-port",
                        str(port))
    assert crowd(overlapped.endpoint) == expected
    (worker,) = worker_ports(port, 1)
    m = scrape(worker)
    # the batch shrinks as requests end: the others' guessed rows are used, the rest dropped
    assert m["siding_ahead_steps_total", "partial"] >= len(CROWD) - 1
    overlapped.stop()
