"""A full pool parks sequences to the host and restores them; it never fails a request."""

import threading
import time

import pytest
import zmq

from protocol import Client, RequestError
from protocol.messages import Generate
from protocol.sampling import SamplingParams
from protocol.wire import encode

PROMPTS = [f"Write a long story about a {animal}." for animal in
           ("cat", "dog", "horse", "whale", "fox", "owl", "bear", "crab")]


@pytest.fixture(scope="module")
def cluster(launch):
    # 8 sequences of ~10 prompt + 48 generated tokens need 8 x 15 = 120 pages of 4; the pool
    # holds 30, a quarter of the offered load
    return launch("--model", "smollm2-135m", "--workers", "2", "--kv-pages", "30",
                  "--page-size", "4", "--park-pages", "120")


def status(endpoint):
    with Client(endpoint, timeout=30) as c:
        return c.status()


def test_four_times_the_pool_completes_with_parks_and_no_leaks(cluster):
    results, errors = {}, []

    def run(i):
        try:
            with Client(cluster.endpoint, timeout=300) as c:
                results[i] = c.generate(PROMPTS[i], max_tokens=48, ignore_eos=True)
        except RequestError as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert errors == []
    assert sorted(results) == list(range(len(PROMPTS)))
    assert all(len(r.token_ids) == 48 for r in results.values())
    assert sum(r.choices[0].preemptions for r in results.values()) > 0
    assert drained(cluster.endpoint)


def test_park_and_restore_never_change_a_sequence(cluster, launch):
    with Client(cluster.endpoint, timeout=600) as c:
        plain = c.generate(PROMPTS[0], max_tokens=24, ignore_eos=True)
    churn = launch("--model", "smollm2-135m", "--workers", "2", "--preempt-every", "3")
    with Client(churn.endpoint, timeout=600) as c:
        parked = c.generate(PROMPTS[0], max_tokens=24, ignore_eos=True)
        sampled = [c.generate(PROMPTS[1], max_tokens=16, temperature=1.0, seed=5,
                              ignore_eos=True) for _ in range(2)]
    assert parked.choices[0].preemptions >= 6
    assert parked.token_ids == plain.token_ids
    with Client(cluster.endpoint, timeout=600) as c:
        reference = c.generate(PROMPTS[1], max_tokens=16, temperature=1.0, seed=5,
                               ignore_eos=True)
    assert [r.token_ids for r in sampled] == [reference.token_ids] * 2


def wait_until(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def drained(endpoint) -> bool:
    s = status(endpoint)
    return (s["pool"]["pages_used"] == 0 and s["park"]["slots_used"] == 0
            and s["requests"] == {"running": 0, "waiting": 0, "parked": 0})


def test_aborting_parked_requests_frees_pages_and_park_slots(cluster):
    clients = [Client(cluster.endpoint, timeout=600) for _ in range(6)]
    streams = [c.stream(PROMPTS[i], max_tokens=100, ignore_eos=True)
               for i, c in enumerate(clients)]
    for st in streams:
        next(st)  # every request is admitted and producing tokens
    assert wait_until(lambda: status(cluster.endpoint)["requests"]["parked"] > 0)
    for st, c in zip(streams, clients):
        st.close()  # sends Abort, whether the sequence is parked or running
        c.close()
    assert wait_until(lambda: drained(cluster.endpoint), timeout=30)


def test_a_client_vanishing_while_parked_frees_everything(cluster):
    socks = []
    for i in range(6):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cluster.endpoint)
        sock.send_multipart(encode(Generate(
            request_id=f"r{i}", prompt=PROMPTS[i],
            sampling=SamplingParams(max_tokens=100, ignore_eos=True), stream=True)))
        socks.append(sock)
    assert wait_until(lambda: status(cluster.endpoint)["requests"]["parked"] > 0)
    for sock in socks:
        sock.close()
    assert wait_until(lambda: drained(cluster.endpoint), timeout=30)
    with Client(cluster.endpoint, timeout=600) as c:
        assert len(c.generate(PROMPTS[0], max_tokens=8, ignore_eos=True).token_ids) == 8
