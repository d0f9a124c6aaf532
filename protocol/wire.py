"""Frame codec: `[b"SIDING/1", type (1 byte), header (msgpack map), *raw frames]`.

A header is decoded by msgspec straight into its type's Struct (`messages.py`), each field
checked against its type and bounds as it is read, in C; nothing else can come of it. Nothing on
any socket is unpickled.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import msgspec
import zmq

from .errors import ProtocolError, invalid
from .messages import FRAMES, MAX_LIST, MAX_TOKENS_LIST, MESSAGES, Generate, MsgType, Step
from .step_frames import FRAMES as STEP_FRAMES
from .step_frames import StepHeader, decode_step, encode_step

VERSION = b"SIDING/1"
MAX_HEADER_BYTES = 64 << 20  # a READY carries the tokenizer; everything else is far smaller
MAX_MESSAGE_BYTES = 1 << 30  # socket MAXMSGSIZE: activations of a large prefill fit
# A frontend's client socket: ZeroMQ drops a client that sends more, before Python sees it. The
# largest valid request (a prompt of 1 Mi characters or ids, or chats of as much) is far under.
MAX_CLIENT_MESSAGE_BYTES = 16 << 20


_pack = msgspec.msgpack.Encoder().encode
# a header's decoder by type byte: a STEP's header is its rare parts (step_frames.py)
_DECODERS = {kind: msgspec.msgpack.Decoder(StepHeader if kind is MsgType.STEP else cls)
             for kind, cls in MESSAGES.items()}


def encode(msg: Any, frames: Sequence[bytes | memoryview] = ()) -> list[bytes | memoryview]:
    """A message's frames; `frames`: its raw frames (a STEP and a GENERATE of token ids make
    their own)."""
    if type(msg) is Step:
        header, frames = encode_step(msg)
    elif type(msg) is Generate and (frame := prompt_frame(msg.prompt_token_ids)) is not None:
        header, frames = msgspec.structs.replace(msg, prompt_token_ids=None), [frame]
    else:
        header = msg
    return message(msg.TYPE, header, frames)


def message(kind: MsgType, header: Any, frames: Sequence[bytes | memoryview | array] = ()
            ) -> list[bytes | memoryview]:
    """The frames of a message of type `kind` from its header (a Struct, or a map of one's
    fields) and raw frames."""
    return [VERSION, bytes([kind]), _pack(header), *frames]


def token_ids(ids: Sequence[int]) -> array:
    """Prompt ids as a GENERATE's frame holds them, checked in one pass: integers (numpy's
    too), none negative, at most MAX_TOKENS_LIST."""
    try:
        out = ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)
    except OverflowError:
        raise ProtocolError("token ids must not be negative (nor above 2**32 - 1)") from None
    except TypeError:
        raise ProtocolError("field 'prompt_token_ids' must hold integers") from None
    if len(out) > MAX_TOKENS_LIST:
        raise ProtocolError(f"field 'prompt_token_ids' is longer than {MAX_TOKENS_LIST}")
    return out


def prompt_frame(ids: Any) -> bytes | None:
    """A GENERATE's prompt ids as its raw frame: native (little-endian) uint32, as a SUBMIT's,
    or None to keep them in the header (none given, or ids `token_ids` refuses: the receiver
    refuses those too, with its own message)."""
    if ids is None:
        return None
    try:
        return token_ids(ids).tobytes()
    except ProtocolError:
        return None


def decode(parts: Sequence[Any]) -> tuple[Any, list[memoryview]]:
    """Parse a multipart message (bytes or zmq.Frame parts) into (message, raw frames)."""
    if len(parts) < 3:
        raise ProtocolError(f"a message has at least 3 frames, got {len(parts)}")
    version, kind, header = (_bytes(p) for p in parts[:3])
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {bytes(version[:16])!r}")
    if len(kind) != 1 or kind[0] not in MESSAGES:
        raise ProtocolError(f"unknown message type {bytes(kind[:4]).hex()}")
    msg_type = MsgType(kind[0])
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError("header too large")
    frames = [memoryview(_bytes(p)) for p in parts[3:]]
    expected = STEP_FRAMES if msg_type is MsgType.STEP else FRAMES.get(msg_type, 0)
    if msg_type is MsgType.GENERATE:
        if len(frames) > 1:
            raise ProtocolError(f"GENERATE carries at most 1 raw frame (its prompt ids), got "
                                f"{len(frames)}")
    elif len(frames) != expected:
        raise ProtocolError(f"{msg_type.name} carries {expected} raw frames, got {len(frames)}")
    try:
        msg = _DECODERS[msg_type].decode(header)
    except msgspec.ValidationError as e:
        raise invalid(e, MESSAGES[msg_type].__name__) from None
    except Exception as e:  # garbage, truncation: DecodeError, UnicodeDecodeError, RecursionError
        detail = f"{type(e).__name__}: {e}".rstrip(": ")
        raise ProtocolError(f"malformed msgpack header ({detail[:160]})") from None
    if msg_type is MsgType.STEP:
        return decode_step(msg, frames), []
    if msg_type is MsgType.GENERATE and frames:
        msg.prompt_token_ids = _prompt_ids(msg, frames[0])
        return msg, []
    return msg, frames


def _prompt_ids(msg: Generate, frame: memoryview) -> array:
    """A GENERATE's prompt ids from its raw frame (see `prompt_frame`)."""
    if msg.prompt_token_ids is not None:
        raise ProtocolError("a GENERATE's prompt ids come in its header or its frame, not both")
    ids = array("I")
    if len(frame) % ids.itemsize:
        raise ProtocolError(f"a GENERATE's prompt frame holds {ids.itemsize}-byte ids; "
                            f"{len(frame)} bytes is not a whole number of them")
    if len(frame) // ids.itemsize > MAX_TOKENS_LIST:
        raise ProtocolError(f"field 'prompt_token_ids' is longer than {MAX_TOKENS_LIST}")
    ids.frombytes(frame)
    return ids


def _bytes(part: Any) -> bytes | memoryview:
    return part.buffer if hasattr(part, "buffer") else part


_send = zmq.backend.Socket.send  # the Cython send, without the Python layer's checks per call
_SNDMORE = int(zmq.SNDMORE)  # a plain int: OR-ing zmq's IntFlag members runs enum code per call


def send(sock: zmq.Socket, parts: Sequence[bytes | memoryview], flags: int = 0) -> None:
    """`sock.send_multipart(parts, flags)` at half its cost per message (measured on a 2-core VM,
    4 small parts: 5-6 us against 10-14), for the frontends' stream chunks, one per token per
    client. Raises zmq.ZMQError as send_multipart does; a multipart message is accepted or
    refused whole at its first part."""
    flags = int(flags)
    more, last = flags | _SNDMORE, len(parts) - 1
    for i, part in enumerate(parts):
        _send(sock, part, more if i < last else flags)


def drain(sock: zmq.Socket, handle, malformed, limit: int = 1000,
          seconds: float | None = None) -> None:
    """What a ROUTER holds now, but at most `limit` messages or `seconds`, so that one busy peer
    cannot hold a loop: `handle(identity, msg, frames)` for each message that decodes,
    `malformed(identity, error)` for each that does not."""
    deadline = None if seconds is None else time.monotonic() + seconds
    for _ in range(limit):
        if deadline is not None and time.monotonic() > deadline:
            return
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        identity = parts[0].bytes
        try:
            msg, frames = decode(parts[1:])
        except ProtocolError as e:
            malformed(identity, e)
            continue
        handle(identity, msg, frames)


class ChunkFrames:
    """One choice's CHUNK messages with the fixed fields (request id, index) packed once: a
    streamed token then costs three small packs instead of a Struct and its encoding."""

    _TEXT = msgpack.packb("text")
    _FINISH = msgpack.packb("finish_reason")

    def __init__(self, request_id: str, index: int):
        self.pack = msgpack.Packer(use_bin_type=True).pack  # one per choice: no thread shares it
        self.head = b"".join([b"\x85", self.pack("request_id"), self.pack(request_id),
                              self.pack("index"), self.pack(index), self.pack("token_ids")])

    def header(self, token_ids: list[int], text: str = "",
               finish_reason: str | None = None) -> bytes:
        """The msgpack map of `Chunk(request_id, index, token_ids, text, finish_reason)`."""
        pack = self.pack
        return b"".join([self.head, pack(token_ids), self._TEXT, pack(text), self._FINISH,
                         pack(finish_reason)])

    def encode(self, token_ids: list[int], text: str = "",
               finish_reason: str | None = None) -> list[bytes]:
        """The frames of `Chunk(request_id, index, token_ids, text, finish_reason)`."""
        return chunk_frames(self.header(token_ids, text, finish_reason))


_CHUNK = bytes([MsgType.CHUNK])
_CHUNKS = bytes([MsgType.CHUNKS])
_CHUNKS_KEY = b"\x81" + msgpack.packb("chunks")  # a map of one field, "chunks"
_array_header = msgpack.Packer().pack_array_header


def chunk_frames(header: bytes) -> list[bytes]:
    """A CHUNK message of one `ChunkFrames.header`."""
    return [VERSION, _CHUNK, header]


def chunk_messages(headers: list[bytes]) -> Iterator[list[bytes]]:
    """`ChunkFrames.header`s for one client as few messages: a CHUNK for one, else CHUNKS of at
    most MAX_LIST each."""
    if len(headers) == 1:
        yield chunk_frames(headers[0])
        return
    for i in range(0, len(headers), MAX_LIST):
        part = headers[i:i + MAX_LIST]
        yield [VERSION, _CHUNKS, b"".join([_CHUNKS_KEY, _array_header(len(part)), *part])]
