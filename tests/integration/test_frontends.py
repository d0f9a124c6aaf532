"""Frontends: several serve the same tokens; one that dies is restarted, its clients get an error
at once (never a hang), and everyone else is served on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers.remote import free_port, start_worker

from coordinator.config import CoordinatorConfig
from coordinator.local_cluster import LocalCluster
from protocol import Client, RequestError, security

PROMPT = [72, 101, 108, 108, 111]
FRONTEND_TIMEOUT = CoordinatorConfig.frontend_timeout


@pytest.fixture(scope="module")
def cluster(launch):
    return launch("--model", "synthetic:tiny", "--frontends", "2", "--kv-pages", "256")


def endpoints(cluster) -> list[str]:
    return cluster.endpoint.split(",")


def test_ready_lists_every_frontend_and_each_serves_the_same_tokens(cluster):
    eps = endpoints(cluster)
    assert len(eps) == 2 and len(set(eps)) == 2
    results = []
    for ep in eps:
        with Client(ep, timeout=60) as c:
            results.append(c.generate(prompt_token_ids=PROMPT, max_tokens=12, ignore_eos=True))
            frontends = c.status()["frontends"]
    assert results[0].token_ids == results[1].token_ids and len(results[0].token_ids) == 12
    assert results[0].text == results[1].text
    assert [f["serving"] for f in frontends] == [True, True]
    assert sorted(f["endpoint"] for f in frontends) == sorted(eps)


def test_a_killed_frontend_is_restarted_and_its_streams_fail_at_once(cluster):
    victim_ep, other_ep = endpoints(cluster)
    with Client(victim_ep, timeout=60) as c:
        status = c.status()
    victim = next(f for f in status["frontends"] if f["endpoint"] == victim_ep)
    outcome: dict = {}
    streaming = threading.Event()

    def stream(ep: str, key: str) -> None:
        try:
            with Client(ep, timeout=600) as c:
                n = 0
                for chunk in c.stream(prompt_token_ids=PROMPT, max_tokens=1000, ignore_eos=True):
                    n += len(chunk.token_ids)
                    if key == "victim" and n >= 2:
                        streaming.set()
                outcome[key] = n
        except RequestError as e:
            outcome[key] = e
            outcome[key + "_at"] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(victim_ep, "victim")),
               threading.Thread(target=stream, args=(other_ep, "other"))]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(600)
    assert isinstance(outcome["victim"], RequestError)
    assert outcome["victim_at"] - killed_at < 15  # the client's silence check, not its timeout
    assert outcome["other"] == 1000  # the other frontend's client lost nothing
    deadline = time.monotonic() + 60
    while True:  # the restarted frontend takes the same endpoint
        try:
            with Client(victim_ep, timeout=30) as c:
                status = c.status()
                again = c.generate(prompt_token_ids=PROMPT, max_tokens=12, ignore_eos=True)
            break
        except RequestError:
            assert time.monotonic() < deadline, "the frontend did not come back"
    restarted = next(f for f in status["frontends"] if f["endpoint"] == victim_ep)
    assert restarted["pid"] != victim["pid"] and restarted["restarts"] == 1
    assert len(again.token_ids) == 12
    while status["pool"]["pages_used"] or status["requests"]["running"]:  # nothing leaked
        assert time.monotonic() < deadline, status["pool"]
        time.sleep(0.2)
        with Client(other_ep, timeout=30) as c:
            status = c.status()


def test_frontends_outlive_a_start_up_longer_than_their_liveness_deadline(tmp_path):
    """Workers may take minutes to load; a frontend waiting to serve still counts as alive."""
    keys = str(security.generate_keys(tmp_path / "keys"))
    port = free_port()
    cluster = LocalCluster("--model", "synthetic:tiny", "--workers", "1", "--frontends", "2",
                           "--worker-listen", f"tcp://127.0.0.1:{port}", "--curve-keys", keys,
                           command="coordinator", timeout=120)
    started = threading.Thread(target=cluster.start)
    started.start()
    time.sleep(FRONTEND_TIMEOUT + 2)  # no worker yet: the cluster cannot be ready
    worker = start_worker(port, 0, keys)
    try:
        started.join(600)
        assert cluster.endpoint, "the cluster did not come up"
        with Client(cluster.endpoint, timeout=60, curve_keys_dir=keys) as c:
            assert len(c.generate(prompt_token_ids=PROMPT, max_tokens=4,
                                  ignore_eos=True).token_ids) == 4
            assert [f["restarts"] for f in c.status()["frontends"]] == [0, 0]
    finally:
        cluster.stop()
        worker.wait(30)
