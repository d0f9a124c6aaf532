"""Large prompts are tokenized on a thread that takes clients in turn, gives the tokens the loop
would have given, honours cancellations, and bounds what one client may have waiting."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from coordinator.prompts import MAX_PER_CLIENT, PromptJob, PromptTokenizer
from coordinator.text import TextCodec
from protocol.errors import RequestError
from protocol.messages import ChatMessage, Generate, ModelInfo
from worker.loaders import resolve


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    t = resolve("smollm2-135m").tokenizer
    return ModelInfo("smollm2-135m", 1, 1, 8192, t.tokenizer_json, t.chat_template, t.bos_id,
                     t.add_bos, t.eos_ids)


@pytest.fixture
def prompts(model):
    ctx = zmq.Context()
    p = PromptTokenizer(ctx, model)
    yield p
    p.close()
    ctx.term()


def job(client: bytes, rid: str, **fields) -> PromptJob:
    return PromptJob(client, Generate(request_id=rid, **fields), arrival=0.0, last_sent=0.0)


def wait_for(prompts: PromptTokenizer, n: int) -> list[PromptJob]:
    done: list[PromptJob] = []
    deadline = time.monotonic() + 60
    while len(done) < n and time.monotonic() < deadline:
        if prompts.ready.poll(1000):
            done += prompts.finished()
    return done


def test_the_thread_gives_the_loops_tokens_and_takes_clients_in_turn(prompts, model):
    text = "The quick brown fox, 12345 times. " * 2000
    chat = [ChatMessage(role="user", content=text)]
    for rid in ("a1", "a2", "a3"):
        prompts.submit(job(b"A", rid, prompt=text))
    prompts.submit(job(b"B", "b1", messages=chat))
    done = wait_for(prompts, 4)
    order = [j.msg.request_id for j in done]
    assert sorted(order) == ["a1", "a2", "a3", "b1"] and order[-1] == "a3", order
    codec = TextCodec(model)
    by_id = {j.msg.request_id: j.prompt for j in done}
    assert by_id["a1"] == codec.encode(text) == by_id["a3"]
    assert by_id["b1"] == codec.encode(codec.render_chat([{"role": "user", "content": text}]),
                                       bos=False)
    assert prompts.pending == {}


def test_cancelled_jobs_are_dropped_and_errors_are_the_requests(model):
    ctx = zmq.Context()
    prompts = PromptTokenizer(ctx, msgspec.structs.replace(model, chat_template=None))
    try:
        prompts.submit(job(b"A", "keep", prompt="x" * 50_000))
        prompts.submit(job(b"A", "drop", prompt="y" * 50_000))
        prompts.submit(job(b"B", "bad", messages=[ChatMessage(role="user", content="hi")]))
        assert [j.msg.request_id for j in prompts.cancel(b"A", "drop")] == ["drop"]
        done = {j.msg.request_id: j for j in wait_for(prompts, 2)}
        assert sorted(done) == ["bad", "keep"] and done["keep"].prompt
        assert done["bad"].error.code == "invalid_request" and "chat template" in str(
            done["bad"].error)
        time.sleep(0.5)  # the cancelled one is done by now too, and stays out
        assert prompts.finished() == [] and prompts.pending == {}
    finally:
        prompts.close()
        ctx.term()


def test_one_client_may_have_only_so_many_large_prompts_waiting(prompts):
    for i in range(MAX_PER_CLIENT):
        prompts.submit(job(b"A", f"a{i}", prompt="z" * 50_000))
    with pytest.raises(RequestError) as e:
        prompts.submit(job(b"A", "one-more", prompt="z" * 50_000))
    assert e.value.code == "overloaded"
    prompts.submit(job(b"B", "b", prompt="z" * 50_000))  # another client's bound is its own
    assert len(prompts.cancel(b"A")) == MAX_PER_CLIENT and list(prompts.pending) == [(b"B", "b")]
