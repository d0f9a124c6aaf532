"""What a request must pass on its frontend before it is submitted: a tokenizable prompt, ids
the model knows, and a size that can ever fit the model's context and the KV pool."""

from __future__ import annotations

from dataclasses import asdict

from protocol.errors import ErrorCode, RequestError
from protocol.messages import Generate, ModelInfo

from .page_allocator import pages_for
from .text import TextCodec


def prompt_ids(msg: Generate, codec: TextCodec) -> list[int]:
    if msg.prompt_token_ids is not None:
        return list(msg.prompt_token_ids)
    try:
        if msg.messages is not None:
            return codec.encode(codec.render_chat([asdict(m) for m in msg.messages]), bos=False)
        return codec.encode(msg.prompt)
    except Exception as e:  # a template or tokenizer error is the request's fault
        raise RequestError(ErrorCode.INVALID_REQUEST,
                           f"cannot tokenize the prompt: {e}") from None


def check_fits(prompt: list[int], msg: Generate, model: ModelInfo, kv_pages: int,
               page_size: int) -> None:
    """`too_long` for a request that can never run, whatever else is running."""
    if max(prompt, default=0) >= model.vocab_size:
        raise RequestError(ErrorCode.INVALID_REQUEST,
                           f"token ids must be below the vocabulary size {model.vocab_size}")
    ctx = model.max_context
    if len(prompt) >= ctx:
        raise RequestError(ErrorCode.TOO_LONG, f"the prompt has {len(prompt)} tokens; "
                           f"the model's context is {ctx}")
    need = pages_for(min(len(prompt) + msg.max_tokens, ctx), page_size)
    if need > kv_pages:
        raise RequestError(
            ErrorCode.TOO_LONG,
            f"{len(prompt)} prompt tokens + max_tokens {msg.max_tokens} need {need} KV "
            f"pages; the pool has {kv_pages}")
