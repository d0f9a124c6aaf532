"""A worker that dies is replaced; its sequences recompute and no request is lost."""

import os
import signal
import threading
import time

from protocol import Client


def test_killed_worker_is_respawned_and_requests_complete(launch):
    cluster = launch("--model", "smollm2-135m", "--workers", "2")
    with Client(cluster.endpoint, timeout=600) as c:
        victim = c.status()["workers"][1]["pid"]
    results, errors = {}, []

    def run(i: int) -> None:
        try:
            with Client(cluster.endpoint, timeout=600) as c:
                results[i] = list(c.stream(f"Story number {i}:", max_tokens=60, ignore_eos=True))
        except Exception as e:  # asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(results) == 0 and time.monotonic() < deadline:
        with Client(cluster.endpoint, timeout=30) as c:
            if c.status()["requests"]["running"] == 4:
                break
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(600)
    assert errors == []
    for chunks in results.values():
        assert sum(len(ch.token_ids) for ch in chunks) == 60
        assert chunks[-1].finish_reason == "length"
    with Client(cluster.endpoint, timeout=60) as c:
        status = c.status()
        assert [w["alive"] for w in status["workers"]] == [True, True]
        assert status["workers"][1]["pid"] != victim
        assert "Paris" in c.generate("The capital of France is", max_tokens=8).text
