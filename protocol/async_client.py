"""The asyncio client: many requests in flight on one socket, replies routed by request id."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from .client import (
    DEFAULT_ENDPOINT,
    SILENCE_SECONDS,
    ClientBase,
    Completion,
    StreamChunk,
    build_generate,
    completion,
)
from .errors import ErrorCode, ProtocolError, RequestError
from .messages import Abort, Chunk, Generate, Result, Status
from .wire import decode, encode

_timeout = getattr(asyncio, "timeout", None)  # Python 3.11 on


async def get_within(queue: asyncio.Queue, seconds: float | None) -> Any:
    """`queue.get()`, given up with asyncio.TimeoutError after `seconds` (None: never). A
    stream waits so once a token: with `asyncio.timeout` (Python 3.11 on) rather than
    `wait_for`, which makes a task a call, a wait costs 9 us instead of 14 on the 2-core VM,
    and nothing when an item is already there."""
    if not queue.empty():
        return queue.get_nowait()
    if _timeout is None:
        return await asyncio.wait_for(queue.get(), seconds)
    async with _timeout(seconds):
        return await queue.get()


class AsyncClient(ClientBase):
    """`Client`'s methods as coroutines, safe to call concurrently from tasks of one loop.

    One reader task receives every reply and queues it for the request it belongs to. Status
    replies carry no request id, so status calls run one at a time.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 600.0,
        silence_timeout: float | None = SILENCE_SECONDS,
        curve_server_key: bytes | None = None,
        curve_keys_dir: str | None = None,
        context: zmq.asyncio.Context | None = None,
    ):
        super().__init__(
            context or zmq.asyncio.Context.instance(), asyncio.Queue, endpoint, timeout,
            curve_server_key, curve_keys_dir, silence_timeout,
        )
        self._status_lock = asyncio.Lock()
        self._reader: asyncio.Task | None = None

    async def generate(self, prompt: str | None = None, **options: Any) -> Completion:
        msg = build_generate(prompt, **options)
        async with self._request(msg):
            reply = await self._next(msg.request_id)
            while isinstance(reply, Chunk):  # a non-streaming request's chunks say nothing new
                reply = await self._next(msg.request_id)
        return completion(reply)

    def stream(self, prompt: str | None = None, **options: Any) -> AsyncIterator[StreamChunk]:
        """Chunks as they come, until the Result; closing the iterator early aborts the request."""
        return self._stream(build_generate(prompt, stream=True, **options))

    async def replies(self, msg: Generate) -> AsyncIterator[Chunk | Result]:
        """Every reply to a request built with `build_generate`: its chunks (a streaming
        request's), then its Result. Closing the iterator before the Result aborts it."""
        async with self._request(msg):
            while True:
                reply = await self._next(msg.request_id)
                yield reply
                if isinstance(reply, Result):
                    return

    async def chat(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        return await self.generate(messages=messages, **options)

    def chat_stream(
        self, messages: list[dict[str, str]], **options: Any
    ) -> AsyncIterator[StreamChunk]:
        return self.stream(messages=messages, **options)

    async def abort(self, request_id: str) -> None:
        """As `Client.abort`."""
        if self._replies.waiting(request_id):
            await self._send(Abort(request_id))
            return
        try:
            async with self._request(Abort(request_id)):
                await self._next(request_id)
        except RequestError as e:
            if e.code != ErrorCode.ABORTED.value:
                raise

    async def status(self) -> dict:
        async with self._status_lock, self._request(Status()):
            return (await self._next(None)).status

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._replies.fail_all(ErrorCode.INTERNAL, "the client was closed")
        self._close_sockets()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _stream(self, msg: Generate) -> AsyncIterator[StreamChunk]:
        async with self._request(msg):
            while isinstance(reply := await self._next(msg.request_id), Chunk):
                yield reply

    @contextlib.asynccontextmanager
    async def _request(self, msg: Any) -> AsyncIterator[None]:
        key = getattr(msg, "request_id", None)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        self._replies.open(key)
        try:
            await self._send(msg)
            yield
        finally:
            self._finish(key)

    async def _send(self, msg: Any) -> None:
        self._send_aborts()
        try:
            await self._socket.send_multipart(encode(msg))
        except zmq.Again:
            raise self._unsent(getattr(msg, "request_id", None)) from None

    async def _next(self, key: str | None) -> Any:
        pending = self._replies.queue(key)
        started = time.monotonic()
        while True:
            deadline, gone = self._wait_limits(started)
            ends = [t for t in (deadline, gone) if t is not None]
            left = max(0.0, min(ends) - time.monotonic()) if ends else None
            try:
                reply = await get_within(pending, left)
            except asyncio.TimeoutError:
                deadline, gone = self._wait_limits(started)  # others' replies count as heard
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._no_reply(key) from None
                if gone is not None and time.monotonic() >= gone:
                    raise self._silent(key) from None
                continue
            return self._replies.take(key, reply)

    async def _read(self) -> None:
        while True:
            try:
                parts = await self._socket.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                self._replies.fail_all(ErrorCode.INTERNAL, f"lost {self.endpoint}: {e}")
                return
            self._last_heard = time.monotonic()
            try:
                msg, _ = decode(parts)
            except ProtocolError as e:  # no way to tell whose it was: fail every waiting call
                self._replies.fail_all(ErrorCode.INVALID_REQUEST, self._malformed(e))
                continue
            self._replies.deliver(msg)
            self._send_aborts()
            # pyzmq resolves a recv at once while messages wait, so without this the reader
            # would keep the loop until the socket fell quiet, every stream's consumer waiting
            # (at 32 busy streams on an H200, most tokens reached their consumer at the end)
            await asyncio.sleep(0)
