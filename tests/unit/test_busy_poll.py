"""`--busy-poll`: a process spins on its sockets for a while after a message, then sleeps."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from coordinator.cli import build_parser
from coordinator.config import CoordinatorConfig
from coordinator.frontend import Frontend
from coordinator.http.server import HttpServer
from protocol.busy_poll import AUTO_SECONDS, BusyPoller, busy_seconds
from protocol.messages import Serve
from protocol.wire import decode, encode
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


def waited(busy: BusyPoller, poller: zmq.Poller, timeout_ms: int) -> tuple[dict, float]:
    """(events, wall seconds) of one poll."""
    wall = time.perf_counter()
    events = busy.poll(poller, timeout_ms)
    return events, time.perf_counter() - wall


def test_auto_spins_on_cuda_clusters_only_and_a_number_is_taken_as_given():
    assert busy_seconds(None, ["cpu", "cpu"]) == 0.0
    assert busy_seconds(None, ["cuda:0"]) == AUTO_SECONDS > 0
    assert busy_seconds(0.0, ["cuda:0"]) == 0.0
    assert busy_seconds(2.5, ["cpu"]) == 2.5


@pytest.mark.parametrize("value, seconds", [([], None), (["--busy-poll", "auto"], None),
                                            (["--busy-poll", "0"], 0.0),
                                            (["--busy-poll", "0.25"], 0.25)])
def test_the_launch_flag(value, seconds):
    assert build_parser().parse_args(["launch", *value]).busy_poll == seconds


def test_a_bad_launch_flag_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--busy-poll", "soon"])
    assert "--busy-poll: must be auto or seconds" in capsys.readouterr().err
    for seconds in (-1.0, 4000.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--busy-poll must be auto or 0 to 3600 seconds"):
            CoordinatorConfig(worker=WorkerConfig(busy_poll=seconds))


class CountingPoller:
    """A poller with nothing to say, which counts how it was asked."""

    def __init__(self):
        self.looks = 0  # poll(0)
        self.waits: list[int] = []  # poll(t > 0)

    def poll(self, timeout_ms: int) -> list:
        if timeout_ms == 0:
            self.looks += 1
        else:
            self.waits.append(timeout_ms)
            time.sleep(timeout_ms / 1000)
        return []


def test_within_the_window_it_looks_in_a_loop_and_past_it_it_sleeps():
    poller = CountingPoller()
    t0 = time.monotonic()
    assert BusyPoller(10.0).poll(poller, 100) == {}
    assert 0.09 < time.monotonic() - t0 < 5.0  # its timeout, not its 10 s window
    assert poller.looks > 10 and poller.waits in ([], [0])  # spun out the whole timeout
    poller = CountingPoller()
    assert BusyPoller(0.0).poll(poller, 100) == {}
    assert poller.looks == 0 and poller.waits == [100]  # slept it all
    poller = CountingPoller()
    busy = BusyPoller(0.03)  # its window is open since its start: spins, then sleeps the rest
    t0 = time.monotonic()
    assert busy.poll(poller, 300) == {}
    assert 0.29 < time.monotonic() - t0 < 5.0
    assert poller.looks > 10 and len(poller.waits) == 1 and 200 < poller.waits[0] < 300
    poller = CountingPoller()
    assert busy.poll(poller, 50) == {}  # the window has closed: nothing came
    assert poller.looks == 0 and poller.waits == [50]


def test_frontends_take_the_window_the_core_sends_and_workers_resolve_their_own():
    from coordinator.frontend import Frontend
    from worker.build import build
    from worker.metrics import WorkerMetrics

    (serve, _) = decode(encode(Serve(kv_pages=8, page_size=16, busy_poll=0.5)))
    frontend = Frontend("inproc://core", 0, "tcp://127.0.0.1:0", None, False, False)
    try:
        assert frontend.busy.seconds == 0.0  # nothing spins before the core says
        frontend._on_serve(serve)
        assert frontend.busy.seconds == 0.5 and frontend.serve_msg is serve
    finally:
        frontend.close()
    for setting, seconds in [(None, 0.0), (0.25, 0.25)]:  # a CPU worker's own: auto is 0
        config = WorkerConfig(model="synthetic:tiny", kv_pages=16, busy_poll=setting)
        assert build(config, 0, 1, "cpu", WorkerMetrics(0, "cpu", 1, False)).busy_seconds \
            == seconds


def test_a_message_ends_the_spin_and_opens_the_window_again(pair):
    a, b, poller = pair
    busy = BusyPoller(10.0)
    timer = threading.Timer(0.05, a.send, [b"plan"])
    timer.start()
    events, wall = waited(busy, poller, 60_000)
    timer.join()
    assert events == {b: zmq.POLLIN} and wall < 30 and b.recv() == b"plan"  # not at its timeout
    before = busy.last
    assert waited(busy, poller, 0)[0] == {}  # 0: a look, not a wait
    assert busy.last == before
    a.send(b"more")
    assert waited(busy, poller, 0)[0] == {b: zmq.POLLIN} and busy.last > before


def test_heartbeats_open_no_window(pair):
    a, b, poller = pair
    busy = BusyPoller(10.0)
    busy.last = opened = time.monotonic() - 20  # the window has long closed
    a.send(b"heartbeat")
    assert waited(busy, poller, 100)[0] == {b: zmq.POLLIN} and busy.last > opened
    busy.signs_of_life()  # its owner read it: only a heartbeat
    assert busy.last == opened
    poller = CountingPoller()
    assert busy.poll(poller, 50) == {} and poller.looks == 0 and poller.waits == [50]


@pytest.mark.parametrize("serves_http", [False, True])
def test_a_frontend_spins_unless_it_serves_http(serves_http):
    """Its spin would keep the GIL from its HTTP thread (`Frontend._on_serve` says how)."""
    http = HttpServer(socket.socket(), None, None, 10.0) if serves_http else None
    frontend = Frontend("ipc:///nowhere", 0, "tcp://127.0.0.1:0", None, False, False, http)
    try:
        frontend._on_serve(SimpleNamespace(busy_poll=1.5))
        assert frontend.busy.seconds == (0.0 if serves_http else 1.5)
    finally:
        frontend.close()
