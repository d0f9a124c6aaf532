"""The synchronous client, and what it shares with the asyncio one (`ClientBase`): building a
request from a call's options, sorting replies by the call waiting on them, and turning results
and errors into return values and exceptions.
"""

from __future__ import annotations

import itertools
import queue
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from .errors import ErrorCode, ProtocolError, RequestError, invalid
from .messages import (
    Abort,
    Choice,
    Chunk,
    Chunks,
    Error,
    Generate,
    Result,
    Status,
    StatusReply,
)
from .sampling import SamplingParams, sampling_params
from .security import is_loopback, secure_client
from .wire import MAX_MESSAGE_BYTES, decode, encode, token_ids

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
SILENCE_SECONDS = 3.0  # a server sends keepalives every second; this long without any, it is gone
# A peer that took the connection and then the handshake failed: a CURVE server hangs up on a
# client without keys (NO_DETAIL), or says why (PROTOCOL: mechanism mismatch; AUTH: bad key).
HANDSHAKE_REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

_clients = itertools.count()


def pick_endpoint(endpoint: str) -> str:
    """One endpoint of a comma-separated list (what `siding launch --frontends N` prints): each
    client made in this process takes the next, so many clients spread over the frontends."""
    choices = [e.strip() for e in endpoint.split(",") if e.strip()]
    if not choices:
        raise ValueError(f"no endpoint in {endpoint!r}")
    return choices[next(_clients) % len(choices)]

# The wire types are the public ones: they hold exactly the fields a caller reads, validated.
CompletionChoice = Choice  # index, token_ids, text, finish_reason, preemptions
StreamChunk = Chunk  # request_id, index (of the choice), new token_ids and text, finish_reason


@dataclass
class Completion:
    request_id: str
    choices: list[CompletionChoice]  # by index
    prompt_token_ids: list[int]
    usage: dict[str, int]  # prompt_tokens, completion_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


def build_generate(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    priority: int = 0,
    request_id: str | None = None,
    stream: bool = False,
    user: str | None = None,
    sampling: SamplingParams | None = None,
    **options: Any,
) -> Generate:
    """The Generate message for a call's options, checked as the server checks it.

    Give one of `prompt`, `prompt_token_ids` or `messages` (chat: role/content maps, rendered
    with the model's chat template). `user` names whom the request is for: the server's queue is
    fair between users (by default, between client connections). The sampling options are
    `SamplingParams`' fields (protocol/sampling.py; `stop` may be one string), or `sampling`
    holds them checked already. Bad options raise ProtocolError (`invalid_request`) before
    anything is sent.
    """
    if sampling is None:
        sampling = sampling_params(**options)
    elif options:
        raise TypeError(f"give `sampling` or its fields ({', '.join(options)}), not both")
    ids = None if prompt_token_ids is None else token_ids(prompt_token_ids)
    header = {
        "request_id": uuid.uuid4().hex if request_id is None else request_id,
        "prompt": prompt,
        "prompt_token_ids": None,  # `ids`, set below: a list would be checked id by id
        "messages": None if messages is None else list(messages),
        "sampling": sampling,
        "priority": priority,
        "stream": stream,
        "user": user,
        "batched_chunks": True,  # Replies.deliver reads CHUNKS
    }
    try:
        msg = msgspec.convert(header, Generate)
    except msgspec.ValidationError as e:
        raise invalid(e, "Generate") from None
    msg.prompt_token_ids = ids
    msg.check()
    return msg


def completion(result: Result) -> Completion:
    return Completion(
        request_id=result.request_id,
        choices=sorted(result.choices, key=lambda c: c.index),
        prompt_token_ids=result.prompt_token_ids,
        usage=msgspec.structs.asdict(result.usage),
    )


class Replies:
    """Replies from the server, queued per waiting call: a request id, or None for status.

    Replies to requests no call waits on (finished, given up) are dropped.
    """

    def __init__(self, new_queue: Callable[[], Any]):  # queue.SimpleQueue or asyncio.Queue
        self._new_queue = new_queue
        self._queues: dict[str | None, Any] = {}

    def open(self, key: str | None) -> None:
        if key in self._queues:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, f"request {key!r} is already in flight", key
            )
        self._queues[key] = self._new_queue()

    def queue(self, key: str | None) -> Any:
        return self._queues[key]

    def waiting(self, key: str | None) -> bool:
        return key in self._queues

    def close(self, key: str | None) -> bool:
        """Forget `key`; True if the server may still be working on it."""
        return self._queues.pop(key, None) is not None

    def deliver(self, msg: Any) -> None:
        if isinstance(msg, Chunks):
            for chunk in msg.chunks:
                self._put(chunk.request_id, chunk)
            return
        if isinstance(msg, Chunk) and not (msg.token_ids or msg.text or msg.finish_reason):
            return  # a keepalive, which non-streaming requests get too
        if isinstance(msg, Error) and msg.request_id is None:
            self.fail_all(msg.code, msg.message)  # the server could not read a message of ours
        elif isinstance(msg, StatusReply):
            self._put(None, msg)
        elif isinstance(msg, (Chunk, Result, Error)):
            self._put(msg.request_id, msg)

    def fail_all(self, code: str, message: str) -> None:
        for key, q in self._queues.items():
            q.put_nowait(RequestError(code, message, key))

    def take(self, key: str | None, reply: Any) -> Chunk | Result | StatusReply:
        """Hand a queued reply to its call: errors raise, and a final reply closes the request."""
        if isinstance(reply, RequestError):
            raise reply
        if isinstance(reply, (Result, StatusReply, Error)):
            self.close(key)
        if isinstance(reply, Error):
            raise RequestError(reply.code, reply.message, key)
        return reply

    def _put(self, key: str | None, msg: Any) -> None:
        q = self._queues.get(key)
        if q is not None:
            q.put_nowait(msg)


class ClientBase:
    """One DEALER socket to the coordinator and the replies waiting on it."""

    def __init__(
        self,
        context: zmq.Context,
        new_queue: Callable[[], Any],
        endpoint: str,
        timeout: float | None,
        curve_server_key: bytes | None,
        curve_keys_dir: str | None,
        silence_timeout: float | None = SILENCE_SECONDS,
    ):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
        self.endpoint = pick_endpoint(endpoint)
        endpoint = self.endpoint
        self.timeout = timeout
        self.silence_timeout = silence_timeout
        self._last_heard = 0.0  # time.monotonic() of the server's last message
        self._replies = Replies(new_queue)
        self._keyed = curve_keys_dir is not None or curve_server_key is not None
        socket = context.socket(zmq.DEALER)
        socket.linger = 0
        # where a refused handshake (CURVE on one side only, keys the server does not take)
        # is heard of
        monitor = socket.get_monitor_socket(HANDSHAKE_REFUSED)
        try:
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            # A send blocks while no peer takes it (nothing listening, or a refused CURVE
            # handshake): no longer than the server is given to say anything at all.
            limits = [t for t in (timeout, silence_timeout) if t is not None]
            if limits:
                socket.sndtimeo = max(1, round(min(limits) * 1000))  # ms
            if curve_keys_dir is not None or curve_server_key is not None:
                secure_client(socket, curve_keys_dir, curve_server_key)
            socket.connect(endpoint)
        except (ValueError, zmq.ZMQError):
            monitor.close()
            socket.close()
            raise
        self._socket = socket
        self._monitor = monitor
        # A blocking-API view of the same socket, for aborts sent from `finally` blocks (also of
        # a cancelled task), which must neither await nor block.
        self._plain_socket = zmq.Socket.shadow(socket.underlying)
        self._aborts: deque[str] = deque()  # request ids whose Abort the socket did not take

    def _no_reply(self, key: str | None) -> RequestError:
        if refused := self._refused(key):
            return refused
        return RequestError(
            ErrorCode.TIMEOUT, f"no reply from {self.endpoint} within {self.timeout:g}s (the "
            "client's timeout; the request was aborted)", key
        )

    def _unsent(self, key: str | None) -> RequestError:
        """A send that no peer took within the socket's send timeout."""
        if self.silence_timeout is not None and (
                self.timeout is None or self.silence_timeout <= self.timeout):
            return self._silent(key)
        return self._no_reply(key)

    def _refused(self, key: str | None) -> RequestError | None:
        """The error of a client whose handshake the server refused, if it was; a refused
        socket stays silent, as one where nothing listens does."""
        if self._last_heard or not zmq.Socket.shadow(self._monitor.underlying).poll(0):
            return None
        why = ("it may not use CURVE, or not accept this client's keys" if self._keyed else
               "it may require CURVE keys: give --curve-keys DIR (the library's curve_keys_dir), "
               "the cluster's keys")
        return RequestError(ErrorCode.UNAVAILABLE, f"the server at {self.endpoint} took the "
                            f"connection but not this client's handshake: {why}", key)

    def _silent(self, key: str | None) -> RequestError:
        if refused := self._refused(key):
            return refused
        if not self._last_heard:
            keys = "" if self._keyed or is_loopback(self.endpoint) else (
                " (a cluster that uses CURVE keys answers only a client given them: "
                "--curve-keys DIR)")
            return RequestError(
                ErrorCode.UNAVAILABLE, f"no server answers at {self.endpoint} (nothing heard for "
                f"{self.silence_timeout:g}s): is a cluster running? Start one with "
                f"`siding launch`{keys}", key)
        return RequestError(
            ErrorCode.UNAVAILABLE, f"lost the server at {self.endpoint}: nothing heard from it, "
            f"not even a keepalive, for {self.silence_timeout:g}s", key
        )

    def _wait_limits(self, started: float) -> tuple[float | None, float | None]:
        """(deadline for the reply, time the server counts as gone) of a wait begun at
        `started`, as time.monotonic() values; None where there is no limit."""
        deadline = None if self.timeout is None else started + self.timeout
        gone = None
        if self.silence_timeout is not None:
            gone = max(started, self._last_heard) + self.silence_timeout
        return deadline, gone

    def _close_sockets(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

    def _malformed(self, error: ProtocolError) -> str:
        return f"malformed reply from {self.endpoint}: {error.message}"

    def _finish(self, key: str | None) -> None:
        """A call stops waiting on `key`; abort the request if the server may still run it."""
        if not self._replies.close(key) or key is None or self._socket.closed:
            return
        self._aborts.append(key)
        self._send_aborts()

    def _send_aborts(self) -> None:
        """The aborts not sent yet, as far as the socket takes them without waiting: one a full
        socket refuses (a call of thousands of requests refused part-way fills it) is sent with
        the client's next message or after its next reply, never dropped."""
        while self._aborts and not self._socket.closed:
            try:
                self._plain_socket.send_multipart(encode(Abort(self._aborts[0])), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            self._aborts.popleft()


class Client(ClientBase):
    """A blocking client; one call at a time per instance (streams may stay open meanwhile).

    `timeout` bounds every wait for a request's next piece of output: the Result of `generate`,
    each chunk of `stream` (keepalives do not count). Past it the request is aborted and
    RequestError(`timeout`) raised. A server that sends nothing at all, not even the keepalive
    it sends every second, for `silence_timeout` seconds is gone: the wait raises at once.
    `endpoint` may be a comma-separated list (one per frontend); the client takes one of them.
    Options of `generate` and `stream`: see `build_generate`.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 600.0,
        silence_timeout: float | None = SILENCE_SECONDS,
        curve_server_key: bytes | None = None,
        curve_keys_dir: str | None = None,
    ):
        super().__init__(
            zmq.Context.instance(), queue.SimpleQueue, endpoint, timeout, curve_server_key,
            curve_keys_dir, silence_timeout,
        )

    def generate(self, prompt: str | None = None, **options: Any) -> Completion:
        msg = build_generate(prompt, **options)
        with self._request(msg):
            reply = self._next(msg.request_id)
            while isinstance(reply, Chunk):  # a non-streaming request's chunks say nothing new
                reply = self._next(msg.request_id)
        return completion(reply)

    def stream(self, prompt: str | None = None, **options: Any) -> Iterator[StreamChunk]:
        """Chunks as they come, until the Result; closing the iterator early aborts the request.

        Options are checked now; the request is sent when iteration starts.
        """
        return self._stream(build_generate(prompt, stream=True, **options))

    def chat(self, messages: list[dict[str, str]], **options: Any) -> Completion:
        return self.generate(messages=messages, **options)

    def chat_stream(self, messages: list[dict[str, str]], **options: Any) -> Iterator[StreamChunk]:
        return self.stream(messages=messages, **options)

    def abort(self, request_id: str) -> None:
        """Abort a request: the call waiting on it raises `aborted`. For an id no call of this
        client waits on, the server's answer is awaited: `invalid_request` if it is not a
        running request of this client's (a client may abort only its own)."""
        if self._replies.waiting(request_id):
            self._send(Abort(request_id))
            return
        try:
            with self._request(Abort(request_id)):
                self._next(request_id)
        except RequestError as e:
            if e.code != ErrorCode.ABORTED.value:
                raise

    def status(self) -> dict:
        with self._request(Status()):
            return self._next(None).status

    def close(self) -> None:
        self._close_sockets()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stream(self, msg: Generate) -> Iterator[StreamChunk]:
        with self._request(msg):
            while isinstance(reply := self._next(msg.request_id), Chunk):
                yield reply

    @contextmanager
    def _request(self, msg: Any) -> Iterator[None]:
        key = getattr(msg, "request_id", None)
        self._replies.open(key)
        try:
            self._send(msg)
            yield
        finally:
            self._finish(key)

    def _send(self, msg: Any) -> None:
        self._send_aborts()
        try:
            self._socket.send_multipart(encode(msg))
        except zmq.Again:
            raise self._unsent(getattr(msg, "request_id", None)) from None

    def _next(self, key: str | None) -> Any:
        pending = self._replies.queue(key)
        started = time.monotonic()
        while pending.empty():
            deadline, gone = self._wait_limits(started)
            ends = [t for t in (deadline, gone) if t is not None]
            left = max(0.0, min(ends) - time.monotonic()) if ends else None
            if not self._socket.poll(None if left is None else round(left * 1000)):  # ms
                deadline, gone = self._wait_limits(started)  # others' replies count as heard
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._no_reply(key)
                if gone is not None and time.monotonic() >= gone:
                    raise self._silent(key)
                continue
            try:
                msg, _ = decode(self._socket.recv_multipart(copy=False))
            except ProtocolError as e:
                raise RequestError(ErrorCode.INVALID_REQUEST, self._malformed(e), key) from None
            self._last_heard = time.monotonic()
            self._replies.deliver(msg)
            self._send_aborts()
        return self._replies.take(key, pending.get_nowait())
