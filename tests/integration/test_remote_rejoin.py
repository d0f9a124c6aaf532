"""Remote workers (started by `siding worker`, not by the coordinator) that die come back: the
coordinator regroups when one registers again, every sequence recomputes and every request
completes with exact mode's tokens unchanged; with the worker gone for longer than
`--worker-wait`, waiting requests fail with `worker_failed`, `siding status` counts the workers
it awaits, and the cluster serves again once it returns."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.remote import free_port, start_worker

from coordinator.local_cluster import LocalCluster
from protocol import AsyncClient, Client, RequestError, security

MODEL = ("--model", "synthetic:tiny", "--exact")
PROMPTS = [[3 + (i * 29 + j * 7) % 200 for j in range(4 + 3 * i)] for i in range(6)]
TOKENS = 160


async def generate_all(endpoint: str, keys: str | None = None) -> list[list[int]]:
    async with AsyncClient(endpoint, timeout=300, curve_keys_dir=keys) as c:
        results = await asyncio.gather(*(c.generate(prompt_token_ids=p, max_tokens=TOKENS,
                                                    ignore_eos=True) for p in PROMPTS))
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    return str(security.generate_keys(tmp_path_factory.mktemp("rejoin") / "keys"))


@pytest.fixture(scope="module")
def reference(launch) -> list[list[int]]:
    c = launch(*MODEL, "--workers", "2")
    out = asyncio.run(generate_all(c.endpoint))
    c.stop()
    return out


def test_a_remote_worker_that_dies_and_comes_back_loses_no_request(reference, keys):
    port = free_port()
    workers = [start_worker(port, 0, keys), start_worker(port, 1, keys)]
    cluster = LocalCluster(*MODEL, "--workers", "2", "--worker-listen", f"tcp://127.0.0.1:{port}",
                           "--worker-wait", "10", "--curve-keys", keys, command="coordinator",
                           timeout=300)
    try:
        cluster.start()
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(
            tokens=asyncio.run(generate_all(cluster.endpoint, keys))))
        t.start()
        with Client(cluster.endpoint, timeout=60, curve_keys_dir=keys) as c:
            while c.status()["tokens"]["generated"] < 100:  # mid-generation
                time.sleep(0.05)
        workers[1].send_signal(signal.SIGKILL)
        workers[1].wait()
        time.sleep(1.0)
        workers[1] = start_worker(port, 1, keys)  # what its supervisor would do
        t.join(600)
        assert got["tokens"] == reference  # exact mode: the same bytes despite the fault
        with Client(cluster.endpoint, timeout=60, curve_keys_dir=keys) as c:
            s = c.status()
        assert s["workers_up"] == 2 and s["preemptions"]["recompute"] > 0 and not s["failed"]
        assert workers[0].poll() is None  # the survivor started over in its own process

        # gone for longer than --worker-wait: waiting requests fail, then it serves again
        workers[1].send_signal(signal.SIGKILL)
        workers[1].wait()
        t0 = time.monotonic()
        with Client(cluster.endpoint, timeout=120, curve_keys_dir=keys) as c, \
                pytest.raises(RequestError) as e:
            c.generate(prompt_token_ids=PROMPTS[0], max_tokens=8)
        waited = time.monotonic() - t0  # --worker-wait (10 s), not the client's timeout (600 s)
        assert e.value.code == "worker_failed" and 8 < waited < 200
        status = subprocess.run([sys.executable, "-m", "coordinator", "status", "--endpoint",
                                 cluster.endpoint, "--curve-keys", keys],
                                capture_output=True, text=True, timeout=120)
        assert "workers up 0 of 2 (1 registered, 1 awaited)   layers up 0 of 4" in (
            status.stdout), status.stdout + status.stderr
        workers[1] = start_worker(port, 1, keys)
        with Client(cluster.endpoint, timeout=120, curve_keys_dir=keys) as c:
            r = c.generate(prompt_token_ids=PROMPTS[0], max_tokens=TOKENS, ignore_eos=True)
        assert r.token_ids == reference[0]
    finally:
        cluster.stop()
        for w in workers:
            w.kill()
            w.wait()


def test_remote_workers_join_a_coordinator_that_restarts(reference, keys):
    port = free_port()
    workers = [start_worker(port, 0, keys), start_worker(port, 1, keys)]
    args = (*MODEL, "--workers", "2", "--worker-listen", f"tcp://127.0.0.1:{port}",
            "--curve-keys", keys)
    first = LocalCluster(*args, command="coordinator", timeout=300)
    second = LocalCluster(*args, command="coordinator", timeout=300)
    try:
        first.start()
        with Client(first.endpoint, timeout=60, curve_keys_dir=keys) as c:
            assert c.generate(prompt_token_ids=PROMPTS[1], max_tokens=TOKENS,
                              ignore_eos=True).token_ids == reference[1]
        first.proc.send_signal(signal.SIGKILL)  # its workers neither see nor are told
        first.proc.wait()
        second.start()  # they reconnect, are told to start over, and register with it
        with Client(second.endpoint, timeout=60, curve_keys_dir=keys) as c:
            assert c.generate(prompt_token_ids=PROMPTS[2], max_tokens=TOKENS,
                              ignore_eos=True).token_ids == reference[2]
            assert c.status()["workers_up"] == 2
    finally:
        for cluster in (first, second):
            cluster.stop()
        for w in workers:
            w.kill()
            w.wait()
