"""`--busy-poll` on a cluster of real processes: after a request each process spins for the
window, then sleeps; an idle cluster's heartbeats (a frontend's every 2 s, over the engine
core's socket) open no window, so nothing spins while nothing is asked."""

from __future__ import annotations

import time

from benchmarks.proc_cpu import idle_cores
from protocol import Client

WINDOW_S = 2.0
IDLE_S = 5.0  # two or three of a frontend's heartbeats


def test_an_idle_cluster_spins_only_in_the_window_after_a_request(launch):
    c = launch("--model", "synthetic:tiny", "--busy-poll", str(WINDOW_S))
    with Client(c.endpoint, timeout=60) as client:
        assert len(client.generate(prompt_token_ids=[5, 6, 7], max_tokens=4,
                                   ignore_eos=True).token_ids) == 4
    after = idle_cores(c.proc.pid, WINDOW_S / 2)
    # spinning: three processes sharing CI's two cores, with whatever else runs beside them
    assert after["core"] > 0.1, after
    time.sleep(WINDOW_S / 2 + 0.5)  # the request's window closes
    idle = idle_cores(c.proc.pid, IDLE_S)
    # sleeping, a process's few wake-ups cost it a few milliseconds a second however busy the
    # machine; spinning through each heartbeat's window kept the core a quarter to half busy
    assert max(idle.values()) < 0.05, idle
