"""32 concurrent streaming clients, and clients that vanish mid-stream."""

import threading
import time

import pytest
import zmq

from protocol import Client, RequestError
from protocol.messages import Chunk, Chunks, Error, Generate
from protocol.sampling import SamplingParams
from protocol.wire import decode, encode

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):",
           "The three primary colors are", "My favourite food is", "Water boils at",
           "In 1492,", "The quick brown fox"]


@pytest.fixture(scope="module")
def cluster(launch):
    return launch("--model", "smollm2-135m", "--workers", "2", "--kv-pages", "256")


def pages_used(endpoint: str) -> int:
    with Client(endpoint, timeout=30) as c:
        return c.status()["pool"]["pages_used"]


def wait_for_pages(endpoint: str, expected: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (used := pages_used(endpoint)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


def test_32_concurrent_streaming_clients_all_complete(cluster):
    with Client(cluster.endpoint, timeout=600) as c:
        solo = {p: c.generate(p, max_tokens=12, ignore_eos=True).token_ids for p in PROMPTS}
    results, errors = {}, []

    def client(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            with Client(cluster.endpoint, timeout=600) as c:
                chunks = list(c.stream(prompt, max_tokens=12, ignore_eos=True))
            results[i] = (prompt, chunks)
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert errors == []
    assert len(results) == 32
    for prompt, chunks in results.values():
        ids = [t for ch in chunks for t in ch.token_ids]
        assert chunks[-1].finish_reason == "length"
        assert all(ch.finish_reason is None for ch in chunks[:-1])
        assert ids == solo[prompt]
    assert wait_for_pages(cluster.endpoint, 0) == 0


def test_one_connections_streams_share_a_chunks_message_only_if_they_ask(cluster):
    """Eight streams on one socket, half asking for CHUNKS: each step's chunks of those come in
    one message, the others' one by one, and both give the same ids and text as the result."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.endpoint)
    batched = {f"b{i}" for i in range(4)}
    for i in range(4):
        for rid in (f"b{i}", f"u{i}"):
            sock.send_multipart(encode(Generate(
                request_id=rid, prompt=PROMPTS[i], stream=True, batched_chunks=rid in batched,
                sampling=SamplingParams(max_tokens=12, ignore_eos=True, stop=["."]))))
    streamed = {rid: ([], "") for i in range(4) for rid in (f"b{i}", f"u{i}")}
    results, shared = {}, []
    while len(results) < 8:
        assert sock.poll(60_000), "a reply is missing"
        msg, _ = decode(sock.recv_multipart())
        assert not isinstance(msg, Error), msg
        if isinstance(msg, Chunks):
            assert {c.request_id for c in msg.chunks} <= batched
            shared.append(len({c.request_id for c in msg.chunks}))
        for c in msg.chunks if isinstance(msg, Chunks) else [msg]:
            if isinstance(c, Chunk):
                assert c.request_id not in results, "a chunk after its result"
                ids, text = streamed[c.request_id]
                streamed[c.request_id] = (ids + c.token_ids, text + c.text)
            else:
                results[c.request_id] = c
    sock.close()
    assert max(shared) > 1  # the batched streams' steps came together
    for rid, r in results.items():
        assert streamed[rid] == (r.choices[0].token_ids, r.choices[0].text)
    for i in range(4):
        assert results[f"b{i}"].choices == results[f"u{i}"].choices


def test_client_that_disconnects_mid_stream_frees_its_pages(cluster):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.endpoint)
    sock.send_multipart(encode(Generate(
        request_id="gone", prompt="Tell me a long story.", stream=True,
        sampling=SamplingParams(max_tokens=2000, ignore_eos=True))))
    assert sock.poll(60_000), "no chunk arrived"
    sock.recv_multipart()
    assert pages_used(cluster.endpoint) > 0
    sock.close()
    assert wait_for_pages(cluster.endpoint, 0) == 0
    with Client(cluster.endpoint, timeout=60) as c:  # and everyone else is still served
        assert "Paris" in c.generate("The capital of France is", max_tokens=8).text


def test_abort_mid_stream_ends_the_request_and_frees_pages(cluster):
    with Client(cluster.endpoint, timeout=60) as c:
        stream = c.stream("Count to one thousand:", max_tokens=2000, ignore_eos=True)
        first = next(stream)
        assert first.token_ids
        stream.close()  # sends an Abort
        assert wait_for_pages(cluster.endpoint, 0) == 0


def test_only_the_client_that_sent_a_request_may_abort_it(cluster):
    with Client(cluster.endpoint, timeout=60) as owner, Client(cluster.endpoint,
                                                               timeout=60) as other:
        stream = owner.stream("Count to ten:", max_tokens=24, ignore_eos=True,
                              request_id="mine")
        first = next(stream)
        with pytest.raises(RequestError) as e:
            other.abort("mine")
        assert e.value.code == "invalid_request" and "aborts only its own" in e.value.message
        tokens = len(first.token_ids) + sum(len(c.token_ids) for c in stream)
        assert tokens == 24  # untouched by the other's abort
        # the owner's own abort of a request it no longer waits on is answered the same way
        with pytest.raises(RequestError):
            owner.abort("mine")
        streaming = owner.stream("Count to ten:", max_tokens=2000, ignore_eos=True,
                                 request_id="again")
        next(streaming)
        owner.abort("again")  # its own, waited on: the stream ends with `aborted`
        with pytest.raises(RequestError) as e:
            list(streaming)
        assert e.value.code == "aborted"
