"""The engine core's requests and sequences: token and page bookkeeping, no text, no tensors.

A `Request` is what a frontend submitted (token ids and sampling options); each of its `n`
choices is a `Sequence`. Only the scheduler changes a sequence's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import Submit


@dataclass(eq=False, slots=True)
class Request:
    frontend: int  # the frontend that submitted it
    key: int  # that frontend's name for it
    params: Submit
    prompt_ids: list[int]
    arrival: float  # time.monotonic() when its frontend received it
    client: str = ""  # who sent it, for the fair queue and the per-client bound
    prompt_bytes: bytes = b""  # `prompt_ids` as int32, as its SUBMIT brought them
    seqs: list[Sequence] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    scheduled_time: float | None = None
    # Tokens that end a choice: the model's EOS (unless ignored) and the request's stop ids.
    stop_ids: frozenset[int] = frozenset()

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass(eq=False, slots=True)
class Sequence:
    id: int
    request: Request
    index: int  # choice index within its request
    token_ids: list[int]  # prompt, then generated tokens
    seed: int
    n_prompt: int = 0
    n_computed: int = 0  # positions whose K/V the workers hold
    pages: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)  # the prefix cache's keys of full pages
    park_slots: list[int] = field(default_factory=list)  # where its pages wait while parked
    fork_at: int | None = None  # n > 1: stop the prompt here and hand its pages to `children`
    children: list[Sequence] = field(default_factory=list)
    pages_sent: int = 0  # leading entries of `pages` the workers already hold
    # Of the steps in flight: the rows they hold of it past `n_computed`, and the tokens they
    # sample for it, which the scheduler may plan its next row on before it knows them.
    rows_ahead: int = 0
    tokens_ahead: int = 0
    epoch: int = 0  # bumped when its KV is dropped: results of steps planned before are stale
    announced: bool = False  # the workers know its sampling parameters
    finish_reason: str | None = None
    preemptions: int = 0
    tag: int = 0  # its request's place in the fair queue (Scheduler.add_request)

    def __post_init__(self) -> None:
        self.n_prompt = len(self.token_ids)

    @property
    def in_flight(self) -> bool:
        return self.rows_ahead > 0

    @property
    def next_position(self) -> int:
        """Where its next row goes: past the rows computed and those in flight."""
        return self.n_computed + self.rows_ahead

    @property
    def n_remaining(self) -> int:
        """Rows to compute, past those in flight, before the next token can be sampled."""
        return len(self.token_ids) + self.tokens_ahead - self.next_position

    @property
    def n_generated(self) -> int:
        return len(self.token_ids) - self.n_prompt

    @property
    def priority(self) -> int:
        return self.request.params.priority
