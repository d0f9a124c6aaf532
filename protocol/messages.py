"""Message types: one small dataclass per type byte, validated field by field on decode.

A header is a msgpack map whose keys are exactly a message's field names. Unknown keys, missing
required keys, wrong types and values past a field's limits are `invalid_request` errors, never
exceptions that escape a process's receive loop.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

from .errors import ProtocolError


class MsgType(IntEnum):
    # client -> coordinator
    GENERATE = 0x01
    ABORT = 0x02
    STATUS = 0x03
    # coordinator -> client
    CHUNK = 0x11
    RESULT = 0x12
    STATUS_REPLY = 0x13
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
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_PRIORITY = 1000  # priorities are in [-1000, 1000]; higher runs first and is preempted last


def limit(max_len: int | None = None, lo: float | None = None, hi: float | None = None) -> dict:
    return {"max_len": max_len, "lo": lo, "hi": hi}


def _field(default: Any = dataclasses.MISSING, **limits: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=list, metadata=limit(**limits))
    return field(default=default, metadata=limit(**limits))


# ---- client <-> coordinator -------------------------------------------------------------------


@dataclass(slots=True)
class ChatMessage:
    role: str = _field(max_len=64)
    content: str = _field(max_len=MAX_TEXT)


@dataclass(slots=True)
class Generate:
    TYPE: ClassVar[MsgType] = MsgType.GENERATE
    request_id: str = _field(max_len=MAX_ID)
    prompt: str | None = _field(None, max_len=MAX_TEXT)
    prompt_token_ids: list[int] | None = _field(None, max_len=MAX_TOKENS_LIST)
    messages: list[ChatMessage] | None = _field(None, max_len=4096)
    max_tokens: int = _field(16, lo=1, hi=1 << 24)
    temperature: float = _field(0.0, lo=0.0, hi=100.0)
    top_p: float = _field(1.0, lo=0.0, hi=1.0)
    top_k: int = _field(0, lo=0, hi=1 << 24)
    seed: int | None = _field(None, lo=0, hi=(1 << 63) - 1)
    stop: list[str] = _field([], max_len=64)
    stop_token_ids: list[int] = _field([], max_len=1024)
    ignore_eos: bool = _field(False)
    priority: int = _field(0, lo=-MAX_PRIORITY, hi=MAX_PRIORITY)
    n: int = _field(1, lo=1, hi=64)
    stream: bool = _field(False)
    user: str | None = _field(None, max_len=256)  # whom the fair queue counts it for

    def check(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ProtocolError("give exactly one of prompt, prompt_token_ids or messages")
        if self.prompt == "" or self.prompt_token_ids == [] or self.messages == []:
            raise ProtocolError("the prompt is empty")
        if self.top_p <= 0.0:
            raise ProtocolError("top_p must be in (0, 1]")
        if any(s == "" for s in self.stop):
            raise ProtocolError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ProtocolError(f"field 'stop': a stop string is longer than {MAX_STOP_CHARS} "
                                "characters")
        if self.messages is not None and (
                total := sum(len(m.content) for m in self.messages)) > MAX_TEXT:
            raise ProtocolError(f"field 'messages' holds {total} characters of content; the "
                                f"limit is {MAX_TEXT} in all")
        if any(t < 0 for t in self.stop_token_ids) or any(
            t < 0 for t in self.prompt_token_ids or ()
        ):
            raise ProtocolError("token ids must not be negative")


@dataclass(slots=True)
class Abort:
    TYPE: ClassVar[MsgType] = MsgType.ABORT
    request_id: str = _field(max_len=MAX_ID)


@dataclass(slots=True)
class Status:
    TYPE: ClassVar[MsgType] = MsgType.STATUS


@dataclass(slots=True)
class Chunk:
    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    request_id: str = _field(max_len=MAX_ID)
    index: int = _field(0, lo=0)
    token_ids: list[int] = _field([], max_len=MAX_TOKENS_LIST)
    text: str = _field("", max_len=MAX_TEXT)
    finish_reason: str | None = _field(None, max_len=32)  # set on a choice's last chunk


@dataclass(slots=True)
class Choice:
    index: int = _field(0, lo=0)
    token_ids: list[int] = _field([], max_len=MAX_TOKENS_LIST)
    text: str = _field("", max_len=1 << 26)
    finish_reason: str = _field("stop", max_len=32)
    preemptions: int = _field(0, lo=0)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = _field(0, lo=0)
    completion_tokens: int = _field(0, lo=0)


@dataclass(slots=True)
class Result:
    TYPE: ClassVar[MsgType] = MsgType.RESULT
    request_id: str = _field(max_len=MAX_ID)
    prompt_token_ids: list[int] = _field([], max_len=MAX_TOKENS_LIST)
    choices: list[Choice] = _field([], max_len=64)
    usage: Usage = field(default_factory=Usage)


@dataclass(slots=True)
class StatusReply:
    TYPE: ClassVar[MsgType] = MsgType.STATUS_REPLY
    status: dict = field(default_factory=dict)


@dataclass(slots=True)
class Error:
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: str = _field(max_len=32)
    message: str = _field(max_len=1 << 16)
    request_id: str | None = _field(None, max_len=MAX_ID)


# ---- coordinator <-> worker -------------------------------------------------------------------


@dataclass(slots=True)
class Register:
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    rank: int = _field(-1, lo=-1, hi=4095)  # -1: any rank
    device: str = _field("cpu", max_len=64)
    pid: int = _field(0, lo=0)
    hostname: str = _field("", max_len=256)
    data_endpoint: str = _field("", max_len=256)  # where this worker's activation PULL listens


DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_PAGES = 1 << 24  # KV pages or park slots of one pool
KV_MODES = ("device", "host")
OVERLAP = ("auto", "on", "off")


@dataclass(slots=True)
class WorkerConfig:
    """What every worker of a cluster is built from, carried whole from the CLI (one flag per
    field, of the same name: `coordinator/cli.py`) through the coordinator's config and ASSIGN
    to the worker's composition root (`worker/build.py`). A new worker knob is a field here and
    its flag there. The coordinator reads the ones it shares (pages, batch rows, exact)."""

    model: str = _field("smollm2-135m", max_len=4096)
    dtype: str = _field("auto", max_len=32)
    kv: str = _field("device", max_len=16)  # where the KV pages live: device, or host memory
    pipeline_depth: int = _field(1, lo=0, hi=64)  # staging ring slots delivered ahead
    ring_budget_mib: int = _field(512, lo=0, hi=1 << 31)  # the ring's device memory (0: no cap)
    exact: bool = _field(False)
    cuda_graphs: bool = _field(True)  # CUDA decode steps replayed from graphs
    overlap: str = _field("auto", max_len=8)  # steps enqueued ahead (auto: on for CUDA)
    page_size: int = _field(16, lo=1, hi=4096)
    kv_pages: int = _field(1024, lo=1, hi=1 << 31)
    park_pages: int | None = _field(None, lo=0, hi=1 << 31)  # park store slots (None: kv_pages)
    max_batch_seqs: int = _field(64, lo=1, hi=1 << 20)  # decode graphs are captured up to it
    transport_delay_ms: float = _field(0.0, lo=0.0, hi=10_000.0)  # tests: every copy delayed

    def __post_init__(self) -> None:
        if self.park_pages is None:
            self.park_pages = self.kv_pages

    def validate(self) -> None:
        """ValueError naming the flag of the first knob that is out of its domain."""
        for flag, value, domain in [("--dtype", self.dtype, DTYPES), ("--kv", self.kv, KV_MODES),
                                    ("--overlap", self.overlap, OVERLAP)]:
            if value not in domain:
                raise ValueError(f"{flag} must be one of {', '.join(domain)}, not {value!r}")
        for flag, value, lo in [("--pipeline-depth", self.pipeline_depth, 0),
                                ("--ring-budget-mib", self.ring_budget_mib, 0),
                                ("--page-size", self.page_size, 1),
                                ("--kv-pages", self.kv_pages, 1),
                                ("--park-pages", self.park_pages, 0),
                                ("--max-batch-seqs", self.max_batch_seqs, 1)]:
            if value < lo:
                raise ValueError(f"{flag} must be at least {lo}, not {value}")
        if self.page_size > 4096:
            raise ValueError(f"--page-size must be at most 4096, not {self.page_size}")
        for flag, value in [("--kv-pages", self.kv_pages), ("--park-pages", self.park_pages)]:
            if value > MAX_PAGES:
                raise ValueError(f"{flag} must be at most {MAX_PAGES} (the coordinator keeps "
                                 f"about 50 bytes of bookkeeping a page), not {value}")


@dataclass(slots=True)
class Assign:
    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    rank: int = _field(lo=0, hi=4095)
    n_workers: int = _field(lo=1, hi=4096)
    config: WorkerConfig = _field()
    next_endpoint: str | None = _field(None, max_len=256)
    layer_start: int | None = _field(None, lo=0)
    layer_end: int | None = _field(None, lo=0)
    metrics_port: int | None = _field(None, lo=0, hi=65535)


@dataclass(slots=True)
class ModelInfo:
    name: str = _field(max_len=4096)
    n_layers: int = _field(lo=1)
    vocab_size: int = _field(lo=1)
    max_context: int = _field(lo=1)
    tokenizer_json: str = _field(max_len=1 << 28)
    chat_template: str | None = _field(None, max_len=1 << 20)
    bos_id: int | None = _field(None, lo=0)
    add_bos: bool = _field(False)
    eos_ids: list[int] = _field([], max_len=64)


@dataclass(slots=True)
class Ready:
    TYPE: ClassVar[MsgType] = MsgType.READY
    rank: int = _field(lo=0)
    layer_start: int = _field(lo=0)
    layer_end: int = _field(lo=0)
    device: str = _field("cpu", max_len=64)
    kv_bytes_per_page: int = _field(0, lo=0)
    model: ModelInfo | None = _field(None)  # from rank 0 only


@dataclass(slots=True)
class Heartbeat:
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    rank: int = _field(lo=0)
    pid: int = _field(0, lo=0)  # a worker's, matched with its REGISTER (0: a frontend's)
    # a worker's forward passes so far (every stage's time shows in `status`; the last stage's
    # also comes with each STEP_RESULT)
    forward_seconds: float = _field(0.0, lo=0.0)
    steps: int = _field(0, lo=0)


@dataclass(slots=True)
class Sampling:
    temperature: float = _field(0.0, lo=0.0)
    top_p: float = _field(1.0, lo=0.0, hi=1.0)
    top_k: int = _field(0, lo=0)
    seed: int = _field(0, lo=0, hi=(1 << 63) - 1)


@dataclass(slots=True)
class SeqPlan:
    """One sequence's part of a step: `n` tokens at positions start .. start+n-1."""

    id: int = _field(lo=0)
    start: int = _field(lo=0)
    n: int = _field(lo=1)
    pages_add: list[int] = _field([], max_len=MAX_LIST)  # appended to its page table first
    sample: bool = _field(False)  # sample a token after the last of the n positions
    sampling: Sampling | None = _field(None)  # the first time the worker sees this sequence


@dataclass(slots=True)
class PageMove:
    """Park (`pages` -> park `slots`) or restore (`slots` -> `pages`) one sequence's KV. A
    restored sequence's page table is `kept` (pages that stayed resident: shared with another
    sequence when it was parked, or found in the prefix cache since) then `pages`; `slots`
    restored are the last of those its park filled."""

    id: int = _field(lo=0)
    pages: list[int] = _field([], max_len=MAX_LIST)
    slots: list[int] = _field([], max_len=MAX_LIST)
    kept: list[int] = _field([], max_len=MAX_LIST)


@dataclass(slots=True)
class PageCopy:
    """Copy one page into another (the copy-on-write tail of a forked prompt)."""

    src: int = _field(lo=0)
    dst: int = _field(lo=0)


@dataclass(slots=True)
class Step:
    """A step, applied in this order: free, park, restore, copies, then the sequences' rows.
    On the wire as columns (protocol/step_frames.py), not as this map."""

    TYPE: ClassVar[MsgType] = MsgType.STEP
    step: int = _field(lo=0)
    seqs: list[SeqPlan] = _field([], max_len=MAX_LIST)
    token_ids: list[int] = _field([], max_len=MAX_TOKENS_LIST)  # sum of seqs' n, in order
    free: list[int] = _field([], max_len=MAX_LIST)  # sequences to forget before this step
    park: list[PageMove] = _field([], max_len=MAX_LIST)
    restore: list[PageMove] = _field([], max_len=MAX_LIST)  # sets the sequence's page table
    copies: list[PageCopy] = _field([], max_len=MAX_LIST)


@dataclass(slots=True)
class StepResult:
    TYPE: ClassVar[MsgType] = MsgType.STEP_RESULT
    step: int = _field(lo=0)
    seq_ids: list[int] = _field([], max_len=MAX_LIST)
    tokens: list[int] = _field([], max_len=MAX_LIST)
    forward_seconds: float = _field(0.0, lo=0.0)
    park_seconds: float = _field(0.0, lo=0.0)  # parks and restores of this step, last stage


@dataclass(slots=True)
class StepError:
    TYPE: ClassVar[MsgType] = MsgType.STEP_ERROR
    step: int = _field(lo=0)
    code: str = _field(max_len=32)
    message: str = _field(max_len=1 << 16)
    seq_ids: list[int] = _field([], max_len=MAX_LIST)  # the sequences at fault; [] = the step


@dataclass(slots=True)
class Shutdown:
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN


@dataclass(slots=True)
class Reset:
    """The coordinator is regrouping its workers (one was lost, or it does not know this one:
    it restarted, or this worker was cut off): drop everything and register again."""

    TYPE: ClassVar[MsgType] = MsgType.RESET
    reason: str = _field("", max_len=512)


@dataclass(slots=True)
class Activations:
    """Hidden states of one step, [T, dim], in the single raw frame that follows."""

    TYPE: ClassVar[MsgType] = MsgType.ACTIVATIONS
    step: int = _field(lo=0)
    dtype: str = _field(max_len=16)
    shape: list[int] = _field([], max_len=8)


# ---- frontend <-> engine core ------------------------------------------------------------------
#
# A frontend turns client requests into token ids and token ids into text; the core sees only
# ids. Request keys are the frontend's own integers; the core names a request by (frontend, key).


@dataclass(slots=True)
class FrontendHello:
    TYPE: ClassVar[MsgType] = MsgType.FRONTEND_HELLO
    index: int = _field(lo=0, hi=4095)
    pid: int = _field(0, lo=0)


@dataclass(slots=True)
class Serve:
    """Core -> frontend, once the workers are ready: what a frontend needs to admit requests."""

    TYPE: ClassVar[MsgType] = MsgType.SERVE
    model: ModelInfo = field(default_factory=lambda: ModelInfo("", 1, 1, 1, ""))
    kv_pages: int = _field(1, lo=1)
    page_size: int = _field(1, lo=1)
    exact: bool = _field(False)  # the cluster runs in exact mode (HTTP responses say so)


@dataclass(slots=True)
class Listening:
    TYPE: ClassVar[MsgType] = MsgType.LISTENING
    index: int = _field(lo=0, hi=4095)
    endpoint: str = _field(max_len=256)


@dataclass(slots=True)
class Submit:
    """A request as token ids; the prompt is the one raw frame (int32, `n_prompt` of them)."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    key: int = _field(0, lo=0)
    n_prompt: int = _field(1, lo=1, hi=MAX_TOKENS_LIST)
    n: int = _field(1, lo=1, hi=64)
    max_tokens: int = _field(16, lo=1, hi=1 << 24)
    temperature: float = _field(0.0, lo=0.0, hi=100.0)
    top_p: float = _field(1.0, lo=0.0, hi=1.0)
    top_k: int = _field(0, lo=0, hi=1 << 24)
    seed: int | None = _field(None, lo=0, hi=(1 << 63) - 1)
    stop_token_ids: list[int] = _field([], max_len=1024)
    ignore_eos: bool = _field(False)
    priority: int = _field(0, lo=-MAX_PRIORITY, hi=MAX_PRIORITY)
    arrival: float = _field(0.0)  # time.monotonic() when the frontend received it
    client: str = _field("", max_len=300)  # whom the fair queue counts it for


@dataclass(slots=True)
class Cancel:
    """Frontend -> core: stop a request's choice (`index`, or -1 for all of them), because a
    stop string ended it (`stop`) or its client aborted or went away (`abort`)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    key: int = _field(lo=0)
    index: int = _field(-1, lo=-1, hi=63)
    reason: str = _field("abort", max_len=16)


@dataclass(slots=True)
class Finished:
    """A choice the core has ended. `stop` from the core means a stop token (EOS or one of
    `stop_token_ids`): the choice's token in the same message is that token, not text."""

    key: int = _field(lo=0)
    index: int = _field(lo=0, hi=63)
    reason: str = _field(max_len=16)
    preemptions: int = _field(0, lo=0)


@dataclass(slots=True)
class Failed:
    key: int = _field(lo=0)
    code: str = _field(max_len=32)
    message: str = _field(max_len=1 << 16)


@dataclass(slots=True)
class Outputs:
    """Core -> frontend after a step: its tokens in one raw frame of int64 rows
    (key, index, token), `n_rows` of them, then the choices that ended and requests that
    failed."""

    TYPE: ClassVar[MsgType] = MsgType.OUTPUTS
    n_rows: int = _field(0, lo=0, hi=MAX_LIST)
    finished: list[Finished] = _field([], max_len=MAX_LIST)
    failed: list[Failed] = _field([], max_len=MAX_LIST)


@dataclass(slots=True)
class Report:
    """Frontend -> core: what only the frontend saw, for the core's metrics (counts since the
    last report)."""

    TYPE: ClassVar[MsgType] = MsgType.REPORT
    errors: dict = field(default_factory=dict)  # error code -> requests refused
    dropped: int = _field(0, lo=0)  # malformed client messages
    rejected: int = _field(0, lo=0)  # client connections refused by CURVE authentication


MESSAGES: dict[MsgType, type] = {
    cls.TYPE: cls
    for cls in (
        Generate, Abort, Status, Chunk, Result, StatusReply, Error, Register, Assign, Ready,
        Heartbeat, Step, StepResult, StepError, Shutdown, Reset, Activations, FrontendHello,
        Serve, Listening, Submit, Cancel, Outputs, Report,
    )
}
# raw frames each type carries beside its fields (a STEP's frames are its fields' columns,
# decoded into the Step: protocol/step_frames.py)
FRAMES: dict[MsgType, int] = {MsgType.ACTIVATIONS: 1, MsgType.SUBMIT: 1, MsgType.OUTPUTS: 1}


# ---- validation -------------------------------------------------------------------------------


def to_header(msg: Any) -> dict:
    """The msgpack-ready map of a message (nested dataclasses become maps)."""
    nested = _NESTED.get(type(msg))
    if nested is None:
        nested = _NESTED[type(msg)] = _nesting(type(msg))
    return {name: _plain(getattr(msg, name)) if deep else getattr(msg, name)
            for name, deep in nested}


_NESTED: dict[type, list[tuple[str, bool]]] = {}


def _nesting(cls: type) -> list[tuple[str, bool]]:
    """Each field's name and whether it may hold dataclasses (the rest go to msgpack as they
    are): the hot messages are mostly ints and lists of ints."""
    plain = (int, float, str, bool, dict, type(None))

    def deep(tp: Any) -> bool:
        if tp in plain:
            return False
        args = typing.get_args(tp)
        return not args or any(deep(a) for a in args)

    hints = typing.get_type_hints(cls)
    return [(f.name, deep(hints[f.name])) for f in dataclasses.fields(cls)]


def _plain(value: Any) -> Any:
    if isinstance(value, list):  # lists are of one type: dataclasses, or scalars msgpack takes
        return [to_header(v) for v in value] if value and dataclasses.is_dataclass(value[0]) \
            else value
    return to_header(value) if dataclasses.is_dataclass(value) else value


def from_header(cls: type, header: Any, where: str = "") -> Any:
    """Build `cls` from a decoded map, checking every field; raises ProtocolError."""
    if not isinstance(header, dict):
        what = f"field {where[:-1]!r}" if where else cls.__name__
        raise ProtocolError(f"{what} must be a map")
    fields = _FIELDS.get(cls)
    if fields is None:
        fields = _FIELDS[cls] = _field_checks(cls)
    if not fields.keys() >= header.keys():
        unknown = [k for k in header if k not in fields]
        raise ProtocolError(f"unknown field {where + str(unknown[0])[:64]!r}")
    values = {}
    for name, (check, required) in fields.items():
        if name in header:
            values[name] = check(header[name], where, name)
        elif required:
            raise ProtocolError(f"missing field {where + name!r}")
    return cls(**values)


# A field's check takes (value, where, name) and returns the value to keep; the field's name is
# formatted only for an error, since checks run for every item of every list.
Check = typing.Callable[[Any, str, Any], Any]
_FIELDS: dict[type, dict[str, tuple[Check, bool]]] = {}


def _field_checks(cls: type) -> dict[str, tuple[Check, bool]]:
    """name -> (check, required) for each field of `cls`, built once per class."""
    hints = typing.get_type_hints(cls)
    return {f.name: (_compile(hints[f.name], f.metadata or {}),
                     f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)}


def _compile(tp: Any, meta: Any) -> Check:
    max_len, lo, hi = meta.get("max_len"), meta.get("lo"), meta.get("hi")

    def fail(where: str, name: Any, what: str) -> typing.NoReturn:
        raise ProtocolError(f"field {where + str(name)!r} {what}")

    def in_range(v: Any, where: str, name: Any) -> Any:
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            fail(where, name, f"must be in [{lo}, {hi}], got {v}")
        return v

    def short(v: Any, where: str, name: Any) -> Any:
        if max_len is not None and len(v) > max_len:
            fail(where, name, f"is longer than {max_len}")
        return v

    if tp is int:
        def check_int(v: Any, where: str, name: Any) -> Any:
            if type(v) is not int:  # msgpack makes no int subclasses; a bool is not an int here
                fail(where, name, "must be an integer")
            return in_range(v, where, name) if lo is not None or hi is not None else v
        return check_int
    if tp is float:
        def check_float(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                fail(where, name, "must be a number")
            return in_range(float(v), where, name)
        return check_float
    if tp is bool:
        def check_bool(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, bool):
                fail(where, name, "must be a boolean")
            return v
        return check_bool
    if tp is str:
        def check_str(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, str):
                fail(where, name, "must be a string")
            return short(v, where, name)
        return check_str
    if tp is dict:
        def check_dict(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, dict):
                fail(where, name, "must be a map")
            _check_plain(v, f"{where}{name}")
            return v
        return check_dict
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        check_inner = _compile(inner, meta)

        def check_optional(v: Any, where: str, name: Any) -> Any:
            return None if v is None else check_inner(v, where, name)
        return check_optional
    if origin is list:
        (item,) = args
        check_item = _compile(item, {})

        def check_list(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, list):
                fail(where, name, "must be a list")
            short(v, where, name)
            if item is int:  # the hot case (token and page ids): one pass, items unlimited
                if all(type(x) is int for x in v):
                    return v
                bad = next(i for i, x in enumerate(v) if type(x) is not int)
                fail(f"{where}{name}", f"[{bad}]", "must be an integer")
            prefix = f"{where}{name}"
            return [check_item(x, prefix, f"[{i}]") for i, x in enumerate(v)]
        return check_list
    if dataclasses.is_dataclass(tp):
        def check_nested(v: Any, where: str, name: Any) -> Any:
            return from_header(tp, v, f"{where}{name}.")
        return check_nested
    raise TypeError(f"unsupported field type {tp!r}")  # a bug in this file, not bad input


def _check_plain(value: dict, name: str) -> None:
    """Only maps, lists and scalars: msgpack turns extension types (timestamps too) into objects."""
    stack: list[Any] = [value]
    while stack:  # not recursive: msgpack nests 1024 deep, past Python's recursion limit
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, (str, bytes, int, float, bool, type(None))):
            raise ProtocolError(f"field {name!r} holds a {type(item).__name__}")
