"""Client and AsyncClient against a scripted ROUTER on a random loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from protocol import AsyncClient, Client, ErrorCode, ProtocolError, RequestError
from protocol.client import Completion
from protocol.messages import (
    Abort,
    ChatMessage,
    Choice,
    Chunk,
    Chunks,
    Error,
    Generate,
    Result,
    Status,
    StatusReply,
    Usage,
)
from protocol.sampling import SamplingParams
from protocol.wire import decode, encode

# message received -> replies: messages, raw frame lists, or a float (seconds to pause)
Script = Callable[[Any], list[Any]]


class FakeServer:
    """A ROUTER that records what it receives and answers each message with `script(msg)`."""

    def __init__(self, script: Script):
        self.script = script
        self.received: queue.Queue = queue.Queue()
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.linger = 0
        self._socket.sndhwm = 0  # a script's flood queues, where a ROUTER would drop it
        self.endpoint = f"tcp://127.0.0.1:{self._socket.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def next(self, timeout: float = 5.0) -> Any:
        return self.received.get(timeout=timeout)

    def nothing_more(self, wait: float = 0.3) -> bool:
        try:
            self.received.get(timeout=wait)
        except queue.Empty:
            return True
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(10):
                continue
            identity, *parts = self._socket.recv_multipart()
            msg, _ = decode(parts)
            self.received.put(msg)
            for reply in self.script(msg):
                if isinstance(reply, float):
                    if self._stop.wait(reply):  # closed: the rest of the script is moot
                        return
                    continue
                frames = reply if isinstance(reply, list) else encode(reply)
                self._socket.send_multipart([identity, *frames])


@pytest.fixture
def serve() -> Iterator[Callable[[Script], FakeServer]]:
    servers: list[FakeServer] = []

    def start(script: Script) -> FakeServer:
        servers.append(FakeServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def keepalive(request_id: str) -> Chunk:
    return Chunk(request_id=request_id)


def result(request_id: str, token_ids: list[int], text: str) -> Result:
    return Result(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        choices=[Choice(0, token_ids, text, "length", 0)],
        usage=Usage(prompt_tokens=3, completion_tokens=len(token_ids)),
    )


def test_generate_returns_the_result_and_ignores_keepalives_and_strangers(serve):
    def script(msg):
        rid = msg.request_id
        return [keepalive(rid), result("someone-else", [9], "x"), keepalive(rid),
                result(rid, [5, 6], "ab")]

    server = serve(script)
    with Client(server.endpoint, timeout=5) as c:
        r = c.generate("Hello", max_tokens=2, stop="\n", seed=7, request_id="r1")
    assert r == Completion(
        request_id="r1",
        choices=[Choice(0, [5, 6], "ab", "length", 0)],
        prompt_token_ids=[1, 2, 3],
        usage={"prompt_tokens": 3, "completion_tokens": 2},
    )
    assert (r.token_ids, r.text, r.finish_reason) == ([5, 6], "ab", "length")
    assert server.next() == Generate(
        request_id="r1", prompt="Hello", sampling=SamplingParams(max_tokens=2, stop=["\n"], seed=7),
        stream=False, batched_chunks=True,
    )
    assert server.nothing_more()  # no Abort for a request that finished


def test_invalid_options_raise_before_anything_is_sent(serve):
    server = serve(lambda msg: [])
    with Client(server.endpoint, timeout=5) as c:
        with pytest.raises(ProtocolError, match="max_tokens"):
            c.generate("Hello", max_tokens=0)
        with pytest.raises(ProtocolError, match="exactly one of prompt"):
            c.generate("Hello", prompt_token_ids=[1])
    assert server.nothing_more()


def test_stream_yields_chunks_in_order_and_ends_on_the_result(serve):
    def script(msg):
        rid = msg.request_id
        return [Chunk(rid, 0, [5], "a"), keepalive(rid), Chunk(rid, 0, [6], "b"),
                Chunk(rid, 0, [], "", "stop"), result(rid, [5, 6], "ab")]

    server = serve(script)
    with Client(server.endpoint, timeout=5) as c:
        chunks = list(c.stream(prompt_token_ids=[1, 2], request_id="s1"))
    assert chunks == [
        Chunk("s1", 0, [5], "a"), Chunk("s1", 0, [6], "b"), Chunk("s1", 0, [], "", "stop"),
    ]
    assert server.next().stream is True
    assert server.nothing_more()


@pytest.mark.parametrize("how", ["close", "garbage_collect"])
def test_stopping_a_stream_early_aborts_it(serve, how):
    server = serve(lambda msg: [Chunk(msg.request_id, 0, [i], str(i)) for i in range(3)]
                   if isinstance(msg, Generate) else [])
    with Client(server.endpoint, timeout=5) as c:
        chunks = c.stream("Once", request_id="s2")
        assert next(chunks) == Chunk("s2", 0, [0], "0")
        if how == "close":
            chunks.close()
        else:
            del chunks
            gc.collect()
        assert isinstance(server.next(), Generate)
        assert server.next() == Abort("s2")


def test_an_open_stream_keeps_its_chunks_while_another_call_runs(serve):
    def script(msg):
        if msg.request_id == "a":
            return [Chunk("a", 0, [1], "1")]
        return [Chunk("a", 0, [2], "2"), result("b", [7], "7"), Chunk("a", 0, [3], "3"),
                result("a", [1, 2, 3], "123")]

    server = serve(script)
    with Client(server.endpoint, timeout=5) as c:
        a = c.stream("A", request_id="a")
        assert next(a) == Chunk("a", 0, [1], "1")
        assert c.generate("B", request_id="b").text == "7"
        assert list(a) == [Chunk("a", 0, [2], "2"), Chunk("a", 0, [3], "3")]


def test_a_chunks_message_reaches_each_stream_it_carries(serve):
    def script(msg):
        if msg.request_id == "a":  # b is not open yet: its chunk is dropped
            return [Chunks([Chunk("a", 0, [1], "1"), Chunk("b", 0, [9], "x")])]
        return [Chunks([Chunk("a", 0, [3], "3", "length"), Chunk("b", 0, [2], "2")]),
                result("a", [1, 3], "13"), Chunk("b", 0, [4], "4", "length"),
                result("b", [2, 4], "24")]

    server = serve(script)
    with Client(server.endpoint, timeout=5) as c:
        a = c.stream("A", request_id="a")
        assert next(a) == Chunk("a", 0, [1], "1")
        b = c.stream("B", request_id="b")
        assert list(b) == [Chunk("b", 0, [2], "2"), Chunk("b", 0, [4], "4", "length")]
        assert list(a) == [Chunk("a", 0, [3], "3", "length")]
    assert server.next().batched_chunks  # the library asks for CHUNKS


def test_chat_sends_messages(serve):
    server = serve(lambda msg: [result(msg.request_id, [4], "Hello!")])
    with Client(server.endpoint, timeout=5) as c:
        assert c.chat([{"role": "user", "content": "Hi"}], max_tokens=4).text == "Hello!"
    sent = server.next()
    assert (sent.messages, sent.prompt, sent.sampling.max_tokens) == (
        [ChatMessage("user", "Hi")], None, 4)


def test_status_returns_the_status_map(serve):
    status = {"workers": [{"rank": 0, "device": "cpu"}], "pool": {"free_pages": 10}}
    server = serve(lambda msg: [StatusReply(status)])
    with Client(server.endpoint, timeout=5) as c:
        assert c.status() == status
    assert server.next() == Status()


def test_an_error_reply_raises_request_error_with_its_code_and_message(serve):
    message = "the prompt needs 9000 tokens; the context holds 8192"
    server = serve(lambda msg: [keepalive(msg.request_id), Error("too_long", message, "e1")])
    with Client(server.endpoint, timeout=5) as c, pytest.raises(RequestError) as e:
        c.generate("x" * 9000, request_id="e1")
    assert (e.value.code, e.value.message, e.value.request_id) == ("too_long", message, "e1")
    server.next()
    assert server.nothing_more()  # the server is done with it: no Abort


def test_an_error_tied_to_no_request_fails_the_waiting_call(serve):
    message = "trailing bytes after the msgpack header"
    server = serve(lambda msg: [Error("invalid_request", message, None)])
    with Client(server.endpoint, timeout=5) as c, pytest.raises(RequestError) as e:
        c.generate("x", request_id="e2")
    assert (e.value.code, e.value.message) == ("invalid_request", message)


def test_no_reply_within_the_timeout_raises_and_aborts(serve):
    server = serve(lambda msg: [])
    with Client(server.endpoint, timeout=0.2) as c, pytest.raises(RequestError) as e:
        c.generate("x", request_id="t1")
    assert e.value.code == ErrorCode.TIMEOUT
    assert e.value.message == (f"no reply from {server.endpoint} within 0.2s (the client's "
                               "timeout; the request was aborted)")
    assert isinstance(server.next(), Generate)
    assert server.next() == Abort("t1")


def test_keepalives_do_not_extend_the_timeout(serve):
    server = serve(lambda msg: [keepalive(msg.request_id), 0.05] * 400)  # 20 s of keepalives
    with Client(server.endpoint, timeout=0.25) as c, pytest.raises(RequestError) as e:
        start = time.monotonic()
        c.generate("x")
    assert time.monotonic() - start < 10
    assert e.value.code == ErrorCode.TIMEOUT


def test_a_malformed_reply_fails_only_the_waiting_call(serve):
    def script(msg):
        if isinstance(msg, Generate):
            return [[b"SIDING/1", b"\x12", b"\x81\xa1x"]]  # a RESULT whose header is truncated
        return [StatusReply({"ok": True})] if isinstance(msg, Status) else []

    server = serve(script)
    with Client(server.endpoint, timeout=5) as c:
        with pytest.raises(RequestError) as e:
            c.generate("x", request_id="g1")
        assert e.value.code == ErrorCode.INVALID_REQUEST
        # msgspec reads the field's name before it finds the value missing
        assert e.value.message == f"malformed reply from {server.endpoint}: unknown field 'x'"
        assert e.value.request_id == "g1"
        assert c.status() == {"ok": True}
    assert [server.next(), server.next()][1] == Abort("g1")


def test_async_client_routes_32_concurrent_requests_answered_out_of_order(serve):
    pending: list[Generate] = []

    def script(msg):
        pending.append(msg)
        if len(pending) < 32:
            return []
        replies = [result(m.request_id, [int(m.prompt)], f"reply to {m.prompt}") for m in pending]
        replies += [keepalive(m.request_id) for m in pending]
        random.Random(0).shuffle(replies)
        return replies

    server = serve(script)

    async def main():
        async with AsyncClient(server.endpoint, timeout=5) as c:
            return await asyncio.gather(*(c.generate(str(i)) for i in range(32)))

    completions = asyncio.run(main())
    assert [(r.token_ids, r.text) for r in completions] == [
        ([i], f"reply to {i}") for i in range(32)
    ]


def test_an_async_stream_gets_its_chunk_while_another_stream_floods_the_socket(serve):
    # A stream's consumer runs as soon as its chunk is read, not once the socket falls quiet:
    # "quiet"'s chunk comes after `ahead` of the flood's, and the flood goes on until "quiet"
    # has its chunk, or `flood` chunks
    ahead, flood, heard, sent = 2_000, 100_000, threading.Event(), []

    def script(msg):
        if isinstance(msg, Generate) and msg.request_id == "flood":
            for i in range(flood):
                if i == ahead:
                    yield Chunk("quiet", 0, [7], "7")
                if heard.is_set():
                    break
                yield Chunk("flood", 0, [i], "")
                sent.append(i)
            yield result("quiet", [7], "7")
            yield result("flood", [], "")

    server = serve(script)

    async def main():
        async with AsyncClient(server.endpoint, timeout=60) as c:
            async def quiet():
                async for chunk in c.stream("q", request_id="quiet"):
                    heard.set()
                    return chunk.token_ids

            first = asyncio.create_task(quiet())
            await asyncio.sleep(0.1)  # "quiet" sent (the server answers it within "flood")
            chunks = 0
            async for _ in c.stream("f", request_id="flood"):
                chunks += 1
            return await first, chunks

    tokens, chunks = asyncio.run(main())
    assert tokens == [7]
    assert len(sent) < flood, "the quiet stream's consumer ran only once the flood had ended"
    assert chunks == len(sent)


def test_async_stream_status_and_early_close(serve):
    def script(msg):
        if isinstance(msg, Status):
            return [StatusReply({"workers": 1})]
        if isinstance(msg, Abort):
            return []
        rid = msg.request_id
        chunks = [Chunk(rid, 0, [i], str(i)) for i in range(3)]
        return chunks + [result(rid, [0, 1, 2], "012")] if rid == "full" else chunks

    server = serve(script)

    async def main():
        async with AsyncClient(server.endpoint, timeout=5) as c:
            full = [chunk.text async for chunk in c.stream("x", request_id="full")]
            status = await c.status()
            async with contextlib.aclosing(c.stream("x", request_id="early")) as chunks:
                first = await anext(chunks)
            return full, status, first

    full, status, first = asyncio.run(main())
    assert (full, status, first) == (["0", "1", "2"], {"workers": 1}, Chunk("early", 0, [0], "0"))
    sent = [server.next() for _ in range(4)]
    assert sent[3] == Abort("early")


def test_async_error_and_timeout(serve):
    def script(msg):
        if isinstance(msg, Generate) and msg.prompt == "bad":
            return [Error("unsupported", "n > 1 needs temperature > 0", msg.request_id)]
        return []

    server = serve(script)

    async def main():
        async with AsyncClient(server.endpoint, timeout=0.2) as c:
            return await asyncio.gather(
                c.generate("bad", n=2), c.generate("silent", request_id="quiet"),
                return_exceptions=True,
            )

    bad, silent = asyncio.run(main())
    assert (bad.code, bad.message) == ("unsupported", "n > 1 needs temperature > 0")
    assert (silent.code, silent.message, silent.request_id) == (
        "timeout", f"no reply from {server.endpoint} within 0.2s (the client's timeout; the "
        "request was aborted)", "quiet"
    )
    sent = [server.next() for _ in range(3)]
    assert sent.count(Abort("quiet")) == 1


def test_cancelling_an_async_call_aborts_its_request(serve):
    server = serve(lambda msg: [])

    async def main():
        async with AsyncClient(server.endpoint, timeout=5) as c:
            task = asyncio.create_task(c.generate("x", request_id="cancelled"))
            assert isinstance(await asyncio.to_thread(server.next), Generate)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert server.next() == Abort("cancelled")


def test_a_silent_server_fails_the_wait_at_once_not_at_its_timeout(serve):
    server = serve(lambda msg: [])  # takes the request, then says nothing, not even keepalives
    with Client(server.endpoint, timeout=60, silence_timeout=0.5) as c:
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            c.generate("x", request_id="lost")
    assert time.monotonic() - t0 < 20  # its silence timeout (0.5 s), not its timeout (60 s)
    assert e.value.code == "unavailable" and "nothing heard" in e.value.message
    assert "is a cluster running? Start one with `siding launch`" in e.value.message
    assert e.value.request_id == "lost"


def test_keepalives_keep_a_long_wait_alive(serve):
    def script(msg):
        if not isinstance(msg, Generate):
            return []
        beats = [step for _ in range(6) for step in (0.2, Chunk(msg.request_id))]
        return [*beats, Result(msg.request_id, [1], [Choice(0, [5], "a", "stop", 0)], Usage())]

    server = serve(script)
    with Client(server.endpoint, timeout=60, silence_timeout=0.5) as c:
        assert c.generate("x").text == "a"  # 1.2 s, twice the silence allowed, but never silent


def test_a_silent_server_fails_every_async_wait(serve):
    server = serve(lambda msg: [])

    async def main():
        async with AsyncClient(server.endpoint, timeout=60, silence_timeout=0.5) as c:
            return await asyncio.gather(c.generate("a"), c.generate("b"),
                                        return_exceptions=True)

    t0 = time.monotonic()
    errors = asyncio.run(main())
    assert time.monotonic() - t0 < 20  # their silence timeout (0.5 s), not their timeout (60 s)
    assert all(isinstance(e, RequestError) and "nothing heard" in e.message for e in errors)


def test_a_list_of_endpoints_spreads_clients_over_them(serve):
    servers = [serve(lambda msg, i=i: [StatusReply({"n": i})]) for i in range(2)]
    endpoints = ",".join(s.endpoint for s in servers)
    seen = []
    for _ in range(4):
        with Client(endpoints, timeout=5) as c:
            seen.append(c.status()["n"])
    assert sorted(seen) == [0, 0, 1, 1]


def test_get_within_returns_what_is_queued_or_gives_up_at_its_deadline():
    from protocol.async_client import get_within

    async def run() -> tuple:
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait("ready")
        first = await get_within(q, 0)  # already there: no wait at all
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await get_within(q, 0.05)
        waited = time.monotonic() - started
        asyncio.get_running_loop().call_later(0.05, q.put_nowait, "later")
        return first, waited, await get_within(q, None), q.empty()

    first, waited, later, empty = asyncio.run(run())
    assert (first, later, empty) == ("ready", "later", True)
    assert 0.04 <= waited < 10
