"""Steps in groups (`--multi-step K`): the engine core plans K steps back to back, each on the
tokens of the one before it, and the worker answers the group at once. What a client gets is
byte for byte what it gets one step at a time: token ids, text, finish reasons and streamed
text, for a stop token and a stop string that land mid-group, lengths that are no multiple of K,
`n` choices, and (in exact mode) a crowd whose batch changes every few steps; only the chunks
are fewer, and a first token is not held for a group. A stream closed mid-group is aborted, and
the pool drains."""

from __future__ import annotations

import pytest
from helpers.cluster_tokens import MODEL, crowd, exact_crowd

from protocol import Client

STORY = "Write a short story about a lighthouse keeper."
REQUESTS = [
    {"prompt": STORY, "max_tokens": 7},  # no multiple of any group here
    {"prompt": "The capital of France is", "max_tokens": 13},
    {"prompt": "Once upon a time", "max_tokens": 9, "n": 3, "temperature": 0.8, "seed": 5},
    {"prompt_token_ids": list(range(100, 180)), "max_tokens": 5},
]


def served(endpoint: str) -> list:
    """Every choice's (token ids, text, finish reason) for REQUESTS, and for one that stops on
    its third token (a stop token id) and one that stops on a string of its 6th-8th tokens'
    text, each asked for whole and streamed (the streamed text and tokens joined)."""
    out = []
    with Client(endpoint, timeout=300) as c:
        story = c.generate(STORY, max_tokens=12, ignore_eos=True)
        third = story.token_ids[2]
        stop = story.text[len(c.generate(STORY, max_tokens=5, ignore_eos=True).text):][:6]
        asks = [*REQUESTS, {"prompt": STORY, "max_tokens": 12, "stop_token_ids": [third]},
                {"prompt": STORY, "max_tokens": 12, "stop": [stop]}]
        for kw in asks:
            done = c.generate(**kw, ignore_eos=True)
            out.append([(ch.token_ids, ch.text, ch.finish_reason) for ch in done.choices])
            chunks = list(c.stream(**kw, ignore_eos=True))
            streamed = {}
            for ch in chunks:
                ids, text, reason = streamed.get(ch.index, ([], "", None))
                streamed[ch.index] = (ids + ch.token_ids, text + ch.text, ch.finish_reason)
            out.append([streamed[i] for i in sorted(streamed)])
    return out


def chunk_sizes(endpoint: str) -> list[int]:
    """Tokens in each chunk of a stream sent alone."""
    with Client(endpoint, timeout=300) as c:
        return [len(ch.token_ids) for ch in c.stream(STORY, max_tokens=24, ignore_eos=True)]


@pytest.fixture(scope="module")
def reference(launch) -> list:
    c = launch(*MODEL)  # one step at a time
    out = served(c.endpoint)
    c.stop()
    return out


@pytest.mark.parametrize("flags", [
    ("--multi-step", "4"),
    # with a group planned on the one in flight too: two groups out at once
    ("--multi-step", "3", "--overlap", "on"),
])
def test_steps_in_groups_give_what_single_steps_give(launch, reference, flags):
    c = launch(*MODEL, *flags)
    assert served(c.endpoint) == reference
    # A group ends at the step of a first token, which comes alone, at once; then a group's
    # tokens reach the frontend in one message, so a stream's chunk carries several.
    sizes = chunk_sizes(c.endpoint)
    assert sizes[0] == 1 and max(sizes) > 1 and sum(sizes) == 24
    c.stop()


def test_steps_in_groups_keep_exact_mode_exact_for_a_crowd(launch):
    expected = exact_crowd(launch)
    c = launch(*MODEL, "--exact", "--multi-step", "4", "--max-batch-tokens", "16")
    assert crowd(c.endpoint) == expected
    c.stop()


def test_a_stream_closed_mid_group_is_aborted_and_the_pool_drains(launch):
    c = launch(*MODEL, "--multi-step", "8")
    with Client(c.endpoint, timeout=60) as client:
        stream = client.stream(STORY, max_tokens=200, ignore_eos=True)
        first = next(stream)
        stream.close()  # aborts it, rows of its group still planned
        after = client.generate("The capital of France is", max_tokens=6, ignore_eos=True)
        s = client.status()
    assert first.token_ids and len(after.token_ids) == 6
    assert s["pool"]["pages_used"] == 0
    assert s["requests"] == {"running": 0, "waiting": 0, "parked": 0}
    c.stop()


def test_a_layer_split_refuses_groups(launch):
    with pytest.raises(Exception, match="--multi-step needs one worker"):
        launch(*MODEL, "--workers", "2", "--multi-step", "2")
