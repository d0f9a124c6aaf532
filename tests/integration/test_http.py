"""The OpenAI-compatible HTTP API against a real cluster (the default model, exact mode), through
the official `openai` client: the same tokens as the ZeroMQ client, streamed or not; a client
that goes away frees its pages; every bad input gets its status and OpenAI's error shape while a
well-formed request beside it is served unchanged, and is counted where the ZeroMQ endpoint's
are. A second, small cluster (`tiny`) takes the tests that need a queue, SSE comments or a stop."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from urllib.parse import urlsplit

import openai
import pytest

from protocol import Client

KEY = "test-key-3f9c"
MODEL = "smollm2-135m"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def cluster(launch, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("http") / "api-key"
    key_file.write_text(KEY + "\n")
    return launch("--exact", "--http", "127.0.0.1:0", "--api-key-file", str(key_file),
                  "--kv-pages", "256", "--max-batch-seqs", "16")


@pytest.fixture(scope="module")
def api(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http + "/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def zmq(cluster):
    with Client(cluster.endpoint, timeout=600) as c:
        yield c


def pages_used(zmq) -> int:
    return zmq.status()["pool"]["pages_used"]


def wait_idle(zmq, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        s = zmq.status()
        if s["pool"]["pages_used"] == 0 and s["requests"]["running"] == 0:
            return s
        assert time.monotonic() < deadline, f"not idle after {seconds}s: {s['requests']}"
        time.sleep(0.1)


def connect(cluster) -> http.client.HTTPConnection:
    url = urlsplit(cluster.http)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=60)


def request(cluster, method: str, path: str, body: bytes | str | None = None,
            headers: dict | None = None) -> SimpleNamespace:
    """A plain HTTP request (no client library's checks in the way): status and JSON body."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
               **(headers or {})}
    conn = connect(cluster)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return SimpleNamespace(status_code=r.status, json=json.loads(r.read()))
    finally:
        conn.close()


def post(cluster, path: str, body: bytes | str, headers: dict | None = None) -> SimpleNamespace:
    return request(cluster, "POST", path, body, headers)


# ---- the same tokens as the ZeroMQ client --------------------------------------------------


@pytest.mark.parametrize("case", [
    {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0},
    {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "seed": 1234, "n": 2},
    {"prompt": "Once upon a time,", "max_tokens": 40, "temperature": 0.0, "stop": [","]},
    {"prompt_token_ids": [504, 6376, 314], "max_tokens": 10, "temperature": 0.7, "seed": 7,
     "top_k": 20},
], ids=["greedy", "seeded-n2", "stop", "token-ids"])
def test_completions_give_the_zeromq_clients_tokens(api, zmq, case):
    ids = case.pop("prompt_token_ids", None)
    extra = {"return_token_ids": True}
    if "top_k" in case:
        extra["top_k"] = case["top_k"]
    r = api.completions.create(model=MODEL, prompt=ids if ids else case["prompt"],
                               max_tokens=case["max_tokens"], temperature=case["temperature"],
                               seed=case.get("seed"), n=case.get("n", 1),
                               stop=case.get("stop"), extra_body=extra)
    want = zmq.generate(prompt=None if ids else case["prompt"], prompt_token_ids=ids,
                        max_tokens=case["max_tokens"], temperature=case["temperature"],
                        seed=case.get("seed"), n=case.get("n", 1), stop=case.get("stop"),
                        top_k=case.get("top_k", 0))
    assert len(r.choices) == len(want.choices)
    for got, ref in zip(sorted(r.choices, key=lambda c: c.index), want.choices):
        assert got.model_extra["token_ids"] == ref.token_ids
        assert got.text == ref.text
        assert got.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == want.usage["prompt_tokens"]
    assert r.usage.completion_tokens == want.usage["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["siding"]["exact"] is True
    if case.get("stop"):
        assert r.choices[0].finish_reason == "stop" and "," not in r.choices[0].text


def test_a_list_of_prompts_gives_choices_in_prompt_order(api, zmq):
    prompts = ["Once upon a time,", "The sky is"]
    r = api.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0.0, n=2,
                               extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        want = zmq.generate(prompt, max_tokens=6, temperature=0.0, n=2)
        for j in range(2):
            assert r.choices[p * 2 + j].model_extra["token_ids"] == want.choices[j].token_ids


def test_chat_streamed_and_whole_equal_the_zeromq_chat(api, zmq):
    messages = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    want = zmq.chat(messages, max_tokens=24, temperature=0.0)
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                        temperature=0.0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].finish_reason == want.finish_reason
    assert whole.usage.prompt_tokens == want.usage["prompt_tokens"]

    text, roles, finish, usage = [], [], None, None
    for chunk in api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0.0, stream=True,
            stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        text.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(text) == want.text
    assert roles == ["assistant"] and finish == want.finish_reason
    assert usage.completion_tokens == want.usage["completion_tokens"]
    assert usage.prompt_tokens == want.usage["prompt_tokens"]


def test_chat_without_a_limit_runs_to_its_end(api, zmq):
    messages = [{"role": "user", "content": "Say hello."}]
    r = api.chat.completions.create(model=MODEL, messages=messages, temperature=0.0)
    assert r.choices[0].finish_reason == "stop"  # the model's end of turn, not a default cap
    want = zmq.chat(messages, max_tokens=r.usage.completion_tokens, temperature=0.0)
    assert r.choices[0].message.content == want.text


def test_streamed_completion_with_n2_and_stop(api, zmq):
    want = zmq.generate("Once upon a time,", max_tokens=30, temperature=0.8, seed=99, n=2,
                        stop=["."])
    texts, finish = ["", ""], [None, None]
    for chunk in api.completions.create(model=MODEL, prompt="Once upon a time,", max_tokens=30,
                                        temperature=0.8, seed=99, n=2, stop=["."], stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in want.choices]
    assert finish == [c.finish_reason for c in want.choices]


def test_exact_mode_concurrent_http_requests_equal_solo_runs(api, zmq):
    prompts = [f"Story number {i}: once upon a time" for i in range(4)]

    def one(i: int) -> list[int]:
        stream = api.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16 + 4 * i,
                                        temperature=0.8, seed=i, stream=True,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        return [t for chunk in stream for c in chunk.choices for t in c.model_extra["token_ids"]]

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, range(len(prompts))))
    for i, got in enumerate(together):
        solo = zmq.generate(prompts[i], max_tokens=16 + 4 * i, temperature=0.8, seed=i,
                            ignore_eos=True)
        assert got == solo.token_ids, f"request {i}"


# ---- clients that go away ------------------------------------------------------------------


def aborted(status: dict) -> int:
    return status["errors"].get("aborted", 0)


def test_a_dropped_stream_is_aborted_and_its_pages_freed(cluster, zmq):
    """No SSE comment is written to notice the client going away, nor any by default."""
    before = aborted(wait_idle(zmq))
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "stream": True,
                       "ignore_eos": True})
    conn = connect(cluster)
    conn.request("POST", "/v1/completions", body=body, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    lines = [r.readline() for _ in range(10)]  # 5 events, each a line and a blank one
    assert [line[:6] for line in lines] == [b"data: ", b"\n"] * 5
    assert pages_used(zmq) > 0
    conn.close()  # mid-stream
    assert aborted(wait_idle(zmq)) == before + 1


def test_a_chat_past_every_limit_fails_alone_beside_four_streams(api, zmq):
    """400,000 emoji in a chat without a token limit (1.6 MB: over a million token ids): it
    gets its own too_long, and four streams on the same frontend run to their end."""
    got: dict = {}

    def stream(i: int) -> None:
        chunks = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stream=True,
                                        extra_body={"ignore_eos": True})
        got[i] = sum(len(c.choices[0].text) > 0 for c in chunks if c.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "\U0001F600" * 400_000}])
    assert e.value.body["code"] == "too_long", e.value.body
    for t in threads:
        t.join(600)
    assert sorted(got) == [0, 1, 2, 3] and all(got.values()), got
    wait_idle(zmq)


def test_a_multi_prompt_call_refused_part_way_leaves_nothing_running(api, zmq):
    """2,000 prompts of 64 choices each: past the client's queue bound the call is refused, and
    every request of it that was admitted is aborted with it (the give-up is 30 s: what this
    rules out ran for 85 s)."""
    wait_idle(zmq)
    with pytest.raises(openai.APIStatusError) as e:
        api.completions.create(model=MODEL, prompt=[[1, 2, 3]] * 2000, n=64, max_tokens=16)
    assert e.value.status_code == 503 and "overloaded" in str(e.value.body), e.value.body
    deadline = time.monotonic() + 30
    while (s := zmq.status())["requests"]["waiting"] or s["requests"]["running"]:
        assert time.monotonic() < deadline, s["requests"]
        time.sleep(0.1)
    wait_idle(zmq)


def test_a_client_that_hangs_up_on_a_whole_response_is_aborted(cluster, zmq):
    before = aborted(wait_idle(zmq))
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4000,
                       "ignore_eos": True}).encode()
    url = urlsplit(cluster.http)
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while pages_used(zmq) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert aborted(wait_idle(zmq)) == before + 1


# ---- bad input -----------------------------------------------------------------------------


BAD = [
    ("malformed JSON", b'{"model": "smollm2-135m", "prompt": ', {}, 400, "invalid_json"),
    ("not an object", b"[1, 2, 3]", {}, 400, "invalid_request"),
    ("wrong type", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, {}, 400,
     "invalid_request"),
    ("bool as number", {"model": MODEL, "prompt": "x", "temperature": True}, {}, 400,
     "invalid_request"),
    ("unknown field", {"model": MODEL, "prompt": "x", "max_tokenz": 3}, {}, 400,
     "invalid_request"),
    ("no prompt", {"model": MODEL}, {}, 400, "invalid_request"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, {}, 400, "invalid_request"),
    ("negative token", {"model": MODEL, "prompt": [1, -2]}, {}, 400, "invalid_request"),
    ("token past the vocabulary", {"model": MODEL, "prompt": [10 ** 9]}, {}, 400,
     "invalid_request"),
    ("n too large", {"model": MODEL, "prompt": "x", "n": 1000}, {}, 400, "invalid_request"),
    ("prompt past the context", {"model": MODEL, "prompt": [1] * 9000}, {}, 400, "too_long"),
    ("wrong model", {"model": "gpt-4", "prompt": "x"}, {}, 404, "model_not_found"),
    ("logprobs", {"model": MODEL, "prompt": "x", "logprobs": 2}, {}, 400, "unsupported"),
    ("penalty", {"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, {}, 400,
     "unsupported"),
    ("no key", {"model": MODEL, "prompt": "x"}, {"Authorization": ""}, 401, "invalid_api_key"),
    ("wrong key", {"model": MODEL, "prompt": "x"}, {"Authorization": "Bearer nope"}, 401,
     "invalid_api_key"),
    ("huge body", b'{"model": "' + b"x" * (40 << 20) + b'"}', {}, 413, "request_too_large"),
]


def test_bad_input_gets_its_status_and_error_shape_and_others_are_served(cluster, api, zmq):
    want = zmq.generate(PROMPT, max_tokens=48, temperature=0.0, ignore_eos=True)
    got: dict = {}
    started = threading.Event()

    def well_formed() -> None:
        started.set()
        got["r"] = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48,
                                          temperature=0.0, extra_body={"ignore_eos": True,
                                                                       "return_token_ids": True})

    t = threading.Thread(target=well_formed)
    t.start()
    started.wait()
    for name, body, headers, status, code in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = post(cluster, "/v1/completions", raw, headers)
        assert r.status_code == status, (name, r.json)
        err = r.json["error"]
        assert set(err) == {"message", "type", "param", "code"}, name
        assert err["code"] == code and err["message"], (name, err)
    t.join(600)
    assert got["r"].choices[0].model_extra["token_ids"] == want.token_ids


def test_bad_chat_input(cluster):
    for body, status, code in [
        ({"model": MODEL, "messages": []}, 400, "invalid_request"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
         "invalid_request"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400,
         "unsupported"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True},
         400, "unsupported"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream_options":
          {"include_usage": True}}, 400, "invalid_request"),
    ]:
        r = post(cluster, "/v1/chat/completions", json.dumps(body))
        assert r.status_code == status, (body, r.json)
        assert r.json["error"]["code"] == code


def test_unknown_routes_and_methods_get_openai_errors(cluster):
    r = request(cluster, "GET", "/v1/nothing")
    assert r.status_code == 404 and r.json["error"]["code"] == "not_found"
    r = request(cluster, "GET", "/v1/completions")
    assert r.status_code == 405 and r.json["error"]["code"] == "method_not_allowed"


def test_models_and_health(cluster, api):
    models = api.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 8192
    r = request(cluster, "GET", "/health", headers={"Authorization": ""})  # probes carry none
    assert r.status_code == 200 and r.json["status"] == "ok"
    assert request(cluster, "GET", "/v1/models", headers={"Authorization": ""}).status_code == 401


def test_the_key_is_not_in_status(zmq):
    assert "api_key" not in zmq.status()["config"] and KEY not in str(zmq.status())


def test_a_restarted_frontend_serves_http_on_the_same_port(cluster, api, zmq):
    import os
    import signal

    (frontend,) = zmq.status()["frontends"]
    os.kill(frontend["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        try:
            r = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0)
            break
        except openai.APIConnectionError:  # nobody accepts until the new frontend does
            assert time.monotonic() < deadline, "the API did not come back"
            time.sleep(0.2)
    assert r.usage.completion_tokens == 4
    with Client(cluster.endpoint, timeout=60) as c:  # the ZeroMQ endpoint is back too
        (again,) = c.status()["frontends"]
    assert again["restarts"] == 1 and again["pid"] != frontend["pid"]


def test_health_is_503_while_a_worker_is_down_and_200_once_it_is_back(cluster, zmq):
    """Last on `cluster`: it kills the worker."""
    import os
    import signal

    os.kill(zmq.status()["workers"][0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (r := request(cluster, "GET", "/health")).status_code == 200:
        assert time.monotonic() < deadline, "still healthy with its worker dead"
        time.sleep(0.1)
    assert r.status_code == 503 and r.json["status"] == "unavailable" and r.json["reason"]
    deadline = time.monotonic() + 120
    while (r := request(cluster, "GET", "/health")).status_code != 200:
        assert time.monotonic() < deadline, f"not healthy again: {r.json}"
        time.sleep(0.2)


# ---- SSE comments, refusals counted, a stop (a cluster of one sequence at a time) ----------


@pytest.fixture(scope="module")
def tiny(launch):
    return launch("--model", "synthetic:tiny", "--http", "127.0.0.1:0", "--max-batch-seqs", "1",
                  "--sse-keepalive", "0.001", "--http-timeout", "1")


@pytest.fixture(scope="module")
def tiny_zmq(tiny):
    with Client(tiny.endpoint, timeout=600) as c:
        yield c


def tiny_model(tiny) -> str:
    return request(tiny, "GET", "/v1/models").json["data"][0]["id"]


def stream_lines(tiny, body: dict):
    """An open streaming response of `tiny`, read line by line."""
    conn = connect(tiny)
    conn.request("POST", "/v1/completions", body=json.dumps({"stream": True, **body}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def wait_running(zmq, running: int, waiting: int) -> None:
    deadline = time.monotonic() + 30
    while (s := zmq.status()["requests"])["running"] != running or s["waiting"] != waiting:
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def test_sse_keepalive_comments_a_stream_that_waits_only_when_asked(tiny, tiny_zmq):
    """`--sse-keepalive`: a stream queued behind another hears comments until its tokens come;
    the same stream on `cluster`, without the flag, hears none (above). The one ahead runs to
    the context's end unless its client goes, which it does once the queued stream has heard a
    comment: an order, whatever the machine's speed."""
    model = tiny_model(tiny)
    first, r1 = stream_lines(tiny, {"model": model, "prompt": [1, 2, 3], "max_tokens": 4000,
                                    "ignore_eos": True})
    r1.readline()  # its first token: it runs, and the next one waits behind it
    second, r2 = stream_lines(tiny, {"model": model, "prompt": [4, 5], "max_tokens": 2,
                                     "ignore_eos": True})
    lines = []
    while (line := r2.readline()) != b"data: [DONE]\n":
        lines.append(line)
        if line.startswith(b":") and first is not None:
            first.close()  # heard while waiting: the one ahead is aborted, and this one runs
            first = None
    second.close()
    events = [line for line in lines if line.startswith(b"data: ")]
    comments = [line for line in lines if line.startswith(b":")]
    assert first is None, "the queued stream heard no comment while it waited"
    assert len(events) + len(comments) == len(lines) - lines.count(b"\n")
    assert set(comments) == {b": keepalive\n"}
    assert lines.index(comments[0]) < lines.index(events[0])
    assert b'"finish_reason":"length"' in events[-1] and not any(b'"error"' in e for e in events)
    wait_idle(tiny_zmq)


def test_connections_idle_before_a_request_are_closed_and_a_prompt_one_is_served(tiny):
    """`--http-timeout 1`: 20 connections that send nothing, or half a request's headers, are
    closed by the server (each read returns the end of the stream, not the 60 s give-up); one
    made beside them that asks at once is answered."""
    url = urlsplit(tiny.http)
    idle = [socket.create_connection((url.hostname, url.port), timeout=60) for _ in range(20)]
    for s in idle[10:]:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # and no blank line
    assert request(tiny, "GET", "/v1/models").status_code == 200
    for s in idle:
        with s:
            assert s.recv(1024) == b""


def test_http_refusals_are_counted_as_zeromq_ones(tiny, tiny_zmq):
    """Refused by the HTTP layer (unsupported, bad JSON, a wrong model) or by the frontend
    (too long): each counts once in status's errors, which are siding_request_errors_total."""
    model = tiny_model(tiny)
    before = tiny_zmq.status()["errors"]
    refusals = [
        ({"model": model, "prompt": "x", "logprobs": 2}, "unsupported"),
        ({"model": model, "prompt": "x", "presence_penalty": 1.0}, "unsupported"),
        ({"model": "gpt-4", "prompt": "x"}, "model_not_found"),
        (b"{", "invalid_json"),
        ({"model": model, "prompt": [1] * 100_000}, "too_long"),
    ]
    for body, code in refusals:
        r = post(tiny, "/v1/completions", body if isinstance(body, bytes) else json.dumps(body))
        assert r.json["error"]["code"] == code
    want = {**before, "unsupported": before.get("unsupported", 0) + 2,
            "invalid_request": before.get("invalid_request", 0) + 2,
            "too_long": before.get("too_long", 0) + 1}
    deadline = time.monotonic() + 30  # a frontend reports its counts every second
    while sum((errors := tiny_zmq.status()["errors"]).values()) < sum(want.values()):
        assert time.monotonic() < deadline, errors
        time.sleep(0.1)
    assert errors == want


def test_a_stop_fails_http_requests_with_503_aborted(tiny, tiny_zmq):
    """Last in this module: it stops `tiny`. A request cut off by the server's stop is the
    server's error (503, server_error), whole or streamed, not the client's."""
    model = tiny_model(tiny)
    stream, r = stream_lines(tiny, {"model": model, "prompt": [1, 2, 3], "max_tokens": 4000,
                                    "ignore_eos": True})
    r.readline()
    whole: dict = {}
    body = json.dumps({"model": model, "prompt": [4, 5], "max_tokens": 10, "ignore_eos": True})
    t = threading.Thread(target=lambda: whole.update(r=post(tiny, "/v1/completions", body)))
    t.start()
    wait_running(tiny_zmq, 1, 1)
    tiny.proc.send_signal(signal.SIGINT)  # drain: the stream would run for a long while
    deadline = time.monotonic() + 30
    while not any("draining" in line for line in tiny.stderr):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    tiny.proc.send_signal(signal.SIGINT)  # and stop now: what runs is aborted
    t.join(60)
    lines = []
    while (line := r.readline()) not in (b"data: [DONE]\n", b""):
        lines.append(line)
    stream.close()
    assert whole["r"].status_code == 503
    assert whole["r"].json["error"]["type"] == "server_error"
    assert whole["r"].json["error"]["code"] == "aborted"
    (error,) = [json.loads(x[6:])["error"] for x in lines if x.startswith(b'data: {"error"')]
    assert error["type"] == "server_error" and error["code"] == "aborted"
    assert line == b"data: [DONE]\n"
