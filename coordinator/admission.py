"""What a request must pass on its frontend before it is submitted: a tokenizable prompt, ids
the model knows, and a size that can ever fit the model's context and the KV pool."""

from __future__ import annotations

from array import array

import msgspec
import numpy as np

from protocol.errors import ErrorCode, RequestError
from protocol.messages import Generate, ModelInfo

from .page_allocator import pages_for
from .text import TextCodec


def prompt_ids(msg: Generate, codec: TextCodec) -> list[int] | array:
    """The prompt's token ids: the request's own (an array("I") when they came as its frame,
    kept so: `Submit` sends its bytes on), or its text or chat tokenized."""
    if msg.prompt_token_ids is not None:
        ids = msg.prompt_token_ids
        return ids if isinstance(ids, array) else list(ids)
    try:
        if msg.messages is not None:
            chat = [msgspec.structs.asdict(m) for m in msg.messages]
            return codec.encode(codec.render_chat(chat), bos=False)
        return codec.encode(msg.prompt)
    except Exception as e:  # a template or tokenizer error is the request's fault
        raise RequestError(ErrorCode.INVALID_REQUEST,
                           f"cannot tokenize the prompt: {e}") from None


def check_fits(prompt: list[int] | array, msg: Generate, model: ModelInfo, kv_pages: int,
               page_size: int) -> None:
    """`too_long` for a request that can never run, whatever else is running."""
    if largest(prompt) >= model.vocab_size:
        raise RequestError(ErrorCode.INVALID_REQUEST,
                           f"token ids must be below the vocabulary size {model.vocab_size}")
    ctx = model.max_context
    if len(prompt) >= ctx:
        raise RequestError(ErrorCode.TOO_LONG, f"the prompt has {len(prompt)} tokens; "
                           f"the model's context is {ctx}")
    need = pages_for(min(len(prompt) + msg.sampling.max_tokens, ctx), page_size)
    if need > kv_pages:
        raise RequestError(
            ErrorCode.TOO_LONG,
            f"{len(prompt)} prompt tokens + max_tokens {msg.sampling.max_tokens} need {need} KV "
            f"pages; the pool has {kv_pages}")


def largest(ids: list[int] | array) -> int:
    """The largest id (0 for none); an array("I")'s in one vectorised pass."""
    if isinstance(ids, array):
        return int(np.frombuffer(ids, np.uint32).max()) if len(ids) else 0
    return max(ids, default=0)


def prompt_bytes(ids: list[int] | array) -> bytes:
    """A checked prompt as SUBMIT's raw frame of int32 ids (an array("I")'s bytes are those)."""
    return ids.tobytes() if isinstance(ids, array) else array("i", ids).tobytes()
