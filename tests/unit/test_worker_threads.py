"""Local workers' torch threads come from the cores this process may run on (its affinity, as
`taskset` or a container's CPU set leave it), not the machine's count: more threads than cores
make every CPU op of a worker spin against the others."""

import os

import pytest

from coordinator.config import threads_per_worker


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_threads_follow_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 4, 5, 6, 7, 8, 9})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert threads_per_worker(1) == 8
    assert threads_per_worker(2) == 4
    assert threads_per_worker(16) == 1  # never none
