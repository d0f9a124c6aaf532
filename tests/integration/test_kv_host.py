"""`--kv host` gives the same token ids as `--kv device` at every pipeline depth, on one and two
workers, with every transfer copy delayed (SIDING_TRANSPORT_DELAY_MS, which the launched cluster
inherits), with sequences parked and restored between steps, and in exact mode for a crowd of
concurrent requests; its workers export the ring's transfers and declines."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.prometheus_config import free_metrics_port, worker_ports
from protocol import AsyncClient, Client
from worker.transport import DELAY_ENV

MODEL = ("--model", "smollm2-135m")
# A 180-token prompt is 12 pages: at depth 2 its ring (4 slots, 24 KiB a page and layer in
# float32) passes a 1 MiB budget, so its steps decline; the short request after it recovers.
ALONE = [
    {"prompt_token_ids": list(range(100, 280)), "max_tokens": 4},
    {"prompt": "The capital of France is", "max_tokens": 8},
]
# Three completions of one prompt decode side by side in the same batches on every run, and
# share the prompt's pages (the partly filled tail is copied on write).
TOGETHER = {"prompt": "Once upon a time", "max_tokens": 8, "n": 3, "temperature": 0.8, "seed": 5}
# Arriving together, these batch differently from run to run: exact mode makes that invisible.
CROWD = [{"prompt_token_ids": [3 + (i * 131 + j * 17) % 490 for j in range(5 + 17 * i)],
          "max_tokens": 4 + 2 * i} for i in range(3)]


def outputs(endpoint: str) -> list[list[int]]:
    with Client(endpoint, timeout=300) as c:
        out = [c.generate(**kw, ignore_eos=True).token_ids for kw in ALONE]
        out += [ch.token_ids for ch in c.generate(**TOGETHER, ignore_eos=True).choices]
    return out


def crowd(endpoint: str) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with AsyncClient(endpoint, timeout=300) as c:
            done = await asyncio.gather(*(c.generate(**kw, ignore_eos=True) for kw in CROWD))
        return [r.token_ids for r in done]

    return asyncio.run(run())


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(sample name, the label that tells its series apart) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = next((s.labels[k] for k in ("path", "reason", "action", "outcome")
                          if k in s.labels), "")
            values[s.name, label] = s.value
    return values


@pytest.fixture(scope="module")
def reference(launch) -> list[list[int]]:
    c = launch(*MODEL, "--workers", "2")  # the same bits as one worker, in less time
    out = outputs(c.endpoint)
    c.stop()
    return out


@pytest.mark.parametrize("depth,workers,delay_ms,budget_mib,preempt", [
    (0, 1, 0, 512, 0),
    (1, 2, 0, 512, 0),
    (2, 1, 2, 1, 0),
    (4, 2, 2, 512, 2),  # every 2 decode steps, every sequence parked and restored elsewhere
])
def test_host_kv_tokens_match_device_kv(launch, reference, monkeypatch, depth, workers,
                                        delay_ms, budget_mib, preempt):
    if delay_ms:
        monkeypatch.setenv(DELAY_ENV, str(delay_ms))
    port = free_metrics_port(workers)
    c = launch(*MODEL, "--kv", "host", "--pipeline-depth", str(depth), "--workers",
               str(workers), "--ring-budget-mib", str(budget_mib), "--metrics-port", str(port),
               "--preempt-every", str(preempt))
    assert outputs(c.endpoint) == reference
    assert (scrape(port)["siding_preemptions_total", "park"] > 0) == bool(preempt)
    for p in worker_ports(port, workers):
        m = scrape(p)
        assert m["siding_transfer_bytes_total", "writeback"] > 0
        ahead, ordered = (m["siding_transfer_bytes_total", path] for path in ("ahead", "ordered"))
        declined = m["siding_ring_declines_total", "budget"]
        if depth == 0:
            assert ahead == 0 and ordered > 0 and declined == 0
        elif budget_mib == 1:
            assert declined > 0 and ordered > 0 and ahead > 0  # declined, then took it again
        else:
            assert ahead > 0 and ordered == 0 and m["siding_ring_slots", ""] == depth + 2
        copies = m["siding_transfer_copies_total", "ahead" if depth else "ordered"]
        assert copies > 0
    c.stop()


def exact_crowd(launch) -> list[list[int]]:
    """The crowd's tokens from an exact-mode cluster of two workers on device KV."""
    device = launch(*MODEL, "--exact", "--workers", "2")
    out = crowd(device.endpoint)
    device.stop()
    return out


def test_exact_host_kv_matches_exact_device_kv_for_a_concurrent_crowd(launch, monkeypatch):
    expected = exact_crowd(launch)
    monkeypatch.setenv(DELAY_ENV, "1")
    host = launch(*MODEL, "--exact", "--kv", "host", "--pipeline-depth", "2")
    assert crowd(host.endpoint) == expected
    host.stop()
