"""Tokenizers built from GGUF metadata and for synthetic models."""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from worker.loaders import resolve
from worker.tokenizer import byte_level_tokenizer

TEXTS = [
    "Hello, world!",
    "12345",
    "The year 2024 had 366 days.",
    "héllo wörld 你好",
    "def add(a, b):\n    return a + b  # sum\n",
    "a   b\n\n\n\tc    ",
    "<|im_start|>user",
    "<|im_start|>user\nIt's fine, isn't it?<|im_end|>\n",
    "emoji 🙂 and ümlauts",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def info():
    return resolve("smollm2-135m").tokenizer


@pytest.fixture(scope="module")
def tokenizer(info) -> Tokenizer:
    return Tokenizer.from_str(info.tokenizer_json)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers_gguf_tokenizer(tokenizer, hf_reference, text):
    ours = tokenizer.encode(text, add_special_tokens=False).ids
    assert ours == hf_reference.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_known_ids(tokenizer):
    assert tokenizer.encode("12345", add_special_tokens=False).ids == [33, 34, 35, 36, 37]
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False).ids == [1, 4093]
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 49152


def test_control_tokens_are_special(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False).ids
    assert ids == [1, 6004, 2]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_like_transformers(info, hf_reference, messages):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    ours = env.from_string(info.chat_template).render(messages=messages, add_generation_prompt=True)
    theirs = hf_reference.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


def test_byte_level_tokenizer_for_synthetic_models():
    info = byte_level_tokenizer(512)
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 512
    assert tokenizer.encode("hé", add_special_tokens=False).ids == [0x68, 0xC3, 0xA9]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False).ids == [258]
    assert (info.bos_id, info.eos_ids, info.add_bos) == (None, [258, 256], False)
    text = "<|im_start|>user\nnaïve 你好<|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    with pytest.raises(ValueError, match="at least 259"):
        byte_level_tokenizer(258)


def test_synthetic_chat_template_renders_chatml():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    info = resolve("synthetic:tiny").tokenizer
    text = env.from_string(info.chat_template).render(
        messages=CONVERSATIONS[0], add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
