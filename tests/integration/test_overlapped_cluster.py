"""Steps planned ahead (worker/overlap.py; `--overlap on`, which a CPU cluster lacks by
default): an engine core that plans each sequence's next row on a token still in flight, and a
worker that takes it from its device, give the same token ids as a layer split, which plans one
step a stage, with device and host KV, with every process busy polling, alone and (in exact
mode) in a crowd whose batch changes every few steps, and a request that ends on a stop token as
well; the counts say so. A pool a quarter of the load parks and restores sequences planned
ahead and drains, exact tokens kept."""

from __future__ import annotations

import asyncio

import pytest
from helpers.cluster_tokens import CROWD, MODEL, crowd, exact_crowd, outputs, scrape

from coordinator.prometheus_config import free_metrics_port, worker_ports
from protocol import AsyncClient, Client

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
    # every process polling in a loop between messages (`--busy-poll`, off on a CPU by default)
    ("--kv", "device", "--busy-poll", "0.5"),
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
    # 16 rows a step: the 22- and 39-token prompts' chunks are planned back to back
    overlapped = launch(*MODEL, "--exact", "--kv", "host", "--overlap", "on", "--metrics-port",
                        str(port), "--max-batch-tokens", "16")
    assert crowd(overlapped.endpoint) == expected
    # the batch shrinks as requests end, and new rows join rows planned ahead
    assert scrape(port)["siding_ahead_rows_total", "used"] >= sum(
        kw["max_tokens"] - 2 for kw in CROWD)
    overlapped.stop()


PRESSED = [{"prompt": f"Write a long story about a {animal}.", "max_tokens": 40,
            **({"temperature": 0.9, "seed": 7} if i % 2 else {})}
           for i, animal in enumerate(("cat", "dog", "horse", "whale", "fox", "owl"))]


def pressed(endpoint: str) -> tuple[list[list[int]], int]:
    """The PRESSED requests at once: their tokens and how often they were preempted."""
    async def run():
        async with AsyncClient(endpoint, timeout=300) as c:
            return await asyncio.gather(*(c.generate(**kw, ignore_eos=True) for kw in PRESSED))

    done = asyncio.run(run())
    return [r.token_ids for r in done], sum(r.choices[0].preemptions for r in done)


def test_steps_planned_ahead_under_a_full_pool_park_drain_and_keep_exact_tokens(launch):
    """Six sequences of about 10 + 40 tokens need 6 x 13 pages of 4; the pool holds 24: rows
    planned ahead meet sequences that cannot grow, parks and restores, and exact mode's tokens
    stay those of a pool with room for all."""
    roomy = launch(*MODEL, "--exact", "--workers", "2")
    expected, _ = pressed(roomy.endpoint)
    roomy.stop()
    c = launch(*MODEL, "--exact", "--overlap", "on", "--kv-pages", "24", "--page-size", "4",
               "--park-pages", "96")
    tokens, preemptions = pressed(c.endpoint)
    assert tokens == expected and preemptions > 0
    with Client(c.endpoint, timeout=30) as client:
        s = client.status()
    assert s["pool"]["pages_used"] == 0 and s["park"]["slots_used"] == 0
    assert s["requests"] == {"running": 0, "waiting": 0, "parked": 0}
    c.stop()
