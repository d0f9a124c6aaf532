"""A request's sampling parameters: each option's default, bounds and meaning declared once, and
carried whole from the client (or the HTTP API's mapping) through the frontend and the engine
core to the worker that samples. A new option is a field here and the code that uses it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .errors import invalid

MAX_STOP_CHARS = 256  # characters in one stop string


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True,
                     omit_defaults=True):
    """How a request's tokens are drawn and when its choices end. The worker reads the first
    four; `seed` is each choice's own there (the engine core derives it)."""

    temperature: Annotated[float, Meta(ge=0.0, le=100.0, description="0: greedy")] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0, description="nucleus sampling mass")] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=1 << 24,
                               description="sample from the k likeliest (0: all)")] = 0
    seed: Annotated[int, Meta(ge=0, le=(1 << 63) - 1, description=(
        "sampling seed: the same seed gives the same tokens (none: a random one)"))] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=1 << 24, description=(
        "tokens to generate at most (a choice also ends at the model's context)"))] = 16
    n: Annotated[int, Meta(ge=1, le=64, description="completions of the prompt")] = 1
    stop: Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]], Meta(
        max_length=64, description="end a completion at this text (may be given several "
        "times)")] = []
    stop_token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(
        max_length=1024, description="end a completion at this token id (may be given several "
        "times)")] = []
    ignore_eos: Annotated[bool, Meta(description=(
        "go on past the end-of-sequence token, up to max_tokens"))] = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sampling_params(**options: Any) -> SamplingParams:
    """Checked parameters from a caller's options: SamplingParams' fields, None for a default,
    `stop` also as one string. Raises ProtocolError naming the option."""
    if isinstance(options.get("stop"), str):
        options["stop"] = [options["stop"]]
    try:
        return msgspec.convert({k: v for k, v in options.items() if v is not None},
                               SamplingParams)
    except msgspec.ValidationError as e:
        raise invalid(e) from None
