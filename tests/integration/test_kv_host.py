"""`--kv host` gives the same token ids as `--kv device` at every pipeline depth, on one and two
workers, with every transfer copy delayed (the hidden `--transport-delay-ms`, a fault
injection), with sequences parked and restored between steps, and in exact mode for a crowd of
concurrent requests; its workers export the ring's transfers and declines."""

from __future__ import annotations

import pytest
from helpers.cluster_tokens import MODEL, crowd, exact_crowd, outputs, scrape

from coordinator.prometheus_config import free_metrics_port, worker_ports


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
def test_host_kv_tokens_match_device_kv(launch, reference, depth, workers, delay_ms,
                                        budget_mib, preempt):
    port = free_metrics_port(workers)
    c = launch(*MODEL, "--kv", "host", "--pipeline-depth", str(depth), "--workers",
               str(workers), "--ring-budget-mib", str(budget_mib), "--metrics-port", str(port),
               "--preempt-every", str(preempt), "--transport-delay-ms", str(delay_ms))
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


def test_exact_host_kv_matches_exact_device_kv_for_a_concurrent_crowd(launch):
    expected = exact_crowd(launch)
    host = launch(*MODEL, "--exact", "--kv", "host", "--pipeline-depth", "2",
                  "--transport-delay-ms", "1")
    assert crowd(host.endpoint) == expected
    host.stop()
