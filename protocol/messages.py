"""Message types: one small dataclass per type byte, each field with its limits
(`schema.wire_field`), checked on decode by `protocol/schema.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

from .errors import ProtocolError
from .sampling import SamplingParams
from .schema import wire_field
from .worker_config import MAX_BUSY_POLL, WorkerConfig


class MsgType(IntEnum):
    # client -> coordinator
    GENERATE = 0x01
    ABORT = 0x02
    STATUS = 0x03
    # coordinator -> client
    CHUNK = 0x11
    RESULT = 0x12
    STATUS_REPLY = 0x13
    CHUNKS = 0x14  # several requests' chunks of one step, to a client that asked for them so
    ERROR = 0x1F
    # worker <-> coordinator
    REGISTER = 0x21
    ASSIGN = 0x22
    READY = 0x23
    HEARTBEAT = 0x24
    STEP = 0x25
    STEP_RESULT = 0x26
    STEP_ERROR = 0x27
    SHUTDOWN = 0x28
    RESET = 0x29  # coordinator -> a worker it does not (or no longer) count on: register again
    # worker -> next worker
    ACTIVATIONS = 0x31
    # frontend <-> engine core (a private ipc socket; token ids only, no text)
    FRONTEND_HELLO = 0x41
    SERVE = 0x42
    LISTENING = 0x43
    SUBMIT = 0x44
    CANCEL = 0x45
    OUTPUTS = 0x46
    REPORT = 0x47


MAX_ID = 128  # characters in a request id
MAX_TEXT = 1 << 20  # characters in a prompt or a chat message
MAX_TOKENS_LIST = 1 << 20  # token ids in one list
MAX_LIST = 1 << 16  # items in any other list
MAX_PRIORITY = 1000  # priorities are in [-1000, 1000]; higher runs first and is preempted last


# ---- client <-> coordinator -------------------------------------------------------------------


@dataclass(slots=True)
class ChatMessage:
    role: str = wire_field(max_len=64)
    content: str = wire_field(max_len=MAX_TEXT)


@dataclass(slots=True)
class Generate:
    TYPE: ClassVar[MsgType] = MsgType.GENERATE
    request_id: str = wire_field(max_len=MAX_ID)
    prompt: str | None = wire_field(None, max_len=MAX_TEXT)
    # In the header as a list, or (what `wire.encode` sends) as the message's raw frame of
    # uint32 ids, which `wire.decode` gives as an array("I"): no per-id work on either side.
    prompt_token_ids: list[int] | None = wire_field(None, max_len=MAX_TOKENS_LIST)
    messages: list[ChatMessage] | None = wire_field(None, max_len=4096)
    sampling: SamplingParams = wire_field(SamplingParams())
    priority: int = wire_field(0, lo=-MAX_PRIORITY, hi=MAX_PRIORITY)
    stream: bool = wire_field(False)
    user: str | None = wire_field(None, max_len=256)  # whom the fair queue counts it for
    # the client reads CHUNKS: this request's chunks may come with others' of the same step in
    # one message (`build_generate` asks for it; a client that omits it gets CHUNK only)
    batched_chunks: bool = wire_field(False)

    def check(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ProtocolError("give exactly one of prompt, prompt_token_ids or messages")
        ids = self.prompt_token_ids
        if self.prompt == "" or (ids is not None and not len(ids)) or self.messages == []:
            raise ProtocolError("the prompt is empty")
        if self.messages is not None and (
                total := sum(len(m.content) for m in self.messages)) > MAX_TEXT:
            raise ProtocolError(f"field 'messages' holds {total} characters of content; the "
                                f"limit is {MAX_TEXT} in all")
        # an array("I") of ids (from a frame) holds none below 0
        if type(ids) is list and min(ids, default=0) < 0:
            raise ProtocolError("token ids must not be negative")


@dataclass(slots=True)
class Abort:
    TYPE: ClassVar[MsgType] = MsgType.ABORT
    request_id: str = wire_field(max_len=MAX_ID)


@dataclass(slots=True)
class Status:
    TYPE: ClassVar[MsgType] = MsgType.STATUS


@dataclass(slots=True)
class Chunk:
    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    request_id: str = wire_field(max_len=MAX_ID)
    index: int = wire_field(0, lo=0)
    token_ids: list[int] = wire_field([], max_len=MAX_TOKENS_LIST)
    text: str = wire_field("", max_len=MAX_TEXT)
    finish_reason: str | None = wire_field(None, max_len=32)  # set on a choice's last chunk


@dataclass(slots=True)
class Chunks:
    """One step's chunks for the requests of one client connection that set `batched_chunks`,
    in one message instead of one each: a frontend's and a client's cost per streamed token is
    mostly the message's, not its contents'."""
    TYPE: ClassVar[MsgType] = MsgType.CHUNKS
    chunks: list[Chunk] = wire_field([], max_len=MAX_LIST)


@dataclass(slots=True)
class Choice:
    index: int = wire_field(0, lo=0)
    token_ids: list[int] = wire_field([], max_len=MAX_TOKENS_LIST)
    text: str = wire_field("", max_len=1 << 26)
    finish_reason: str = wire_field("stop", max_len=32)
    preemptions: int = wire_field(0, lo=0)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = wire_field(0, lo=0)
    completion_tokens: int = wire_field(0, lo=0)


@dataclass(slots=True)
class Result:
    TYPE: ClassVar[MsgType] = MsgType.RESULT
    request_id: str = wire_field(max_len=MAX_ID)
    prompt_token_ids: list[int] = wire_field([], max_len=MAX_TOKENS_LIST)
    choices: list[Choice] = wire_field([], max_len=64)
    usage: Usage = field(default_factory=Usage)


@dataclass(slots=True)
class StatusReply:
    TYPE: ClassVar[MsgType] = MsgType.STATUS_REPLY
    status: dict = field(default_factory=dict)


@dataclass(slots=True)
class Error:
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: str = wire_field(max_len=32)
    message: str = wire_field(max_len=1 << 16)
    request_id: str | None = wire_field(None, max_len=MAX_ID)


# ---- coordinator <-> worker -------------------------------------------------------------------


@dataclass(slots=True)
class Register:
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    rank: int = wire_field(-1, lo=-1, hi=4095)  # -1: any rank
    device: str = wire_field("cpu", max_len=64)
    pid: int = wire_field(0, lo=0)
    hostname: str = wire_field("", max_len=256)
    data_endpoint: str = wire_field("", max_len=256)  # where this worker's activation PULL listens


@dataclass(slots=True)
class Assign:
    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    rank: int = wire_field(lo=0, hi=4095)
    n_workers: int = wire_field(lo=1, hi=4096)
    config: WorkerConfig = wire_field()
    next_endpoint: str | None = wire_field(None, max_len=256)
    layer_start: int | None = wire_field(None, lo=0)
    layer_end: int | None = wire_field(None, lo=0)
    metrics_port: int | None = wire_field(None, lo=0, hi=65535)


@dataclass(slots=True)
class ModelInfo:
    name: str = wire_field(max_len=4096)
    n_layers: int = wire_field(lo=1)
    vocab_size: int = wire_field(lo=1)
    max_context: int = wire_field(lo=1)
    tokenizer_json: str = wire_field(max_len=1 << 28)
    chat_template: str | None = wire_field(None, max_len=1 << 20)
    bos_id: int | None = wire_field(None, lo=0)
    add_bos: bool = wire_field(False)
    eos_ids: list[int] = wire_field([], max_len=64)


@dataclass(slots=True)
class Ready:
    TYPE: ClassVar[MsgType] = MsgType.READY
    rank: int = wire_field(lo=0)
    layer_start: int = wire_field(lo=0)
    layer_end: int = wire_field(lo=0)
    device: str = wire_field("cpu", max_len=64)
    kv_bytes_per_page: int = wire_field(0, lo=0)
    model: ModelInfo | None = wire_field(None)  # from rank 0 only


@dataclass(slots=True)
class Heartbeat:
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    rank: int = wire_field(lo=0)
    pid: int = wire_field(0, lo=0)  # a worker's, matched with its REGISTER (0: a frontend's)
    # a worker's forward passes so far (every stage's time shows in `status`; the last stage's
    # also comes with each STEP_RESULT)
    forward_seconds: float = wire_field(0.0, lo=0.0)
    steps: int = wire_field(0, lo=0)


@dataclass(slots=True)
class SeqPlan:
    """One sequence's part of a step: `n` tokens at positions start .. start+n-1."""

    id: int = wire_field(lo=0)
    start: int = wire_field(lo=0)
    n: int = wire_field(lo=1)
    pages_add: list[int] = wire_field([], max_len=MAX_LIST)  # appended to its page table first
    sample: bool = wire_field(False)  # sample a token after the last of the n positions
    # the first time the worker sees this sequence; its `seed` is the sequence's own
    sampling: SamplingParams | None = wire_field(None)
    # its one row's input is the token it sampled in its last step, which the coordinator has
    # not seen yet: the worker takes it from the device (the plan's token id is a placeholder)
    after: bool = wire_field(False)


@dataclass(slots=True)
class PageMove:
    """Park (`pages` -> park `slots`) or restore (`slots` -> `pages`) one sequence's KV. A
    restored sequence's page table is `kept` (pages that stayed resident: shared with another
    sequence when it was parked, or found in the prefix cache since) then `pages`; `slots`
    restored are the last of those its park filled."""

    id: int = wire_field(lo=0)
    pages: list[int] = wire_field([], max_len=MAX_LIST)
    slots: list[int] = wire_field([], max_len=MAX_LIST)
    kept: list[int] = wire_field([], max_len=MAX_LIST)


@dataclass(slots=True)
class PageCopy:
    """Copy one page into another (the copy-on-write tail of a forked prompt)."""

    src: int = wire_field(lo=0)
    dst: int = wire_field(lo=0)


@dataclass(slots=True)
class Step:
    """A step, applied in this order: free, park, restore, copies, then the sequences' rows.
    On the wire as columns (protocol/step_frames.py), not as this map."""

    TYPE: ClassVar[MsgType] = MsgType.STEP
    step: int = wire_field(lo=0)
    seqs: list[SeqPlan] = wire_field([], max_len=MAX_LIST)
    token_ids: list[int] = wire_field([], max_len=MAX_TOKENS_LIST)  # sum of seqs' n, in order
    free: list[int] = wire_field([], max_len=MAX_LIST)  # sequences to forget before this step
    park: list[PageMove] = wire_field([], max_len=MAX_LIST)
    restore: list[PageMove] = wire_field([], max_len=MAX_LIST)  # sets the sequence's page table
    copies: list[PageCopy] = wire_field([], max_len=MAX_LIST)
    # the worker keeps this step's result until that of a later step that does not hold: the
    # engine core hears of a group of steps (--multi-step) in one wake
    hold: bool = wire_field(False)


@dataclass(slots=True)
class StepResult:
    TYPE: ClassVar[MsgType] = MsgType.STEP_RESULT
    step: int = wire_field(lo=0)
    seq_ids: list[int] = wire_field([], max_len=MAX_LIST)
    tokens: list[int] = wire_field([], max_len=MAX_LIST)
    forward_seconds: float = wire_field(0.0, lo=0.0)
    park_seconds: float = wire_field(0.0, lo=0.0)  # parks and restores of this step, last stage


@dataclass(slots=True)
class StepError:
    TYPE: ClassVar[MsgType] = MsgType.STEP_ERROR
    step: int = wire_field(lo=0)
    code: str = wire_field(max_len=32)
    message: str = wire_field(max_len=1 << 16)
    seq_ids: list[int] = wire_field([], max_len=MAX_LIST)  # the sequences at fault; [] = the step


@dataclass(slots=True)
class Shutdown:
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN


@dataclass(slots=True)
class Reset:
    """The coordinator is regrouping its workers (one was lost, or it does not know this one:
    it restarted, or this worker was cut off): drop everything and register again."""

    TYPE: ClassVar[MsgType] = MsgType.RESET
    reason: str = wire_field("", max_len=512)


@dataclass(slots=True)
class Activations:
    """Hidden states of one step, [T, dim], in the single raw frame that follows."""

    TYPE: ClassVar[MsgType] = MsgType.ACTIVATIONS
    step: int = wire_field(lo=0)
    dtype: str = wire_field(max_len=16)
    shape: list[int] = wire_field([], max_len=8)


# ---- frontend <-> engine core ------------------------------------------------------------------
#
# A frontend turns client requests into token ids and token ids into text; the core sees only
# ids. Request keys are the frontend's own integers; the core names a request by (frontend, key).


@dataclass(slots=True)
class FrontendHello:
    TYPE: ClassVar[MsgType] = MsgType.FRONTEND_HELLO
    index: int = wire_field(lo=0, hi=4095)
    pid: int = wire_field(0, lo=0)


@dataclass(slots=True)
class Serve:
    """Core -> frontend, once the workers are ready: what a frontend needs to admit requests."""

    TYPE: ClassVar[MsgType] = MsgType.SERVE
    model: ModelInfo = field(default_factory=lambda: ModelInfo("", 1, 1, 1, ""))
    kv_pages: int = wire_field(1, lo=1)
    page_size: int = wire_field(1, lo=1)
    exact: bool = wire_field(False)  # the cluster runs in exact mode (HTTP responses say so)
    # seconds a frontend polls in a loop after a message (`--busy-poll`, as the core resolved
    # it against the workers' devices)
    busy_poll: float = wire_field(0.0, lo=0.0, hi=MAX_BUSY_POLL)


@dataclass(slots=True)
class Listening:
    TYPE: ClassVar[MsgType] = MsgType.LISTENING
    index: int = wire_field(lo=0, hi=4095)
    endpoint: str = wire_field(max_len=256)


@dataclass(slots=True)
class Submit:
    """A request as token ids; the prompt is the one raw frame (int32, `n_prompt` of them)."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    key: int = wire_field(0, lo=0)
    n_prompt: int = wire_field(1, lo=1, hi=MAX_TOKENS_LIST)
    sampling: SamplingParams = wire_field(SamplingParams())
    priority: int = wire_field(0, lo=-MAX_PRIORITY, hi=MAX_PRIORITY)
    arrival: float = wire_field(0.0)  # time.monotonic() when the frontend received it
    client: str = wire_field("", max_len=300)  # whom the fair queue counts it for


@dataclass(slots=True)
class Cancel:
    """Frontend -> core: stop a request's choice (`index`, or -1 for all of them), because a
    stop string ended it (`stop`) or its client aborted or went away (`abort`)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    key: int = wire_field(lo=0)
    index: int = wire_field(-1, lo=-1, hi=63)
    reason: str = wire_field("abort", max_len=16)


@dataclass(slots=True)
class Finished:
    """A choice the core has ended. `stop` from the core means a stop token (EOS or one of
    `stop_token_ids`): the choice's token in the same message is that token, not text."""

    key: int = wire_field(lo=0)
    index: int = wire_field(lo=0, hi=63)
    reason: str = wire_field(max_len=16)
    preemptions: int = wire_field(0, lo=0)


@dataclass(slots=True)
class Failed:
    key: int = wire_field(lo=0)
    code: str = wire_field(max_len=32)
    message: str = wire_field(max_len=1 << 16)


@dataclass(slots=True)
class Outputs:
    """Core -> frontend after a step: its tokens in one raw frame of int64 rows
    (key, index, token), `n_rows` of them, then the choices that ended and requests that
    failed."""

    TYPE: ClassVar[MsgType] = MsgType.OUTPUTS
    n_rows: int = wire_field(0, lo=0, hi=MAX_LIST)
    finished: list[Finished] = wire_field([], max_len=MAX_LIST)
    failed: list[Failed] = wire_field([], max_len=MAX_LIST)


@dataclass(slots=True)
class Report:
    """Frontend -> core: what only the frontend saw, for the core's metrics (counts since the
    last report)."""

    TYPE: ClassVar[MsgType] = MsgType.REPORT
    errors: dict = field(default_factory=dict)  # error code -> requests refused
    dropped: int = wire_field(0, lo=0)  # malformed client messages
    rejected: int = wire_field(0, lo=0)  # client connections refused by CURVE authentication


MESSAGES: dict[MsgType, type] = {
    cls.TYPE: cls
    for cls in (
        Generate, Abort, Status, Chunk, Chunks, Result, StatusReply, Error, Register, Assign, Ready,
        Heartbeat, Step, StepResult, StepError, Shutdown, Reset, Activations, FrontendHello,
        Serve, Listening, Submit, Cancel, Outputs, Report,
    )
}
# raw frames each type carries beside its fields (a STEP's frames are its fields' columns,
# decoded into the Step: protocol/step_frames.py)
FRAMES: dict[MsgType, int] = {MsgType.ACTIVATIONS: 1, MsgType.SUBMIT: 1, MsgType.OUTPUTS: 1}
