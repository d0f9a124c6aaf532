"""Text on the coordinator's side: tokenizer and chat template from the worker's READY, and
incremental detokenization with stop strings."""

from __future__ import annotations

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from protocol.messages import ModelInfo


class TextCodec:
    def __init__(self, info: ModelInfo):
        self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self.bos_id = info.bos_id
        self.add_bos = info.add_bos
        self.eos_ids = frozenset(info.eos_ids)
        self.template = None
        if info.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                               lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(info.chat_template)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
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
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(self, codec: TextCodec, prompt_ids: list[int]):
        self.codec = codec
        tail = prompt_ids[-4:]  # context so the first token's leading space decodes right
        self.ids = list(tail)
        self.prefix = 0
        self.read = len(tail)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.codec.decode(self.ids[self.prefix:self.read])
        after = self.codec.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
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
