"""Frame codec: `[b"SIDING/1", type (1 byte), header (msgpack map), *raw frames]`.

msgpack is decoded with strict limits and no extension types, so a header can only ever become
maps, lists, strings, numbers, booleans and None. Nothing on any socket is unpickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from .errors import ProtocolError
from .messages import FRAMES, MESSAGES, MsgType, from_header, to_header

VERSION = b"SIDING/1"
MAX_HEADER_BYTES = 64 << 20  # a READY carries the tokenizer; everything else is far smaller
MAX_MESSAGE_BYTES = 1 << 30  # socket MAXMSGSIZE: activations of a large prefill fit


def encode(msg: Any, frames: Sequence[bytes | memoryview] = ()) -> list[bytes | memoryview]:
    header = msgpack.packb(to_header(msg), use_bin_type=True)
    return [VERSION, bytes([msg.TYPE]), header, *frames]


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
    if len(frames) != FRAMES.get(msg_type, 0):
        raise ProtocolError(
            f"{msg_type.name} carries {FRAMES.get(msg_type, 0)} raw frames, got {len(frames)}"
        )
    try:
        fields = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True)
    except msgpack.ExtraData:
        raise ProtocolError("trailing bytes after the msgpack header") from None
    except Exception as e:  # msgpack raises several types for garbage and truncation
        detail = f"{type(e).__name__}: {e}".rstrip(": ")
        raise ProtocolError(f"malformed msgpack header ({detail[:160]})") from None
    return from_header(MESSAGES[msg_type], fields), frames


def _bytes(part: Any) -> bytes | memoryview:
    return part.buffer if hasattr(part, "buffer") else part
