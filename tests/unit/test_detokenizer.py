"""The frontend's incremental detokenizer gives the text siding's earlier one gave, byte for byte,
at a cost per token that does not grow with the output."""

from __future__ import annotations

import random

import pytest
from helpers.codec import codec

from coordinator.text import Detokenizer, TextCodec

TEXTS = ["Héllo wörld 你好世界 🎉🎉 emoji ñ", "def f(x):\n    return x**2  # ☃",
         "The capital of France is Paris. Ça va? Привет мир", "<|im_start|>user\nHi<|im_end|>"]


class WindowDetokenizer:
    """siding's detokenizer before the frontend split (the reference): two decodes a token of
    the window since the last whole character, which grows while tokens add no text."""

    def __init__(self, codec: TextCodec, prompt_ids: list[int]):
        self.codec = codec
        tail = prompt_ids[-4:]
        self.ids, self.prefix, self.read = list(tail), 0, len(tail)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.codec.decode(self.ids[self.prefix:self.read])
        after = self.codec.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


def cases(c: TextCodec, rng: random.Random, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, generated): texts split at random points (characters split across tokens,
    prompts that end inside a character) and random ids, special tokens among them."""
    vocab = c.tokenizer.get_vocab_size()
    out = []
    for i in range(n):
        if i % 2 == 0:
            ids = c.tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False).ids
            k = rng.randrange(1, len(ids))
            out.append((ids[:k], ids[k:] + ids))
        else:
            out.append(([rng.randrange(vocab) for _ in range(rng.randrange(1, 6))],
                        [rng.randrange(vocab) if rng.random() < 0.5 else rng.randrange(300)
                         for _ in range(40)]))
    return out


@pytest.mark.parametrize("spec", ["smollm2-135m", "synthetic:llama-1b"])
def test_text_is_byte_identical_to_the_window_detokenizer(spec):
    c = codec(spec)
    for prompt, generated in cases(c, random.Random(spec), 600):
        new, old = Detokenizer(c, prompt), WindowDetokenizer(c, prompt)
        pieces = [(new.push(t), old.push(t)) for t in generated]
        assert "".join(p for p, _ in pieces) == "".join(q for _, q in pieces), (prompt, generated)


def test_a_run_of_special_tokens_does_not_grow_what_is_decoded():
    c = codec("synthetic:llama-1b")
    special = sorted(c.special_ids)[-1]
    d = Detokenizer(c, [72, 105])
    for _ in range(10_000):
        assert d.push(special) == ""
    assert d.window is None  # streaming, not decoding a window
    assert d.push(33) == "!"


def test_a_prompt_ending_inside_a_character_streams_once_the_character_is_whole():
    c = codec("synthetic:tiny")
    snowman = list("☃".encode())  # byte-level ids are the bytes
    d = Detokenizer(c, [72, *snowman[:2]])
    assert d.window == []
    assert d.push(snowman[2]) == ""  # the old window drops the character, and so does this
    assert d.push(33) == "!"
    assert d.window is None
    assert d.push(snowman[0]) + d.push(snowman[1]) + d.push(snowman[2]) == "☃"
