"""`--busy-poll`: a process spins on its sockets for a while after a message, then sleeps."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from coordinator.cli import build_parser
from coordinator.config import CoordinatorConfig
from protocol.busy_poll import AUTO_SECONDS, BusyPoller, busy_seconds
from protocol.worker_config import WorkerConfig


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://busy")
    b.connect("inproc://busy")
    poller = zmq.Poller()
    poller.register(b, zmq.POLLIN)
    yield a, b, poller
    ctx.destroy(linger=0)


def waited(busy: BusyPoller, poller: zmq.Poller, timeout_ms: int) -> tuple[dict, float, float]:
    """(events, wall seconds, CPU seconds of this process) of one poll."""
    wall, cpu = time.perf_counter(), time.process_time()
    events = busy.poll(poller, timeout_ms)
    return events, time.perf_counter() - wall, time.process_time() - cpu


def test_auto_spins_on_cuda_clusters_only_and_a_number_is_taken_as_given():
    assert busy_seconds(None, ["cpu", "cpu"]) == 0.0
    assert busy_seconds(None, ["cuda:0"]) == AUTO_SECONDS > 0
    assert busy_seconds(0.0, ["cuda:0"]) == 0.0
    assert busy_seconds(2.5, ["cpu"]) == 2.5
    assert CoordinatorConfig(devices=["cuda:0"]).busy_seconds == AUTO_SECONDS
    assert CoordinatorConfig(worker=WorkerConfig(busy_poll=0.0),
                             devices=["cuda:0"]).busy_seconds == 0.0


@pytest.mark.parametrize("value, seconds", [([], None), (["--busy-poll", "auto"], None),
                                            (["--busy-poll", "0"], 0.0),
                                            (["--busy-poll", "0.25"], 0.25)])
def test_the_launch_flag(value, seconds):
    assert build_parser().parse_args(["launch", *value]).busy_poll == seconds


@pytest.mark.parametrize("value", ["-1", "4000", "soon", "nan"])
def test_a_bad_launch_flag_is_refused_by_name(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--busy-poll", value])
    assert "--busy-poll: must be auto or 0 to 3600 seconds" in capsys.readouterr().err


def test_within_the_window_it_spins_and_past_it_it_sleeps(pair):
    _, _, poller = pair
    events, wall, cpu = waited(BusyPoller(10.0), poller, 150)
    assert events == {} and 0.14 < wall < 1.0
    assert cpu > 0.5 * wall  # spun: this process ran all along
    events, wall, cpu = waited(BusyPoller(0.0), poller, 150)
    assert events == {} and 0.14 < wall < 1.0
    assert cpu < 0.3 * wall  # slept in the kernel
    busy = BusyPoller(0.03)  # spins out its window, then sleeps the rest of the timeout
    events, wall, cpu = waited(busy, poller, 300)
    assert events == {} and 0.29 < wall < 1.5
    assert cpu < 0.5 * wall


def test_a_message_ends_the_spin_and_opens_the_window_again(pair):
    a, b, poller = pair
    busy = BusyPoller(10.0)
    timer = threading.Timer(0.05, a.send, [b"plan"])
    timer.start()
    events, wall, _ = waited(busy, poller, 2000)
    timer.join()
    assert events == {b: zmq.POLLIN} and wall < 1.0 and b.recv() == b"plan"
    before = busy.last
    assert waited(busy, poller, 0)[0] == {}  # 0: a look, not a wait
    assert busy.last == before
    a.send(b"more")
    assert waited(busy, poller, 0)[0] == {b: zmq.POLLIN} and busy.last > before
