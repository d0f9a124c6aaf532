"""The frame codec: every message type round-trips; every bad input is a ProtocolError."""

from __future__ import annotations

import pickle
import re
import struct
from array import array
from pathlib import Path

import msgpack
import pytest
import zmq

from protocol.errors import ProtocolError
from protocol.messages import (
    MAX_TEXT,
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
    MsgType,
    Outputs,
    PageCopy,
    PageMove,
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

SAMPLES = [
    Generate(
        request_id="r1", messages=[ChatMessage("user", "Hi")],
        sampling=SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, top_k=40, seed=7,
                                stop=["\n"], stop_token_ids=[2], ignore_eos=True, n=2),
        priority=-3, stream=True,
    ),
    Generate(request_id="r2", prompt_token_ids=array("I", [1, 2, 3])),  # as decode gives
    Abort("r1"),
    Status(),
    Chunk("r1", 1, [5, 6], "ab", "stop"),
    Chunks([Chunk("r1", 1, [5, 6], "ab", "stop"), Chunk("r2", 0, [7], "", None)]),
    Result("r1", [1, 2], [Choice(0, [5], "a", "length", 2)], Usage(2, 1)),
    StatusReply({"workers": [{"rank": 0, "free": 1.5}], "ok": True, "none": None}),
    Error("too_long", "does not fit", "r1"),
    Error("invalid_request", "bad", None),
    Register(rank=1, device="cuda:1", pid=42, hostname="h", data_endpoint="tcp://h:1"),
    Assign(rank=0, n_workers=2, config=WorkerConfig(model="smollm2-135m", dtype="bfloat16",
                                                    kv="host", overlap="off", park_pages=7),
           next_endpoint="tcp://h:2", layer_start=0, layer_end=15),
    Ready(rank=0, layer_start=0, layer_end=30, kv_bytes_per_page=4096,
          model=ModelInfo("m", 30, 49152, 8192, "{}", "{{ x }}", None, False, [2])),
    Heartbeat(rank=3),
    Step(step=9, seqs=[SeqPlan(1, 0, 3, [4, 5], True, SamplingParams(0.7, 0.9, 20, 11)),
                       SeqPlan(4, 17, 1, [], False, None),
                       SeqPlan(2, 30, 2, [9], True, SamplingParams(0.0, 1.0, 0, 3)),
                       SeqPlan(8, 12, 1, [], True, None, after=True)],
         token_ids=[1, 2, 3, 4, 5, 6, 0], free=[7], park=[PageMove(5, [1, 2], [0, 3])],
         restore=[PageMove(6, [8], [4])], copies=[PageCopy(3, 10)]),
    Step(step=10, seqs=[SeqPlan(8, 13, 1, [], True, None, after=True)], token_ids=[0],
         hold=True),  # a step of a group but its last (--multi-step)
    StepResult(step=9, seq_ids=[1], tokens=[42], forward_seconds=0.01),
    StepError(step=9, code="worker_failed", message="CUDA out of memory"),
    Shutdown(),
    Reset(reason="worker 1 stopped"),
    FrontendHello(index=1, pid=7),
    Serve(ModelInfo("m", 30, 49152, 8192, "{}", None, 1, True, [2]), kv_pages=64, page_size=16),
    Listening(index=1, endpoint="tcp://127.0.0.1:5557"),
    Cancel(key=3, index=-1, reason="abort"),
    Report(errors={"invalid_request": 1}, dropped=2),
]
WITH_FRAMES = [  # the types that carry raw frames, with theirs
    (Activations(step=1, dtype="float32", shape=[1, 2]), [b"\x00" * 8]),
    (Submit(key=3, n_prompt=3, sampling=SamplingParams(n=2, max_tokens=9, temperature=0.5,
                                                       seed=1, stop_token_ids=[2]),
            priority=4, arrival=12.5), [b"\x01\x00\x00\x00" * 3]),
    (Outputs(n_rows=1, finished=[Finished(3, 0, "length", 1)], failed=[Failed(4, "x", "y")]),
     [b"\x03" + b"\x00" * 23]),
]


def parts(msg_type: int, header: object, frames: list[bytes] | None = None) -> list[bytes]:
    return [VERSION, bytes([msg_type]), msgpack.packb(header), *(frames or [])]


def columns(*cols: list[int]) -> list[bytes]:
    """A STEP's raw frames: int64 little-endian columns."""
    return [struct.pack(f"<{len(c)}q", *c) for c in cols]


def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} | {type(m) for m, _ in WITH_FRAMES} == \
        set(MESSAGES.values())


@pytest.mark.parametrize("msg,frames", WITH_FRAMES, ids=lambda m: type(m).__name__)
def test_messages_with_raw_frames_round_trip(msg, frames):
    decoded, got = decode(encode(msg, frames))
    assert decoded == msg and [bytes(f) for f in got] == frames


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert decode(encode(msg)) == (msg, [])


def test_activations_round_trip_with_their_raw_frame_and_zmq_frames_decode():
    msg = Activations(step=3, dtype="bfloat16", shape=[2, 4])
    payload = bytes(range(16))
    decoded, frames = decode([zmq.Frame(p) for p in encode(msg, [payload])])
    assert (decoded, [bytes(f) for f in frames]) == (msg, [payload])


GENERATE = {"request_id": "r", "prompt": "x"}

REJECTED = {
    "wrong version": ([b"SIDING/2", b"\x01", msgpack.packb(GENERATE)],
                      "unsupported protocol version b'SIDING/2'"),
    "unknown type": ([VERSION, b"\x7f", msgpack.packb(GENERATE)], "unknown message type 7f"),
    "two type bytes": ([VERSION, b"\x01\x01", msgpack.packb(GENERATE)],
                       "unknown message type 0101"),
    "empty message": ([], "a message has at least 3 frames, got 0"),
    "short message": ([VERSION, b"\x01"], "a message has at least 3 frames, got 2"),
    "empty header": ([VERSION, b"\x01", b""],
                     "malformed msgpack header (DecodeError: Input data was truncated)"),
    "bad msgpack": ([VERSION, b"\x01", b"\xc1"],
                    "malformed msgpack header (DecodeError: MessagePack data is malformed: "
                    "invalid opcode '\\xc1' (byte 0))"),
    # the decoder's own words, which msgspec changed between 0.22 and 0.23
    "invalid utf-8": ([VERSION, b"\x02", b"\x81\xaarequest_id\xa2\xff\xfe"],
                      re.compile(r"malformed msgpack header \(\w+Error: .*(?i:utf-8).*\)")),
    "trailing garbage": ([VERSION, b"\x01", msgpack.packb(GENERATE) + b"\x00"],
                         "malformed msgpack header (DecodeError: MessagePack data is malformed: "
                         "trailing characters (byte 23))"),
    "non-map header": (parts(0x01, ["r", "x"]), "Generate: expected `object`, got `array`"),
    "integer map key": (parts(0x01, {1: "r"}),
                        "Generate: expected `str`, got `int` - at `key` in `$`"),
    "unknown field": (parts(0x01, {**GENERATE, "evil": 1}), "unknown field 'evil'"),
    "unknown nested field": (parts(0x12, {"request_id": "r", "choices": [{"x": 1}]}),
                             "unknown field 'choices[0].x'"),
    "nested non-map": (parts(0x12, {"request_id": "r", "usage": 3}),
                       "field 'usage': expected `object`, got `int`"),
    "missing field": (parts(0x02, {}), "missing field 'request_id'"),
    "missing nested field": (parts(0x23, {"rank": 0, "layer_start": 0, "layer_end": 1,
                                          "model": {"name": "m"}}),
                             "missing field 'model.n_layers'"),
    "str for int": (parts(0x01, {**GENERATE, "sampling": {"max_tokens": "16"}}),
                    "field 'sampling.max_tokens': expected `int`, got `str`"),
    "bool for int": (parts(0x01, {**GENERATE, "sampling": {"max_tokens": True}}),
                     "field 'sampling.max_tokens': expected `int`, got `bool`"),
    "float for int": (parts(0x01, {**GENERATE, "sampling": {"top_k": 1.0}}),
                      "field 'sampling.top_k': expected `int`, got `float`"),
    "NaN for float": (parts(0x01, {**GENERATE, "sampling": {"temperature": float("nan")}}),
                      "field 'sampling.temperature': expected `float` >= 0.0"),
    "bytes for str": (parts(0x01, {"request_id": "r", "prompt": b"x"}),
                      "field 'prompt': expected `str | null`, got `bytes`"),
    "int for bool": (parts(0x01, {**GENERATE, "stream": 1}),
                     "field 'stream': expected `bool`, got `int`"),
    "str for list": (parts(0x01, {**GENERATE, "sampling": {"stop": "\n"}}),
                     "field 'sampling.stop': expected `array`, got `str`"),
    "str in int list": (parts(0x01, {"request_id": "r", "prompt_token_ids": [1, "2"]}),
                        "field 'prompt_token_ids[1]': expected `int`, got `str`"),
    "max_tokens 0": (parts(0x01, {**GENERATE, "sampling": {"max_tokens": 0}}),
                     "field 'sampling.max_tokens': expected `int` >= 1"),
    "n 0": (parts(0x01, {**GENERATE, "sampling": {"n": 0}}),
            "field 'sampling.n': expected `int` >= 1"),
    "top_p 1.5": (parts(0x01, {**GENERATE, "sampling": {"top_p": 1.5}}),
                  "field 'sampling.top_p': expected `float` <= 1.0"),
    "infinite temperature": (parts(0x01, {**GENERATE, "sampling": {"temperature": float("inf")}}),
                             "field 'sampling.temperature': expected `float` <= 100.0"),
    "negative index": (parts(0x11, {"request_id": "r", "index": -1}),
                       "field 'index': expected `int` >= 0"),
    "long request id": (parts(0x02, {"request_id": "x" * 129}),
                        "field 'request_id': expected `str` of length <= 128"),
    "long prompt": (parts(0x01, {"request_id": "r", "prompt": "x" * (MAX_TEXT + 1)}),
                    "field 'prompt': expected `str` of length <= 1048576"),
    "long stop list": (parts(0x01, {**GENERATE, "sampling": {"stop": ["s"] * 65}}),
                       "field 'sampling.stop': expected `array` of length <= 64"),
    "unknown sampling field": (parts(0x01, {**GENERATE, "sampling": {"evil": 1}}),
                               "unknown field 'sampling.evil'"),
    "too many choices": (parts(0x12, {"request_id": "r", "choices": [{}] * 65}),
                         "field 'choices': expected `array` of length <= 64"),
    "extension type in a map": (parts(0x13, {"status": {"t": msgpack.ExtType(1, b"x")}}),
                                "StatusReply: a msgpack extension type (Ext) in 'status'"),
    "timestamp in a map": (parts(0x13, {"status": {"t": [msgpack.Timestamp(1, 0)]}}),
                           "StatusReply: a msgpack extension type (datetime) in 'status'"),
    "missing raw frame": (parts(0x31, {"step": 0, "dtype": "f32", "shape": [1]}),
                          "ACTIVATIONS carries 1 raw frames, got 0"),
    "extra raw frame": (parts(0x02, {"request_id": "a"}, [b"tensor"]),
                        "ABORT carries 0 raw frames, got 1"),
    "two prompt frames": (parts(0x01, GENERATE, [b"1234", b"5678"]),
                          "GENERATE carries at most 1 raw frame (its prompt ids), got 2"),
    "ragged prompt frame": (parts(0x01, {"request_id": "a"}, [b"12345"]),
                            "a GENERATE's prompt frame holds 4-byte ids; 5 bytes is not a whole "
                            "number of them"),
    **{f"step: {name}": (parts(0x25, {"step": 1, **header}, columns(*cols)), expected)
       for name, (header, cols, expected) in {
           "frames missing": ({}, [[]], "STEP carries 3 raw frames, got 1"),
           "sequences short": ({"n_seqs": 2}, [[1, 0, 1, 0, 0, 0], [], []],
                               "STEP's sequences frame holds 48 bytes; the header says 12 int64 "
                               "values"),
           "negative id": ({"n_seqs": 1}, [[-1, 0, 1, 0, 0, 0], [], []],
                           "STEP's sequences must not be negative"),
           "no rows": ({"n_seqs": 1}, [[1, 0, 0, 0, 0, 0], [], []],
                       "STEP: a sequence with no rows"),
           "sample flag 2": ({"n_seqs": 1}, [[1, 0, 1, 2, 0, 0], [], []],
                             "STEP: a sequence's sample flag is neither 0 nor 1"),
           "after flag 2": ({"n_seqs": 1}, [[1, 0, 1, 1, 0, 2], [], []],
                            "STEP: a sequence's after flag is neither 0 nor 1"),
           "page counts": ({"n_seqs": 1, "n_pages": 1}, [[1, 0, 1, 0, 2, 0], [5], []],
                           "STEP: the sequences' page counts do not add up to its pages"),
           "negative page": ({"n_seqs": 1, "n_pages": 1}, [[1, 0, 1, 0, 1, 0], [-5], []],
                             "STEP's pages must not be negative"),
           "token count": ({"n_tokens": 2}, [[], [], [7]],
                           "STEP's token ids frame holds 8 bytes; the header says 2 int64 values"),
           "sampling index": ({"n_seqs": 1, "sampling": [{"seq": 1, "sampling": {}}]},
                              [[1, 0, 1, 1, 0, 0], [], []], "STEP: sampling for sequence 1 of 1"),
           "odd header field": ({"seqs": []}, [[], [], []], "unknown field 'seqs'"),
       }.items()},
}


@pytest.mark.parametrize("case", REJECTED)
def test_bad_messages_are_rejected_with_a_clear_message(case):
    message_parts, expected = REJECTED[case]
    with pytest.raises(ProtocolError) as e:
        decode(message_parts)
    assert e.value.code == "invalid_request"
    if isinstance(expected, re.Pattern):
        assert expected.fullmatch(e.value.message), e.value.message
    else:
        assert e.value.message == expected


def test_an_oversized_header_is_rejected_before_it_is_parsed():
    with pytest.raises(ProtocolError) as e:
        decode([VERSION, b"\x13", bytes((64 << 20) + 1)])
    assert e.value.message == "header too large"


class _CreatesFile:
    """Unpickling this opens (creates) a file: a stand-in for any code a pickle can run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_pickle_is_rejected_and_never_unpickled(tmp_path):
    canary = tmp_path / "canary"
    pickle.loads(pickle.dumps(_CreatesFile(canary))).close()
    assert canary.exists()  # the payload does what it says when unpickled

    target = tmp_path / "pwned"
    payload = pickle.dumps(_CreatesFile(target))
    with pytest.raises(ProtocolError) as as_header:
        decode([VERSION, b"\x13", payload])
    with pytest.raises(ProtocolError) as as_message:
        decode([payload])
    assert as_header.value.message.startswith("malformed msgpack header (DecodeError: MessagePack "
                                              "data is malformed: trailing characters")
    assert as_message.value.message == "a message has at least 3 frames, got 1"
    assert not target.exists()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ({"messages": []}, "the prompt is empty"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "give exactly one of prompt, "
                                                   "prompt_token_ids or messages"),
        ({}, "give exactly one of prompt, prompt_token_ids or messages"),
        ({"prompt_token_ids": [1, -2]}, "token ids must not be negative"),
    ],
)
def test_generate_check_rejects_requests_that_cannot_run(fields, expected):
    with pytest.raises(ProtocolError) as e:
        Generate(request_id="r", **fields).check()
    assert e.value.message == expected


def test_generate_check_accepts_each_kind_of_prompt():
    Generate(request_id="r", prompt="x").check()
    Generate(request_id="r", prompt_token_ids=[0]).check()
    Generate(request_id="r", messages=[ChatMessage("user", "")]).check()


@pytest.mark.parametrize("tokens,text,finish", [([5, 6], "hé 你好", "stop"), ([], "", None),
                                                ([2**40], "x" * 70000, "length")])
def test_chunk_frames_encode_the_chunk_the_dataclass_does(tokens, text, finish):
    from protocol.wire import ChunkFrames

    frames = ChunkFrames("r" * 128, 63).encode(tokens, text, finish)
    assert decode(frames) == (Chunk("r" * 128, 63, tokens, text, finish), [])
    assert frames == encode(Chunk("r" * 128, 63, tokens, text, finish))


def test_prompt_ids_travel_as_a_uint32_frame_and_still_come_in_a_header(monkeypatch):
    from protocol import wire

    parts = encode(Generate(request_id="r", prompt_token_ids=[7, 2**32 - 1, 0]))
    assert msgpack.unpackb(parts[2])["prompt_token_ids"] is None
    assert parts[3:] == [array("I", [7, 2**32 - 1, 0]).tobytes()]
    msg, frames = decode(parts)
    assert (msg.prompt_token_ids, frames) == (array("I", [7, 2**32 - 1, 0]), [])
    header = [VERSION, bytes([MsgType.GENERATE]),
              msgpack.packb({"request_id": "r", "prompt_token_ids": [7, 8]})]
    assert decode(header)[0].prompt_token_ids == [7, 8]  # a client that lists them
    # ids no uint32 holds stay in the header, where the receiver refuses them by name
    assert len(encode(Generate(request_id="r", prompt_token_ids=[-1]))) == 3
    bad = [([*header, b"\0" * 4], "header or its frame, not both"),
           ([*header[:2], msgpack.packb({"request_id": "r"}), b"\0" * 7], "whole number")]
    for parts, words in bad:
        with pytest.raises(ProtocolError, match=words):
            decode(parts)
    frame = encode(Generate(request_id="r", prompt_token_ids=[1, 2, 3]))
    monkeypatch.setattr(wire, "MAX_TOKENS_LIST", 2)  # a frame past the limit is refused
    with pytest.raises(ProtocolError, match="longer than 2"):
        decode(frame)


def test_build_generate_checks_prompt_ids_in_one_pass():
    import numpy as np

    from protocol.client import build_generate

    msg = build_generate(prompt_token_ids=np.arange(3, dtype=np.int64))
    assert msg.prompt_token_ids == array("I", [0, 1, 2])  # numpy's ints are ints
    for ids, words in (([1, -1], "must not be negative"), ([2**32], "must not be negative"),
                       ([1.0], "must hold integers"), (["1"], "must hold integers"),
                       ([], "empty")):
        with pytest.raises(ProtocolError, match=words):
            build_generate(prompt_token_ids=ids)


def test_chunk_messages_put_a_clients_chunks_in_one_chunks_message(monkeypatch):
    from protocol import wire

    chunks = [Chunk(f"r{i}", i % 3, [i, 2**40], "hé 你好" * i, "stop" if i % 2 else None)
              for i in range(5)]
    headers = [wire.ChunkFrames(c.request_id, c.index).header(c.token_ids, c.text,
                                                              c.finish_reason) for c in chunks]
    (one,) = wire.chunk_messages(headers[:1])
    assert one == encode(chunks[0])  # one chunk stays a CHUNK
    (batch,) = wire.chunk_messages(headers)
    assert batch == encode(Chunks(chunks))
    assert decode(batch) == (Chunks(chunks), [])
    monkeypatch.setattr(wire, "MAX_LIST", 2)  # a client's list limit splits a long batch
    parts = [decode(m)[0] for m in wire.chunk_messages(headers)]
    assert parts == [Chunks(chunks[:2]), Chunks(chunks[2:4]), Chunks(chunks[4:])]


def test_send_delivers_what_send_multipart_does():
    from protocol.wire import send

    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-send")
        b.connect("inproc://wire-send")
        send(a, encode(Activations(step=1, dtype="float32", shape=[1, 2]), [b"\x00" * 8]))
        assert b.poll(2000)
        assert decode(b.recv_multipart()) == (Activations(1, "float32", [1, 2]), [b"\x00" * 8])
    finally:
        a.close()
        b.close()
