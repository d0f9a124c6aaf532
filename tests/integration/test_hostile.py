"""Hostile load on real processes: huge requests in a burst kill and delay no one; one client's
flood does not starve another's request, and a client past its queue bound is refused while
others are served; workers killed again and again come back every time; a process without the
cluster's keys cannot inject into a worker; and when the engine core is killed every waiting
client (sync, async, the CLI) hears of it within seconds."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from helpers.remote import free_port
from helpers.strangers import tokens_around_fake_activations

from coordinator.local_cluster import LocalCluster
from protocol import AsyncClient, Client, RequestError
from protocol.errors import ProtocolError
from protocol.messages import (
    MAX_ID,
    MAX_PRIORITY,
    MAX_TEXT,
    Error,
    MsgType,
)
from protocol.sampling import MAX_STOP_CHARS, SamplingParams
from protocol.wire import VERSION, decode

PROMPT = [72, 101, 108, 108, 111]
BATCH = 8


@pytest.fixture(scope="module")
def cluster(launch):
    return launch("--model", "synthetic:tiny", "--max-batch-seqs", str(BATCH),
                  "--kv-pages", "512", "--max-queued-per-client", "2000")


def test_a_flood_of_1000_requests_does_not_delay_another_clients_request(cluster):
    done: list[float] = []  # when each of the flood's requests ended
    started = threading.Event()

    async def flood() -> None:
        async with AsyncClient(cluster.endpoint, timeout=300) as c:
            async def one() -> None:
                await c.generate(prompt_token_ids=PROMPT, max_tokens=8, ignore_eos=True)
                done.append(time.monotonic())
                if len(done) == 2 * BATCH:
                    started.set()
            await asyncio.gather(*(one() for _ in range(1000)))

    t = threading.Thread(target=lambda: asyncio.run(flood()))
    t.start()
    assert started.wait(120), "the flood did not get going"
    with Client(cluster.endpoint, timeout=600) as c:
        before = len(done)
        r = c.generate(prompt_token_ids=PROMPT, max_tokens=8, ignore_eos=True)
        after = len(done)
    assert len(r.token_ids) == 8
    # The flood's requests that finished meanwhile: those running when it arrived, and the
    # next step's worth. In arrival order it would have waited for about 980 of them.
    assert after - before <= 3 * BATCH, (before, after)
    t.join(600)
    assert len(done) == 1000


def raw_generate(header: dict) -> list[bytes]:
    """A GENERATE as a hostile client sends it: straight to the socket, no client checks."""
    return [VERSION, bytes([MsgType.GENERATE]), msgpack.packb(header, use_bin_type=True)]


def test_long_requests_filling_every_row_make_room_for_another_clients_request(cluster):
    ended: list[float] = []

    async def hog() -> None:
        async with AsyncClient(cluster.endpoint, timeout=300) as c:
            async def one() -> None:
                await c.generate(prompt_token_ids=PROMPT, max_tokens=400, ignore_eos=True)
                ended.append(time.monotonic())
            await asyncio.gather(*(one() for _ in range(BATCH)))

    t = threading.Thread(target=lambda: asyncio.run(hog()))
    t.start()
    with Client(cluster.endpoint, timeout=600) as c:
        while c.status()["requests"]["running"] < BATCH:
            time.sleep(0.05)
        r = c.generate(prompt_token_ids=PROMPT, max_tokens=8, ignore_eos=True)
        lone_end = time.monotonic()
    t.join(600)
    assert len(r.token_ids) == 8 and len(ended) == BATCH
    # The lone request took a row within a step or two, not when the hog's ended: it ended
    # before the first of their some 390 tokens left, however slow the steps.
    assert lone_end < min(ended), (lone_end, min(ended))


def test_a_burst_of_huge_requests_neither_kills_nor_delays_anyone(cluster):
    with Client(cluster.endpoint, timeout=600) as c:
        before = c.status()
        t0 = time.monotonic()
        c.generate(prompt_token_ids=PROMPT, max_tokens=32, ignore_eos=True)
        undisturbed = time.monotonic() - t0

        ctx = zmq.Context.instance()
        hostile = ctx.socket(zmq.DEALER)
        hostile.connect(cluster.endpoint)
        big = "x" * (8 << 20)
        for i in range(4):  # 8 MiB chat messages, then prompts of 1M token ids
            hostile.send_multipart(raw_generate({"request_id": f"chat{i}", "messages": [
                {"role": "user", "content": big}]}))
        for i in range(4):
            hostile.send_multipart(raw_generate({"request_id": f"ids{i}",
                                                 "prompt_token_ids": [1] * (1 << 20)}))
        t0 = time.monotonic()
        r = c.generate(prompt_token_ids=PROMPT, max_tokens=32, ignore_eos=True)
        disturbed = time.monotonic() - t0
        # Tokenized, or even copied about on the frontend's loop, the 32 MiB of text would
        # hold it back for tens of seconds (a megabyte takes the tokenizer 3 s of a core); refused
        # on their length, they cost it milliseconds. The bound is that gap, not the machine's.
        assert len(r.token_ids) == 32 and disturbed < 4 * undisturbed + 5.0, (
            undisturbed, disturbed)
        replies = []
        while hostile.poll(10_000) and len(replies) < 8:
            msg, _ = decode(hostile.recv_multipart())
            if isinstance(msg, Error):
                replies.append(msg.code)
        hostile.close(0)
        assert sorted(replies) == ["invalid_request"] * 4 + ["too_long"] * 4, replies
        after = c.status()
    assert [w["pid"] for w in after["workers"]] == [w["pid"] for w in before["workers"]]
    assert [f["restarts"] for f in after["frontends"]] == [f["restarts"] for f in
                                                           before["frontends"]]


def test_prompts_slow_to_tokenize_do_not_hold_back_another_clients_stream(launch):
    """A megabyte of digits takes the real tokenizer about a second of a core (each digit is a
    token); the frontend does it off its loop, so the loop keeps turning meanwhile: an abort sent
    after the digits is answered before the first of them is refused, and a stream beside them
    runs to its end."""
    real = launch("--workers", "1")
    digits = "".join(random.Random(0).choice("0123456789") for _ in range(MAX_TEXT))
    replies: list[tuple[str, str, str]] = []  # (request id, code, message) as they came

    def read_replies(wait_ms: int) -> None:
        while len(replies) < 4 and hostile.poll(wait_ms):
            msg, _ = decode(hostile.recv_multipart())
            if isinstance(msg, Error):
                replies.append((msg.request_id, msg.code, msg.message))

    tokens = 0
    with Client(real.endpoint, timeout=600) as c:
        hostile = zmq.Context.instance().socket(zmq.DEALER)
        hostile.connect(real.endpoint)
        for _ in c.stream("Once upon a time", max_tokens=48, ignore_eos=True):
            tokens += 1
            if tokens == 4:
                for i in range(3):
                    hostile.send_multipart(raw_generate({"request_id": f"d{i}",
                                                         "prompt": digits}))
                hostile.send_multipart(raw_generate({"request_id": "gone", "prompt": digits}))
                hostile.send_multipart([VERSION, bytes([MsgType.ABORT]),
                                        msgpack.packb({"request_id": "gone"})])
            read_replies(0)
        read_replies(60_000)
        hostile.close(0)
    assert tokens >= 48
    # Tokenized on the loop, the first digits would have kept the abort waiting behind them.
    # The order holds however busy the machine: the abort takes the loop microseconds.
    assert replies[0][:2] == ("gone", "aborted"), replies
    assert sorted((rid, code) for rid, code, _ in replies[1:]) == [
        ("d0", "too_long"), ("d1", "too_long"), ("d2", "too_long")], replies
    assert all("tokens" in message for _, _, message in replies[1:]), replies


def test_a_message_past_the_size_limit_never_reaches_python(cluster):
    with Client(cluster.endpoint, timeout=60) as c:
        hostile = zmq.Context.instance().socket(zmq.DEALER)
        hostile.connect(cluster.endpoint)
        hostile.send_multipart(raw_generate({"request_id": "huge", "prompt": "y" * (20 << 20)}))
        assert not hostile.poll(1000)  # ZeroMQ dropped it (and the connection) unread
        hostile.close(0)
        assert len(c.generate(prompt_token_ids=PROMPT, max_tokens=4).token_ids) == 4


def test_a_client_past_its_queue_bound_is_refused_and_others_are_served(launch):
    small = launch("--model", "synthetic:tiny", "--max-batch-seqs", "2",
                   "--max-queued-per-client", "4")

    async def burst() -> list:
        async with AsyncClient(small.endpoint, timeout=300) as c:
            return await asyncio.gather(*(
                c.generate(prompt_token_ids=PROMPT, max_tokens=64, ignore_eos=True)
                for _ in range(20)), return_exceptions=True)

    outcome: dict = {}
    t = threading.Thread(target=lambda: outcome.update(results=asyncio.run(burst())))
    t.start()
    time.sleep(0.5)
    with Client(small.endpoint, timeout=600) as c:  # another client: its own bound
        assert len(c.generate(prompt_token_ids=PROMPT, max_tokens=4).token_ids) == 4
    t.join(600)
    refused = [e for e in outcome["results"] if isinstance(e, RequestError)]
    assert refused and all(e.code == "overloaded" and "--max-queued-per-client" in e.message
                           for e in refused)
    served = [r for r in outcome["results"] if not isinstance(r, Exception)]
    assert len(served) >= 4 and all(len(r.token_ids) == 64 for r in served)


def test_every_waiting_client_hears_within_seconds_that_the_core_was_killed():
    """A client gives up at its silence timeout (3 s), not at its own timeout (600 s here)."""
    cluster = LocalCluster("--model", "synthetic:tiny", timeout=300)
    cluster.start()
    try:
        errors: dict[str, tuple[str, float]] = {}
        streaming = threading.Barrier(3)

        def sync_client() -> None:
            with Client(cluster.endpoint, timeout=600) as c:
                try:
                    for i, _ in enumerate(c.stream(prompt_token_ids=PROMPT, max_tokens=100_000,
                                                   ignore_eos=True)):
                        if i == 0:
                            streaming.wait()
                except RequestError as e:
                    errors["sync"] = (e.code, time.monotonic())

        def async_client() -> None:
            async def main() -> None:
                async with AsyncClient(cluster.endpoint, timeout=600) as c:
                    first = True
                    try:
                        async for _ in c.stream(prompt_token_ids=PROMPT, max_tokens=100_000,
                                                ignore_eos=True):
                            if first:
                                first = False
                                await asyncio.to_thread(streaming.wait)
                    except RequestError as e:
                        errors["async"] = (e.code, time.monotonic())
            asyncio.run(main())

        threads = [threading.Thread(target=f) for f in (sync_client, async_client)]
        for t in threads:
            t.start()
        cli = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "generate", "--endpoint", cluster.endpoint,
             "--stream", "--max-tokens", "100000", "Hello"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        streaming.wait(60)
        time.sleep(1.0)  # the CLI's request is running too (a random model's text may be empty)
        assert cli.poll() is None
        killed = time.monotonic()
        os.kill(cluster.proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
        _, err = cli.communicate(timeout=30)
        cli_done = time.monotonic()
        for who in ("sync", "async"):
            code, at = errors[who]
            assert code == "unavailable" and at - killed < 60, (who, code, at - killed)
        assert cli.returncode == 1 and "unavailable" in err and cli_done - killed < 60, err
    finally:
        os.killpg(cluster.proc.pid, signal.SIGKILL)
        cluster.proc.wait()


def test_workers_killed_again_and_again_come_back_every_time(launch):
    """Past the restarts that start at once, restarts back off, and requests that meanwhile
    wait longer than --worker-wait fail with worker_failed; the cluster never gives up."""
    cluster = launch("--model", "synthetic:tiny", "--worker-wait", "1.5")
    failed_meanwhile = 0
    with Client(cluster.endpoint, timeout=600) as c:
        for _ in range(5):  # MAX_RESTARTS is 3: the 4th and 5th back off 2 and 4 s
            deadline = time.monotonic() + 120
            while not (w := c.status()["workers"]) or not w[0]["alive"]:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            os.kill(w[0]["pid"], signal.SIGKILL)
            while True:
                try:
                    r = c.generate(prompt_token_ids=PROMPT, max_tokens=4, ignore_eos=True)
                    break
                except RequestError as e:
                    assert e.code == "worker_failed" and "--worker-wait" not in e.message, e
                    failed_meanwhile += 1
                    assert time.monotonic() < deadline, "the workers did not come back"
            assert len(r.token_ids) == 4
        s = c.status()
    assert s["failed"] is None and s["workers_up"] == 1
    assert failed_meanwhile >= 1  # the backed-off restarts outlasted --worker-wait


def test_fake_activations_from_a_process_without_the_keys_change_nothing_and_are_counted(
        launch):
    """`launch` makes keys for its own worker links: another local process cannot join them."""
    port = free_port()
    split = launch("--model", "synthetic:tiny", "--workers", "2", "--metrics-port", str(port))
    with Client(split.endpoint, timeout=600) as c:
        want, got = tokens_around_fake_activations(c, port + 2, PROMPT)
    assert got == want


def fuzzed_generates(rng: random.Random, n: int) -> list[list[bytes]]:
    """`n` client messages: GENERATEs with fields at, past and around their limits, of wrong
    types, missing or unknown, and some frames that are not messages at all. `max_tokens` at
    its limit is left out: such a request is valid and runs to the context, and a few of them
    hold every row of a step for as long (admission is fair; running sequences are not
    preempted for fairness)."""
    at_limit = {
        "request_id": "r" * MAX_ID, "prompt": "z" * 4096, "n": 64,
        "stop": ["s" * MAX_STOP_CHARS] * 64, "stop_token_ids": list(range(1024)),
        "priority": MAX_PRIORITY, "top_k": 1 << 24, "temperature": 100.0, "top_p": 1.0,
        "seed": (1 << 63) - 1, "messages": [{"role": "user", "content": "c"}] * 4096,
    }
    past_limit = {
        "request_id": "r" * (MAX_ID + 1), "prompt": "z" * (MAX_TEXT + 1),
        "max_tokens": (1 << 24) + 1, "n": 65, "stop": ["s" * (MAX_STOP_CHARS + 1)],
        "stop_token_ids": list(range(1025)), "priority": MAX_PRIORITY + 1, "top_p": 1.5,
        "temperature": -1.0, "seed": 1 << 64,
        "messages": [{"role": "user", "content": "c" * (MAX_TEXT // 2 + 1)}] * 2,
        "prompt_token_ids": [-1, 2],
    }
    odd = [None, -1, 2 ** 70, 1.5, "", "x", b"\x00\xff", [], {}, [[1]], True, float("nan")]
    out = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.05:
            out.append([bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
                        for _ in range(rng.randrange(1, 5))])
            continue
        header: dict = {"request_id": f"fuzz{i}", "prompt": "hi", "max_tokens": 1}
        for _ in range(rng.randrange(1, 4)):
            kind = rng.random()
            if kind < 0.35:
                key = rng.choice(list(at_limit))
                header[key] = at_limit[key]
            elif kind < 0.75:
                key = rng.choice(list(past_limit))
                header[key] = past_limit[key]
            elif kind < 0.9:
                header[rng.choice(list(at_limit))] = rng.choice(odd)
            else:
                header[rng.choice(["sneaky", "prompt", "request_id"])] = rng.choice(odd)
        if "messages" in header or "prompt_token_ids" in header:
            header.pop("prompt", None)
        header["sampling"] = {k: header.pop(k) for k in list(header)
                              if k in SamplingParams.__struct_fields__}
        try:
            out.append(raw_generate(header))
        except (TypeError, ValueError, OverflowError):  # not even msgpack can carry it
            out.append(raw_generate({"request_id": f"fuzz{i}", "prompt": 5}))
    return out


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_10000_fuzzed_messages_crash_nothing_and_legitimate_requests_all_succeed(launch):
    # A bound on the fuzzer's queue: the valid ones among its messages (max_tokens at its
    # limit runs to the context) are real work, and past 16 queued it gets `overloaded`.
    fuzzed = launch("--model", "synthetic:tiny", "--max-batch-seqs", str(BATCH),
                    "--kv-pages", "512", "--max-queued-per-client", "16")
    with Client(fuzzed.endpoint, timeout=600) as c:
        before = c.status()
        for _ in range(20):  # the core's memory once it has served for a while
            c.generate(prompt_token_ids=PROMPT, max_tokens=8)
    core_before = rss_kib(fuzzed.proc.pid)
    (frontend,) = [f["pid"] for f in before["frontends"]]
    frontend_before = rss_kib(frontend)  # where the fuzzed messages are parsed
    messages = fuzzed_generates(random.Random(19), 10_000)
    hostile = zmq.Context.instance().socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.setsockopt(zmq.SNDHWM, 0)
    hostile.connect(fuzzed.endpoint)
    results, errors = [], []

    def legitimate() -> None:
        with Client(fuzzed.endpoint, timeout=600) as c:
            for i in range(20):
                try:
                    results.append(c.generate(prompt_token_ids=PROMPT, max_tokens=8,
                                              ignore_eos=True, seed=i, temperature=0.5))
                except RequestError as e:
                    errors.append(e)
                time.sleep(0.2)

    t = threading.Thread(target=legitimate)
    t.start()
    for frames in messages:
        hostile.send_multipart(frames)
    # Read, as a client must, until no message of ours gets its first answer for 3 s (the
    # valid ones still running send keepalives, which say nothing new).
    heard: set[str] = set()
    anonymous, quiet_since, deadline = 0, time.monotonic(), time.monotonic() + 120
    while time.monotonic() - quiet_since < 3.0:
        assert time.monotonic() < deadline, f"{len(heard) + anonymous} answered so far"
        if not hostile.poll(200):
            continue
        try:
            reply, _ = decode(hostile.recv_multipart())
        except ProtocolError:
            continue
        key = getattr(reply, "request_id", None)
        if key is None or key not in heard:
            quiet_since = time.monotonic()
        if key is None:
            anonymous += 1
        else:
            heard.add(key)
    replies = len(heard) + anonymous
    t.join(600)
    hostile.close()  # its requests that are valid and still run are aborted
    assert replies >= 9000
    assert not errors and len(results) == 20 and all(len(r.token_ids) == 8 for r in results)
    with Client(fuzzed.endpoint, timeout=600) as c:
        deadline = time.monotonic() + 60
        while (s := c.status())["requests"]["running"] + s["requests"]["waiting"]:
            assert time.monotonic() < deadline, s["requests"]
            time.sleep(0.2)
        assert s["pool"]["pages_used"] == 0
    assert [w["pid"] for w in s["workers"]] == [w["pid"] for w in before["workers"]]
    assert [f["restarts"] for f in s["frontends"]] == [f["restarts"] for f in before["frontends"]]
    assert s["dropped"]["client"] > before["dropped"]["client"]  # the frontend saw them...
    assert s["dropped"]["frontend"] == before["dropped"]["frontend"]  # ...the core did not
    assert rss_kib(fuzzed.proc.pid) <= core_before * 1.2, (core_before, rss_kib(
        fuzzed.proc.pid))
    # The frontend parsed the 16 MiB messages: it hands freed heap back (malloc_trim) and ends
    # near 1.5x its start (tokenizer caches), where it held 7.5x without that
    time.sleep(6)  # one trim after the last message
    assert rss_kib(frontend) <= frontend_before * 2, (frontend_before, rss_kib(frontend))
