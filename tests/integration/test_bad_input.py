"""Bad input gets a clear error or is dropped; the cluster keeps serving everyone else."""

import os
import pickle
import threading
import time
from array import array

import msgpack
import pytest
import zmq

from protocol import Client, RequestError
from protocol.wire import MAX_CLIENT_MESSAGE_BYTES, VERSION


@pytest.fixture(scope="module")
def cluster(launch):
    return launch("--model", "smollm2-135m", "--workers", "2", "--kv-pages", "64")


def raw_exchange(endpoint: str, frames: list[bytes], wait_ms: int = 5000):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        if not sock.poll(wait_ms):
            return None
        return sock.recv_multipart()
    finally:
        sock.close()


def error_of(reply) -> dict:
    assert reply is not None, "no reply"
    assert reply[0] == VERSION and reply[1] == bytes([0x1F]), reply[:2]
    return msgpack.unpackb(reply[2])


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/siding-pwned",))


GENERATE = bytes([0x01])
CASES = {
    "malformed_msgpack": [VERSION, GENERATE, b"\xc1\xff\x00"],
    "pickle_payload": [VERSION, GENERATE, pickle.dumps(Evil())],
    "unknown_version": [b"SIDING/9", GENERATE, msgpack.packb({"request_id": "a"})],
    "unknown_type": [VERSION, bytes([0x77]), msgpack.packb({})],
    "too_few_frames": [VERSION],
    "trailing_garbage": [VERSION, GENERATE, msgpack.packb({"request_id": "a", "prompt": "x"})
                         + b"junk"],
    "wrong_field_type": [VERSION, GENERATE, msgpack.packb({"request_id": "a", "prompt": 5})],
    "unknown_field": [VERSION, GENERATE, msgpack.packb({"request_id": "a", "prompt": "x",
                                                        "sneaky": 1})],
    "extra_raw_frame": [VERSION, GENERATE, msgpack.packb({"request_id": "a", "prompt": "x"}),
                        b"extra"],
    "ragged_prompt_frame": [VERSION, GENERATE, msgpack.packb({"request_id": "a"}), b"\x01" * 6],
    "prompt_ids_twice": [VERSION, GENERATE, msgpack.packb({"request_id": "a",
                                                           "prompt_token_ids": [1]}),
                         array("I", [1]).tobytes()],
    "two_raw_frames": [VERSION, GENERATE, msgpack.packb({"request_id": "a"}),
                       array("I", [1]).tobytes(), array("I", [2]).tobytes()],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_messages_get_an_invalid_request_error(cluster, name):
    if os.path.exists("/tmp/siding-pwned"):
        os.remove("/tmp/siding-pwned")
    err = error_of(raw_exchange(cluster.endpoint, CASES[name]))
    assert err["code"] == "invalid_request"
    assert err["message"]
    assert not os.path.exists("/tmp/siding-pwned")


def test_oversized_message_is_dropped_and_the_cluster_serves_on(cluster):
    big = b"x" * (MAX_CLIENT_MESSAGE_BYTES + 1)  # ZeroMQ drops it: Python never sees it
    assert raw_exchange(cluster.endpoint, [VERSION, GENERATE, big], wait_ms=2000) is None
    with Client(cluster.endpoint, timeout=60) as c:
        assert "Paris" in c.generate("The capital of France is", max_tokens=8).text


@pytest.mark.parametrize("kwargs,code,words", [
    ({"prompt": ""}, "invalid_request", "empty"),
    ({"prompt": "hi", "max_tokens": 0}, "invalid_request", "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "invalid_request", "max_tokens"),
    ({"prompt": "word " * 9000}, "too_long", "context"),
    ({"prompt_token_ids": [1, 2, 10**6]}, "invalid_request", "vocabulary"),
    ({"prompt": "hi", "top_p": 0.0}, "invalid_request", "top_p"),
    ({"prompt": "hi", "max_tokens": 10**6}, "too_long", "pages"),
])
def test_impossible_requests_get_a_clear_error(cluster, kwargs, code, words):
    with Client(cluster.endpoint, timeout=60) as c:
        prompt = kwargs.pop("prompt", None)
        with pytest.raises(RequestError) as e:
            c.generate(prompt, **kwargs)
    assert e.value.code == code
    assert words in e.value.message


def test_prompt_ids_in_a_frame_are_checked_as_in_a_header(cluster):
    """A raw frame of ids (how the client library sends them) meets the header's checks: an
    id the model lacks, a negative one (huge, read as unsigned), and an empty prompt."""
    for ids, words in (([1, 2, 10**6], "vocabulary"), ([5, -1], "vocabulary"), ([], "empty")):
        err = error_of(raw_exchange(cluster.endpoint, [
            VERSION, GENERATE, msgpack.packb({"request_id": "f", "sampling": {"max_tokens": 2}}),
            array("i", ids).tobytes()]))
        assert (err["code"], err["request_id"]) == ("invalid_request", "f")
        assert words in err["message"]
    with Client(cluster.endpoint, timeout=60) as c:  # and the frame form serves
        r = c.generate(prompt_token_ids=[504, 3458, 282, 4649, 314], max_tokens=4,
                       ignore_eos=True)
    assert r.prompt_token_ids == [504, 3458, 282, 4649, 314] and len(r.token_ids) == 4


def test_bad_input_does_not_disturb_a_request_in_flight(cluster):
    result = {}

    def good():
        with Client(cluster.endpoint, timeout=600) as c:
            result["r"] = c.generate("The capital of France is", max_tokens=24, ignore_eos=True)

    t = threading.Thread(target=good)
    t.start()
    for frames in CASES.values():
        raw_exchange(cluster.endpoint, frames, wait_ms=1000)
    t.join(600)
    assert len(result["r"].token_ids) == 24
    with Client(cluster.endpoint, timeout=60) as c:
        assert c.status()["workers"][1]["alive"] is True


def test_bad_input_to_a_frontend_never_reaches_the_core(cluster):
    def dropped() -> dict:
        with Client(cluster.endpoint, timeout=60) as c:
            return c.status()["dropped"]

    before = dropped()
    for frames in CASES.values():
        raw_exchange(cluster.endpoint, frames, wait_ms=1000)
    deadline = time.monotonic() + 60
    while (after := dropped())["client"] - before["client"] < len(CASES):
        assert time.monotonic() < deadline, after  # a frontend reports once a second
        time.sleep(0.2)
    assert after["client"] - before["client"] == len(CASES)  # all seen, and counted...
    assert after["frontend"] == 0 and after["worker"] == 0  # ...by the frontend alone
