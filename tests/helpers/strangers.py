"""What a local process without a cluster's keys can try on its worker links, and what the
cluster counts of the peers it refused."""

from __future__ import annotations

import time
import urllib.request

import zmq
from prometheus_client.parser import text_string_to_metric_families

from protocol import Client
from protocol.messages import Activations
from protocol.wire import encode


def push_fake_activations(endpoint: str, steps: int) -> zmq.Socket:
    """Send what the stage before a worker would for steps 0 to `steps` - 1, a row of zeros
    each (synthetic:tiny's hidden size, float32); returns the PUSH, still sending (close it).
    A worker that refuses the PUSH drops the connection and what it queued: the rest go on a
    connection made again, as a stranger bent on it would."""
    push = None
    deadline = time.monotonic() + 60
    for step in range(steps):
        frames = encode(Activations(step=step, dtype="float32", shape=[1, 64]), [bytes(256)])
        while True:
            if push is None:
                push = zmq.Context.instance().socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.setsockopt(zmq.SNDHWM, 0)
                push.connect(endpoint)
            try:
                push.send_multipart(frames, zmq.NOBLOCK)
                break
            except zmq.Again:  # the connection was dropped
                push.close()
                push = None
                assert time.monotonic() < deadline, "no connection took the activations"
    return push


def rejected(metrics_port: int, socket: str) -> float:
    """siding_rejected_connections_total{socket} of the process serving metrics on loopback at
    `metrics_port`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    return sum(s.value for family in text_string_to_metric_families(text.decode())
               for s in family.samples
               if s.name == "siding_rejected_connections_total" and s.labels["socket"] == socket)


def until_counted(metrics_port: int, socket: str, above: float) -> float:
    """Wait (a minute at most) for the count of refused `socket` peers to pass `above`."""
    deadline = time.monotonic() + 60
    while (n := rejected(metrics_port, socket)) <= above:
        assert time.monotonic() < deadline, f"no refused {socket} peer counted"
        time.sleep(0.2)
    return n


def tokens_around_fake_activations(c: Client, worker1_metrics_port: int,
                                   prompt: list[int]) -> tuple[list[int], list[int]]:
    """A greedy request's tokens before, and after 400 fake activations pushed at worker 1
    (for the steps run so far and those to come) were refused and counted."""
    want = c.generate(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True).token_ids
    before = rejected(worker1_metrics_port, "activations")
    push = push_fake_activations(c.status()["workers"][1]["data_endpoint"], 400)
    until_counted(worker1_metrics_port, "activations", before)
    got = c.generate(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True).token_ids
    push.close()
    return want, got
