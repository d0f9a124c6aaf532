"""A frontend's `TextCodec` for a model spec, built as the frontend builds it from READY."""

from __future__ import annotations

from coordinator.text import TextCodec
from protocol.messages import ModelInfo
from worker.loaders import resolve


def codec(spec: str) -> TextCodec:
    t = resolve(spec).tokenizer
    return TextCodec(ModelInfo(spec, 1, 1, 1, t.tokenizer_json, t.chat_template, t.bos_id,
                               t.add_bos, t.eos_ids))
