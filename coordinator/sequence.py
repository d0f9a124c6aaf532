"""Requests and their sequences: token and page bookkeeping, no tensors."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol.messages import Generate

from .text import Detokenizer


@dataclass(eq=False)
class Request:
    id: str
    client: bytes  # the client's ROUTER identity
    params: Generate
    prompt_ids: list[int]
    arrival: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    scheduled_time: float | None = None
    last_keepalive: float = 0.0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    id: int
    request: Request
    index: int  # choice index within its request
    token_ids: list[int]  # prompt, then generated tokens
    seed: int
    detok: Detokenizer
    n_prompt: int = 0
    n_computed: int = 0  # positions whose K/V the workers hold
    pages: list[int] = field(default_factory=list)
    park_slots: list[int] = field(default_factory=list)  # where its pages wait while parked
    fork_at: int | None = None  # n > 1: stop the prompt here and hand its pages to `children`
    children: list[Sequence] = field(default_factory=list)
    pages_sent: int = 0  # leading entries of `pages` the workers already hold
    in_flight: bool = False
    announced: bool = False  # the workers know its sampling parameters
    finish_reason: str | None = None
    preemptions: int = 0
    text: str = ""  # generated text so far, stop strings cut
    sent_text: int = 0  # characters of `text` already streamed
    sent_tokens: int = 0  # generated tokens already streamed
    final_sent: bool = False  # its last chunk is out

    def __post_init__(self) -> None:
        self.n_prompt = len(self.token_ids)

    @property
    def n_remaining(self) -> int:
        """Rows to compute before the next token can be sampled."""
        return len(self.token_ids) - self.n_computed

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.n_prompt:]

    @property
    def priority(self) -> int:
        return self.request.params.priority
