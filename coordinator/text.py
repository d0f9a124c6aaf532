"""Text on a frontend's side: the tokenizer and chat template from the workers' READY, incremental
detokenization, and stop strings."""

from __future__ import annotations

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from protocol.messages import ModelInfo

CONTEXT = 4  # prompt ids a detokenizer starts from, so the first token's leading space is right


class TextCodec:
    def __init__(self, info: ModelInfo):
        self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self.bos_id = info.bos_id
        self.add_bos = info.add_bos
        self.eos_ids = frozenset(info.eos_ids)
        # Skipped when decoding, so they never change text: a detokenizer never holds them.
        self.special_ids = frozenset(
            i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)
        self.template = None
        if info.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                               lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(info.chat_template)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text`, with the model's BOS first if it wants one and `bos`. A batch of
        one, because `encode_batch` releases the GIL while it works and `encode` does not."""
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if bos and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        if self.template is None:
            raise ValueError("this model has no chat template")
        token = self.tokenizer.id_to_token
        return self.template.render(
            messages=messages, add_generation_prompt=True,
            bos_token=token(self.bos_id) if self.bos_id is not None else "",
            eos_token=token(min(self.eos_ids)) if self.eos_ids else "",
        )


def _raise(message: str) -> None:
    raise ValueError(message)


class Detokenizer:
    """Text deltas of a growing list of token ids that never split a character, at a constant
    cost per token: tokenizers' `DecodeStream`, which decodes only the ids since its last whole
    character, started after the prompt's last `CONTEXT` ids (so the first token's leading space
    decodes as it does mid-text). Special tokens decode to nothing and never enter it, so a run
    of them (a random model's usual output) does not grow what it decodes.

    A prompt that ends inside a character cannot start a stream: until the first text, such a
    detokenizer decodes the whole window after the prompt's ids, twice a token, as the stream
    would have (and siding before it did); then it streams.
    """

    def __init__(self, codec: TextCodec, prompt_ids: list[int]):
        self.tokenizer = codec.tokenizer
        self.special = codec.special_ids
        self.stream = DecodeStream(skip_special_tokens=True)
        self.context = [t for t in prompt_ids[-CONTEXT:] if t not in self.special]
        self.window: list[int] | None = None  # ids after `context` while there is no stream
        if self.context and self.stream.step(self.tokenizer, self.context) is None:
            self.window = []

    def push(self, token: int) -> str:
        if token in self.special:
            return ""
        if self.window is None:
            return self.stream.step(self.tokenizer, token) or ""
        self.window.append(token)
        before = self.tokenizer.decode(self.context, skip_special_tokens=True)
        after = self.tokenizer.decode(self.context + self.window, skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.stream = DecodeStream(skip_special_tokens=True)
            self.stream.step(self.tokenizer, self.window)  # whole characters: it takes them all
            self.window = None
            return after[len(before):]
        return ""


def find_stop(text: str, stops: list[str], searched: int) -> int | None:
    """Index where the earliest stop string begins, looking only at text past `searched`."""
    best = None
    for s in stops:
        i = text.find(s, max(0, searched - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
