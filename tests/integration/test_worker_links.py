"""A coordinator and two workers started apart (`siding coordinator`, `siding worker`: the
layout of several hosts) on loopback with the cluster's keys: a local process without them
changes no token by pushing activations at a worker, gets no answer posing as a worker, and is
counted; neither side starts without keys unless told `--insecure`."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import zmq
from helpers.remote import free_port, start_worker
from helpers.strangers import rejected, tokens_around_fake_activations, until_counted
from zmq.auth import load_certificate

from coordinator.local_cluster import LocalCluster
from protocol import Client, security
from protocol.messages import Heartbeat, Register
from protocol.wire import encode

PROMPT = [72, 101, 108, 108, 111]
NEED_KEYS = "the worker links need --curve-keys DIR"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    return str(security.generate_keys(tmp_path_factory.mktemp("links") / "keys"))


@pytest.fixture(scope="module")
def cluster(keys):
    port, metrics = free_port(), free_port()
    workers = [start_worker(port, rank, keys) for rank in range(2)]
    c = LocalCluster("--model", "synthetic:tiny", "--workers", "2", "--curve-keys", keys,
                     "--worker-listen", f"tcp://127.0.0.1:{port}", "--metrics-port", str(metrics),
                     command="coordinator", timeout=300)
    try:
        c.start()
        yield SimpleNamespace(endpoint=c.endpoint, workers=f"tcp://127.0.0.1:{port}",
                              metrics=metrics)
    finally:
        c.stop()
        for w in workers:
            w.kill()
            w.wait()


def test_fake_activations_from_a_process_without_the_keys_change_no_token_and_are_counted(
        cluster, keys):
    with Client(cluster.endpoint, timeout=120, curve_keys_dir=keys) as c:
        want, got = tokens_around_fake_activations(c, cluster.metrics + 2, PROMPT)
    assert got == want


def test_a_rogue_worker_without_the_keys_gets_no_answer_and_is_counted(cluster, keys):
    before = rejected(cluster.metrics, "worker")
    server_key = load_certificate(os.path.join(keys, "server.key"))[0]
    rogues = []
    for own_keypair in (False, True):  # no CURVE at all; CURVE with a keypair of its own
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if own_keypair:
            security.secure_client(s, None, server_key)
        s.connect(cluster.workers)
        s.send_multipart(encode(Register(rank=1, device="cpu", pid=4242,
                                         data_endpoint="tcp://127.0.0.1:1")))
        s.send_multipart(encode(Heartbeat(rank=1, pid=4242)))
        rogues.append(s)
    until_counted(cluster.metrics, "worker", before + 1)  # both of them
    for s in rogues:
        assert not s.poll(3000)  # heard, a heartbeat of a worker it does not know gets RESET
        s.close()


@pytest.mark.parametrize("command", [
    ["coordinator", "--workers", "2"], ["worker", "--coordinator", "tcp://127.0.0.1:1"]])
def test_siding_coordinator_and_worker_refuse_to_start_without_keys_or_insecure(command):
    done = subprocess.run([sys.executable, "-m", "coordinator", *command], capture_output=True,
                          text=True, timeout=120)
    (line,) = done.stderr.splitlines()
    assert done.returncode != 0 and NEED_KEYS in line and "`siding keys DIR`" in line, line
