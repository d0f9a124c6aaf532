"""Random input to the decoder: it returns a valid message or raises ProtocolError, nothing else.

Seeded `random.Random` loops (hypothesis is not a dependency), a few thousand cases each.
"""

from __future__ import annotations

import random
import struct
from array import array
from typing import Any

import msgpack
import pytest

from protocol import step_frames
from protocol.errors import ProtocolError
from protocol.messages import (
    FRAMES,
    MESSAGES,
    Abort,
    Activations,
    Assign,
    Cancel,
    ChatMessage,
    Choice,
    Chunk,
    Chunks,
    Error,
    Failed,
    Finished,
    FrontendHello,
    Generate,
    Heartbeat,
    Listening,
    ModelInfo,
    Outputs,
    Ready,
    Register,
    Report,
    Reset,
    Result,
    SeqPlan,
    Serve,
    Shutdown,
    Status,
    StatusReply,
    Step,
    StepError,
    StepResult,
    Submit,
    Usage,
    WorkerConfig,
)
from protocol.sampling import SamplingParams
from protocol.wire import VERSION, decode, encode

CASES = 3000
VALID = [  # seeds: one of each type, with nested fields filled in
    Generate(request_id="r", messages=[ChatMessage("user", "Hi")],
             sampling=SamplingParams(stop=["x"], seed=3, n=2)),
    Generate(request_id="r", prompt_token_ids=array("I", [1, 2, 3])),  # a frame of ids
    Abort("r"),
    Status(),
    Chunk("r", 0, [5], "a", "stop"),
    Chunks([Chunk("r", 0, [5], "a", "stop"), Chunk("s", 1, [], "b")]),
    Result("r", [1], [Choice(0, [5], "a", "stop", 0)], Usage(1, 1)),
    StatusReply({"workers": [{"rank": 0}], "pool": {"free": 3}}),
    Error("internal", "x", None),
    Register(rank=0, device="cpu", pid=1),
    Assign(rank=0, n_workers=1, config=WorkerConfig(model="m", page_size=16, kv_pages=8)),
    Ready(rank=0, layer_start=0, layer_end=1,
          model=ModelInfo("m", 1, 8, 64, "{}", None, 1, True, [2])),
    Heartbeat(rank=0),
    Step(step=1, seqs=[SeqPlan(0, 0, 2, [1], True, SamplingParams())], token_ids=[7, 8], free=[3]),
    StepResult(step=1, seq_ids=[0], tokens=[9]),
    StepError(step=1, code="internal", message="x"),
    Shutdown(),
    Reset(reason="worker 1 stopped"),
    Activations(step=1, dtype="f32", shape=[1, 2]),
    FrontendHello(index=0, pid=1),
    Serve(ModelInfo("m", 1, 8, 64, "{}", None, 1, True, [2]), kv_pages=8, page_size=4),
    Listening(index=0, endpoint="tcp://127.0.0.1:1"),
    Submit(key=1, n_prompt=2, sampling=SamplingParams(n=2, seed=3, stop_token_ids=[2]),
           arrival=1.5),
    Cancel(key=1, index=0, reason="stop"),
    Outputs(n_rows=1, finished=[Finished(1, 0, "stop", 2)], failed=[Failed(2, "internal", "x")]),
    Report(errors={"too_long": 2}, dropped=1),
]


def check_decode(parts: list[bytes]) -> bool:
    """The property under test; a decoded message must also survive its own round trip.

    Returns whether `parts` decoded, so loops can show they reach the accepting path too.
    """
    try:
        msg, frames = decode(parts)
    except ProtocolError:
        return False
    assert type(msg) in MESSAGES.values()
    assert len(frames) == FRAMES.get(msg.TYPE, 0)
    again = encode(msg, frames)
    assert encode(decode(again)[0], frames) == again
    return True


def random_bytes(rng: random.Random, max_len: int = 48) -> bytes:
    return rng.randbytes(rng.randrange(max_len))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(14 if depth < 4 else 10)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**64 - 1])
    if kind == 3:
        return rng.randrange(-1000, 1000)
    if kind == 4:
        return rng.choice([0.0, -0.0, 0.5, 1.5, -1.0, 1e308, float("inf"), float("-inf"),
                           float("nan"), struct.unpack("<d", rng.randbytes(8))[0]])
    if kind == 5:
        return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(12)))
    if kind == 6:
        return random_bytes(rng, 12)
    if kind == 7:
        return msgpack.ExtType(rng.randrange(128), random_bytes(rng, 8))
    if kind == 8:
        return msgpack.Timestamp(rng.randrange(2**32), rng.randrange(10**9))
    if kind == 9:
        return rng.choice(["", "x" * 129, "stop", "user", "\x00"])
    if kind in (10, 11):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {
        rng.choice(["role", "content", "index", "rank", "x", "", "n"]): random_value(rng, depth + 1)
        for _ in range(rng.randrange(4))
    }


def random_header(rng: random.Random, cls: type) -> dict[Any, Any]:
    """Mostly the type's own field names with random values, sometimes a stray key."""
    names = list(cls.__struct_fields__)
    header: dict[Any, Any] = {
        name: random_value(rng) for name in names if rng.random() < 0.6
    }
    if rng.random() < 0.1:
        header[rng.choice(["evil", b"bytes-key", ""])] = random_value(rng)
    return header


def test_random_frames():
    rng = random.Random(1)
    types = [bytes([t]) for t in MESSAGES] + [b"\x00", b"\xff", b""]
    for _ in range(CASES):
        parts = [random_bytes(rng) for _ in range(rng.randrange(7))]
        if parts and rng.random() < 0.7:
            parts[0] = VERSION
        if len(parts) > 1 and rng.random() < 0.7:
            parts[1] = rng.choice(types)
        check_decode(parts)


def frames_for(cls: type) -> list[bytes]:
    """Raw frames for a message of `cls` (a STEP's columns: one sequence, one page, one id)."""
    if cls is Step:
        return [b"\x00" * 8 * step_frames.COLUMNS, b"\x00" * 8, b"\x00" * 8]
    return [b"\x00" * 8] * FRAMES.get(cls.TYPE, 0)


def wire_form(msg: Any) -> tuple[Any, list[bytes]]:
    """A message's header map as it travels, and its frames."""
    parts = encode(msg, frames_for(type(msg)))
    return msgpack.unpackb(parts[2]), [bytes(p) for p in parts[3:]]


# the fields a type's header holds on the wire
WIRE_FIELDS = {Step: step_frames.StepHeader}


def test_seeds_cover_every_message_type():
    assert {type(m) for m in VALID} == set(MESSAGES.values())


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_valid_messages_with_flipped_truncated_or_extended_bytes(msg):
    rng = random.Random(type(msg).__name__)
    parts = [bytes(p) for p in encode(msg, frames_for(type(msg)))]
    assert decode(parts)[0] == msg
    for _ in range(CASES // 8):
        mutated = [bytearray(p) for p in parts]
        target = mutated[rng.choice([0, 1, 2, 2, 2, 2])]
        action = rng.randrange(4)
        if action == 0 and target:
            for _ in range(rng.randrange(1, 4)):
                target[rng.randrange(len(target))] ^= 1 << rng.randrange(8)
        elif action == 1:
            del target[rng.randrange(len(target) + 1):]
        elif action == 2:
            target[rng.randrange(len(target) + 1):0] = random_bytes(rng, 8)
        else:
            mutated = mutated[: rng.randrange(len(mutated) + 1)] + [bytearray(random_bytes(rng))]
        check_decode([bytes(p) for p in mutated])


def nodes(tree: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every value inside a header tree."""
    found, stack = [], [tree]
    while stack:
        container = stack.pop()
        keys = container.keys() if isinstance(container, dict) else range(len(container))
        for key in keys:
            found.append((container, key))
            if isinstance(container[key], (dict, list)):
                stack.append(container[key])
    return found


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_valid_headers_with_random_values_in_random_places(msg):
    rng = random.Random(f"tree-{type(msg).__name__}")
    accepted = 0
    for _ in range(CASES // 8):
        header, raw = wire_form(msg)
        for _ in range(rng.randrange(1, 3)):
            places = nodes(header)
            if not places:
                break
            container, key = rng.choice(places)
            container[key] = random_value(rng)
        accepted += check_decode([VERSION, bytes([msg.TYPE]), msgpack.packb(header), *raw])
    assert accepted > 0  # the loop reaches the accepting path, not only rejections


@pytest.mark.parametrize("cls", list(MESSAGES.values()), ids=lambda c: c.__name__)
def test_random_msgpack_headers_for_each_message_type(cls):
    rng = random.Random(cls.__name__)
    for _ in range(CASES // 6):
        header = random_header(rng, WIRE_FIELDS.get(cls, cls)) if rng.random() < 0.9 \
            else random_value(rng)
        check_decode([VERSION, bytes([cls.TYPE]), msgpack.packb(header), *frames_for(cls)])


def test_deeply_nested_msgpack_is_rejected_not_a_crash():
    for depth in (100, 1000, 1024, 1025, 5000):
        for cls in (StatusReply, Activations):
            header = b"\x81\xa6status" + b"\x91" * depth + b"\xc0"  # {"status": [[...[None]]]}
            assert not check_decode([VERSION, bytes([cls.TYPE]), header])
