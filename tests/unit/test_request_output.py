"""A frontend's request output: the streamed chunks and the result's text are what a plain
reading of the whole text gives (stop strings found wherever they straddle tokens, the text
that could still begin one held back), for long outputs too, streamed or not."""

from __future__ import annotations

import random

import msgpack
import pytest
from helpers.codec import codec

from coordinator import output
from coordinator.output import RequestOutput
from coordinator.text import Detokenizer, find_stop
from protocol.messages import Generate
from protocol.sampling import SamplingParams


def reference(c, prompt: list[int], tokens: list[int], stop: list[str]
              ) -> tuple[list[str], str, str | None]:
    """Each token's streamed text and the final text, from the whole text each token: the
    frontend's logic before its text was kept in pieces (it copied the text every token)."""
    detok, text, sent, chunks = Detokenizer(c, prompt), "", 0, []
    hold = max((len(s) for s in stop), default=1) - 1
    for t in tokens:
        searched = len(text)
        text += detok.push(t)
        cut = find_stop(text, stop, searched) if stop else None
        if cut is not None:
            text = text[:cut]
            chunks.append(text[sent:])
            return chunks, text, "stop"
        upto = max(sent, len(text) - hold)
        chunks.append(text[sent:upto])
        sent = upto
    chunks.append(text[sent:])  # the last chunk, once the core ends the choice
    return chunks, text, "length"


@pytest.mark.parametrize("settle_chars", [3, output.SETTLE_CHARS])
@pytest.mark.parametrize("stream", [True, False])
def test_long_outputs_with_stop_strings(stream: bool, settle_chars: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "SETTLE_CHARS", settle_chars)  # 3: settles every few tokens
    c = codec("smollm2-135m")
    rng = random.Random(7)
    words = "Héllo wörld 你好 🎉 the cat sat, on the mat. Ça va? def f(x): return x".split(" ")
    stops = ["zebra crossing", "Zürich 🦓", "q!q"]  # none of the words make them
    for trial in range(24):
        text = [rng.choice(words) for _ in range(rng.randrange(200, 1500))]
        if trial % 4:  # one stop string, somewhere past the first settle
            text.insert(rng.randrange(50, len(text)), rng.choice(stops))
        ids = c.tokenizer.encode(" ".join(text), add_special_tokens=False).ids
        prompt, tokens = ids[:3], ids[3:]
        stop = [] if trial % 8 == 0 else rng.sample(stops, 2) + ["tail"][:trial % 2]
        chunks, want, reason = reference(c, prompt, tokens, stop)
        out = RequestOutput(0, b"client", Generate(request_id="r", prompt_token_ids=prompt,
                                                   sampling=SamplingParams(stop=stop),
                                                   stream=stream), prompt, c)
        got_chunks = []
        for t in tokens:
            stopped = out.add_token(0, t, False)
            if stream:
                got_chunks += [msgpack.unpackb(h)["text"] for h in out.chunks()]
            if stopped:
                break
        out.end(0, "length", 0)
        if stream:
            got_chunks += [msgpack.unpackb(h)["text"] for h in out.chunks()]
            assert got_chunks == chunks[:len(got_chunks)] and "".join(got_chunks) == want
        result = out.result().choices[0]
        assert (result.text, result.finish_reason) == (want, reason)
        kept = out.choices[0]  # the text is settled, in few strings
        assert len(kept.tail) < 300 + settle_chars and len(kept.pieces) < output.JOIN_PIECES
        assert len(kept.settled) <= len(tokens) // output.JOIN_PIECES
