"""Message types: one small msgspec Struct per type byte, each field's limits in its type
(`Meta`), checked as msgspec decodes a header into it (`protocol/wire.py`)."""

from __future__ import annotations

import datetime
from enum import IntEnum
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from .errors import ProtocolError
from .sampling import SamplingParams
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

Id = Annotated[str, Meta(max_length=MAX_ID)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Code = Annotated[str, Meta(max_length=32)]  # an error code, a finish reason
Why = Annotated[str, Meta(max_length=1 << 16)]  # an error's message
Address = Annotated[str, Meta(max_length=256)]  # an endpoint, a host name
Count = Annotated[int, Meta(ge=0)]  # ids, indices, steps, pids, counts
Positive = Annotated[int, Meta(ge=1)]
Rank = Annotated[int, Meta(ge=0, le=4095)]
Priority = Annotated[int, Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]
Seconds = Annotated[float, Meta(ge=0.0)]
Ints = Annotated[list[int], Meta(max_length=MAX_LIST)]
TokenIds = Annotated[list[int], Meta(max_length=MAX_TOKENS_LIST)]


class Wire(msgspec.Struct, forbid_unknown_fields=True):
    """What every message and the structs inside one are: a msgpack map of exactly its fields
    on the wire; an unknown field is refused, so a typo is an error, not an ignored knob."""


# ---- client <-> coordinator -------------------------------------------------------------------


class ChatMessage(Wire):
    role: Annotated[str, Meta(max_length=64)]
    content: Text


class Generate(Wire):
    TYPE: ClassVar[MsgType] = MsgType.GENERATE
    request_id: Id
    prompt: Text | None = None
    # In the header as a list, or (what `wire.encode` sends) as the message's raw frame of
    # uint32 ids, which `wire.decode` gives as an array("I"): no per-id work on either side.
    prompt_token_ids: TokenIds | None = None
    messages: Annotated[list[ChatMessage], Meta(max_length=4096)] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: Priority = 0
    stream: bool = False
    user: Address | None = None  # whom the fair queue counts it for
    # the client reads CHUNKS: this request's chunks may come with others' of the same step in
    # one message (`build_generate` asks for it; a client that omits it gets CHUNK only)
    batched_chunks: bool = False

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


class Abort(Wire):
    TYPE: ClassVar[MsgType] = MsgType.ABORT
    request_id: Id


class Status(Wire):
    TYPE: ClassVar[MsgType] = MsgType.STATUS


class Chunk(Wire):
    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    request_id: Id
    index: Count = 0
    token_ids: TokenIds = []
    text: Text = ""
    finish_reason: Code | None = None  # set on a choice's last chunk


class Chunks(Wire):
    """One step's chunks for the requests of one client connection that set `batched_chunks`,
    in one message instead of one each: a frontend's and a client's cost per streamed token is
    mostly the message's, not its contents'."""
    TYPE: ClassVar[MsgType] = MsgType.CHUNKS
    chunks: Annotated[list[Chunk], Meta(max_length=MAX_LIST)] = []


class Choice(Wire):
    index: Count = 0
    token_ids: TokenIds = []
    text: Annotated[str, Meta(max_length=1 << 26)] = ""
    finish_reason: Code = "stop"
    preemptions: Count = 0


class Usage(Wire):
    prompt_tokens: Count = 0
    completion_tokens: Count = 0


class Result(Wire):
    TYPE: ClassVar[MsgType] = MsgType.RESULT
    request_id: Id
    prompt_token_ids: TokenIds = []
    choices: Annotated[list[Choice], Meta(max_length=64)] = []
    usage: Usage = msgspec.field(default_factory=Usage)


class StatusReply(Wire):
    TYPE: ClassVar[MsgType] = MsgType.STATUS_REPLY
    status: dict[str, Any] = {}

    def __post_init__(self) -> None:
        stack: list[Any] = [self.status]
        while stack:  # not recursive: msgpack may nest past Python's recursion limit
            item = stack.pop()
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, (msgspec.msgpack.Ext, datetime.datetime)):  # a timestamp's
                raise ValueError(f"a msgpack extension type ({type(item).__name__}) in 'status'")


class Error(Wire):
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: Code
    message: Why
    request_id: Id | None = None


# ---- coordinator <-> worker -------------------------------------------------------------------


class Register(Wire):
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    rank: Annotated[int, Meta(ge=-1, le=4095)] = -1  # -1: any rank
    device: Annotated[str, Meta(max_length=64)] = "cpu"
    pid: Count = 0
    hostname: Address = ""
    data_endpoint: Address = ""  # where this worker's activation PULL listens


class Assign(Wire):
    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    rank: Rank
    n_workers: Annotated[int, Meta(ge=1, le=4096)]
    config: WorkerConfig
    next_endpoint: Address | None = None
    layer_start: Count | None = None
    layer_end: Count | None = None
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None


class ModelInfo(Wire):
    name: Annotated[str, Meta(max_length=4096)]
    n_layers: Positive
    vocab_size: Positive
    max_context: Positive
    tokenizer_json: Annotated[str, Meta(max_length=1 << 28)]
    chat_template: Annotated[str, Meta(max_length=1 << 20)] | None = None
    bos_id: Count | None = None
    add_bos: bool = False
    eos_ids: Annotated[list[int], Meta(max_length=64)] = []


class Ready(Wire):
    TYPE: ClassVar[MsgType] = MsgType.READY
    rank: Count
    layer_start: Count
    layer_end: Count
    device: Annotated[str, Meta(max_length=64)] = "cpu"
    kv_bytes_per_page: Count = 0
    model: ModelInfo | None = None  # from rank 0 only


class Heartbeat(Wire):
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    rank: Count
    pid: Count = 0  # a worker's, matched with its REGISTER (0: a frontend's)
    # a worker's forward passes so far (every stage's time shows in `status`; the last stage's
    # also comes with each STEP_RESULT)
    forward_seconds: Seconds = 0.0
    steps: Count = 0


class SeqPlan(Wire):
    """One sequence's part of a step: `n` tokens at positions start .. start+n-1."""

    id: Count
    start: Count
    n: Positive
    pages_add: Ints = []  # appended to its page table first
    sample: bool = False  # sample a token after the last of the n positions
    # the first time the worker sees this sequence; its `seed` is the sequence's own
    sampling: SamplingParams | None = None
    # its one row's input is the token it sampled in its last step, which the coordinator has
    # not seen yet: the worker takes it from the device (the plan's token id is a placeholder)
    after: bool = False


class PageMove(Wire):
    """Park (`pages` -> park `slots`) or restore (`slots` -> `pages`) one sequence's KV. A
    restored sequence's page table is `kept` (pages that stayed resident: shared with another
    sequence when it was parked, or found in the prefix cache since) then `pages`; `slots`
    restored are the last of those its park filled."""

    id: Count
    pages: Ints = []
    slots: Ints = []
    kept: Ints = []


class PageCopy(Wire):
    """Copy one page into another (the copy-on-write tail of a forked prompt)."""

    src: Count
    dst: Count


class Step(Wire):
    """A step, applied in this order: free, park, restore, copies, then the sequences' rows.
    On the wire as columns (protocol/step_frames.py), not as this map."""

    TYPE: ClassVar[MsgType] = MsgType.STEP
    step: Count
    seqs: Annotated[list[SeqPlan], Meta(max_length=MAX_LIST)] = []
    token_ids: TokenIds = []  # sum of seqs' n, in order
    free: Ints = []  # sequences to forget before this step
    park: Annotated[list[PageMove], Meta(max_length=MAX_LIST)] = []
    # a restore sets the sequence's page table
    restore: Annotated[list[PageMove], Meta(max_length=MAX_LIST)] = []
    copies: Annotated[list[PageCopy], Meta(max_length=MAX_LIST)] = []
    # the worker keeps this step's result until that of a later step that does not hold: the
    # engine core hears of a group of steps (--multi-step) in one wake
    hold: bool = False


class StepResult(Wire):
    TYPE: ClassVar[MsgType] = MsgType.STEP_RESULT
    step: Count
    seq_ids: Ints = []
    tokens: Ints = []
    forward_seconds: Seconds = 0.0
    park_seconds: Seconds = 0.0  # parks and restores of this step, last stage


class StepError(Wire):
    TYPE: ClassVar[MsgType] = MsgType.STEP_ERROR
    step: Count
    code: Code
    message: Why
    seq_ids: Ints = []  # the sequences at fault; [] = the step


class Shutdown(Wire):
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN


class Reset(Wire):
    """The coordinator is regrouping its workers (one was lost, or it does not know this one:
    it restarted, or this worker was cut off): drop everything and register again."""

    TYPE: ClassVar[MsgType] = MsgType.RESET
    reason: Annotated[str, Meta(max_length=512)] = ""


class Activations(Wire):
    """Hidden states of one step, [T, dim], in the single raw frame that follows."""

    TYPE: ClassVar[MsgType] = MsgType.ACTIVATIONS
    step: Count
    dtype: Annotated[str, Meta(max_length=16)]
    shape: Annotated[list[int], Meta(max_length=8)] = []


# ---- frontend <-> engine core ------------------------------------------------------------------
#
# A frontend turns client requests into token ids and token ids into text; the core sees only
# ids. Request keys are the frontend's own integers; the core names a request by (frontend, key).


class FrontendHello(Wire):
    TYPE: ClassVar[MsgType] = MsgType.FRONTEND_HELLO
    index: Rank
    pid: Count = 0


class Serve(Wire):
    """Core -> frontend, once the workers are ready: what a frontend needs to admit requests."""

    TYPE: ClassVar[MsgType] = MsgType.SERVE
    model: ModelInfo = msgspec.field(default_factory=lambda: ModelInfo("", 1, 1, 1, ""))
    kv_pages: Positive = 1
    page_size: Positive = 1
    exact: bool = False  # the cluster runs in exact mode (HTTP responses say so)
    # seconds a frontend polls in a loop after a message (`--busy-poll`, as the core resolved
    # it against the workers' devices)
    busy_poll: Annotated[float, Meta(ge=0.0, le=MAX_BUSY_POLL)] = 0.0


class Listening(Wire):
    TYPE: ClassVar[MsgType] = MsgType.LISTENING
    index: Rank
    endpoint: Address


class Submit(Wire):
    """A request as token ids; the prompt is the one raw frame (int32, `n_prompt` of them)."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    key: Count = 0
    n_prompt: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIST)] = 1
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: Priority = 0
    arrival: float = 0.0  # time.monotonic() when the frontend received it
    client: Annotated[str, Meta(max_length=300)] = ""  # whom the fair queue counts it for


class Cancel(Wire):
    """Frontend -> core: stop a request's choice (`index`, or -1 for all of them), because a
    stop string ended it (`stop`) or its client aborted or went away (`abort`)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    key: Count
    index: Annotated[int, Meta(ge=-1, le=63)] = -1
    reason: Annotated[str, Meta(max_length=16)] = "abort"


class Finished(Wire):
    """A choice the core has ended. `stop` from the core means a stop token (EOS or one of
    `stop_token_ids`): the choice's token in the same message is that token, not text."""

    key: Count
    index: Annotated[int, Meta(ge=0, le=63)]
    reason: Annotated[str, Meta(max_length=16)]
    preemptions: Count = 0


class Failed(Wire):
    key: Count
    code: Code
    message: Why


class Outputs(Wire):
    """Core -> frontend after a step: its tokens in one raw frame of int64 rows
    (key, index, token), `n_rows` of them, then the choices that ended and requests that
    failed."""

    TYPE: ClassVar[MsgType] = MsgType.OUTPUTS
    n_rows: Annotated[int, Meta(ge=0, le=MAX_LIST)] = 0
    finished: Annotated[list[Finished], Meta(max_length=MAX_LIST)] = []
    failed: Annotated[list[Failed], Meta(max_length=MAX_LIST)] = []


class Report(Wire):
    """Frontend -> core: what only the frontend saw, for the core's metrics (counts since the
    last report)."""

    TYPE: ClassVar[MsgType] = MsgType.REPORT
    errors: Annotated[dict[Code, Count], Meta(max_length=64)] = {}  # code -> requests refused
    dropped: Count = 0  # malformed client messages
    rejected: Count = 0  # client connections refused by CURVE authentication


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
