"""A frontend process: clients in, token ids to the engine core, text back to clients.

It owns a client ROUTER (`--listen`) and a DEALER to the core's private ipc socket. Clients'
requests are validated, tokenized (chat templates too; large prompts on a thread of their own,
`prompts.py`) and checked against the model's context and the KV pool here, then submitted as
token ids; the core's outputs (token ids, finish
reasons) are detokenized, searched for stop strings (a stop string cancels its choice in the
core), streamed and gathered into results. Aborts, clients that go away, keepalives and
`status` are handled here too. Nothing here can delay a step: the core never waits on a
frontend, and `launch --frontends N` runs several so text work spreads over cores.

`python -m coordinator.frontend` is started by the engine core; it is not a user command.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import gc
import logging
import os
import signal
import socket
import sys
import time
from array import array
from collections import Counter, deque

import zmq

from protocol import security, wire
from protocol.busy_poll import BusyPoller
from protocol.errors import ErrorCode, ProtocolError, RequestError
from protocol.messages import (
    Abort,
    Cancel,
    Error,
    FrontendHello,
    Generate,
    Heartbeat,
    Listening,
    Outputs,
    Report,
    Serve,
    Shutdown,
    Status,
    StatusReply,
    Submit,
)
from protocol.wire import MAX_CLIENT_MESSAGE_BYTES, MAX_MESSAGE_BYTES, decode, encode

from .admission import check_fits, prompt_bytes, prompt_ids
from .http.server import HttpServer
from .output import RequestOutput
from .prompts import INLINE_CHARS, PromptJob, PromptTokenizer, text_chars
from .text import TextCodec

log = logging.getLogger("siding.frontend")

HTTP_ENDPOINT = "inproc://http"  # where this process's HTTP API reaches it as a client
KEEPALIVE_SECONDS = 1.0  # a request the client has not heard of for this long gets an empty chunk
HEARTBEAT_SECONDS = 2.0  # to the core, whose deadline for a frontend is 10 s
# The core sends something at least every second (`FrontendGroup.beat`). Silent this long, a
# stopped core process (SIGSTOP, a debugger) is taken as down; silent the longer one, a core in
# any state is: a busy machine can starve it for seconds, a stopped one never answers.
CORE_QUIET_SECONDS = 2.0
CORE_SILENT_SECONDS = 30.0
CLIENT_HWM = 100_000  # queued replies per client before it counts as not reading
TRIM_SECONDS = 5.0  # how often freed heap memory is handed back to the system


def give_back_memory() -> None:
    """Return freed heap pages to the system (glibc's malloc_trim; nothing elsewhere). A client's
    16 MiB message becomes strings and lists of that size, freed once handled; without this the
    process keeps its high-water mark of them (measured: 37 MB to 282 MB after 10,000 fuzzed
    messages, and back to its start with it)."""
    if _libc is not None:
        _libc.malloc_trim(0)


try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # not glibc
    _libc = None


class Frontend:
    def __init__(self, core: str, index: int, listen: str, curve_keys: str | None,
                 insecure: bool, exit_with_parent: bool, http: HttpServer | None = None):
        security.check_bind(listen, curve_keys, insecure)
        self.index = index
        self.http = http
        self.listen = listen
        self.curve_keys = curve_keys
        self.parent = os.getppid() if exit_with_parent else None
        self.busy = BusyPoller(0.0)  # how the loop waits (--busy-poll: SERVE says how long)
        self.ctx = zmq.Context()
        self.auth = self.rejections = None
        self.core = self.ctx.socket(zmq.DEALER)
        self.core.setsockopt(zmq.LINGER, 0)
        self.core.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.core.connect(core)
        self.clients: zmq.Socket | None = None
        self.codec: TextCodec | None = None
        self.prompts: PromptTokenizer | None = None  # large prompts, tokenized off the loop
        self.serve_msg: Serve | None = None
        self.requests: dict[int, RequestOutput] = {}
        self.by_client: dict[tuple[bytes, str], int] = {}  # (client, request id) -> key
        self.next_key = 0
        self.status_waiting: deque[bytes] = deque()  # clients waiting on the core's status
        self.last_to_core = 0.0
        self.last_from_core = time.monotonic()
        self.core_down: str | None = None  # why the core is taken as down, while it is
        self.heard = False  # the core's last messages were more than heartbeats (`_drain_core`)
        self.errors: Counter[str] = Counter()  # refused here, for the core's metrics
        self.dropped = 0
        # client connections refused by CURVE: counted by the monitor thread alone, reported
        # (as the difference) by the loop alone, so that neither loses the other's update
        self.rejected = self.rejected_reported = 0

    # ---- start and loop ---------------------------------------------------------------------

    def run(self) -> None:
        self._to_core(FrontendHello(index=self.index, pid=os.getpid()))
        while self.serve_msg is None:  # the workers load meanwhile: minutes, for a large model
            if self.core.poll(500):
                msg, _ = self._recv_core()
                if isinstance(msg, Serve):
                    self._on_serve(msg)
                elif isinstance(msg, Shutdown):
                    return
            if time.monotonic() - self.last_to_core >= HEARTBEAT_SECONDS:
                self._to_core(Heartbeat(rank=self.index))
            self._check_parent()
        self.codec = TextCodec(self.serve_msg.model)
        self.prompts = PromptTokenizer(self.ctx, self.serve_msg.model)
        self.clients = self._bind(self.listen)
        endpoint = self.clients.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.http is not None:  # a client like any other, over inproc (no CURVE there)
            self.clients.bind(HTTP_ENDPOINT)
            self.http.start(self.ctx, HTTP_ENDPOINT, self.serve_msg)
        self._to_core(Listening(index=self.index, endpoint=endpoint))
        gc.freeze()  # the tokenizer and template live on: collections need not scan them again
        self._serve()

    def _on_serve(self, msg: Serve) -> None:
        self.serve_msg = msg
        # No spin beside the HTTP thread: each turn drops the GIL (in zmq_poll, sched_yield) and
        # takes it back before a thread signalled for it can wake, and CPython asks a holder to
        # switch only if the GIL did not change hands for a switch interval, so that thread
        # would run only when it won a race (the suspect for HTTP's bursts at 128 streams on an
        # H100: ITL p50/p99 0.2/34 ms, ZeroMQ's 3.5/9.7). Blocked in poll, the loop leaves it.
        self.busy.seconds = 0.0 if self.http is not None else msg.busy_poll

    def _bind(self, endpoint: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_MESSAGE_BYTES)
        s.setsockopt(zmq.SNDHWM, CLIENT_HWM)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.curve_keys:
            self.auth = security.secure_server(s, self.curve_keys)
            self.rejections = security.RejectionCounter(s, self._rejected)
        s.bind(endpoint)
        return s

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.core, zmq.POLLIN)
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.prompts.ready, zmq.POLLIN)
        last_beat = last_check = last_trim = 0.0
        while True:
            events = self.busy.poll(poller, round(KEEPALIVE_SECONDS * 1000 / 2))
            if self.core in events:
                if self._drain_core():
                    return
                if len(events) == 1 and not self.heard:  # the core's heartbeats of an idle
                    self.busy.signs_of_life()  # cluster open no spin window
            if self.clients in events:
                self._drain_clients()
            if self.prompts.ready in events:
                for job in self.prompts.finished():
                    self._submit_tokenized(job)
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_SECONDS / 2:
                last_beat = now
                if now - self.last_to_core >= HEARTBEAT_SECONDS:  # anything sent is a sign of life
                    self._to_core(Heartbeat(rank=self.index))
                self._report()
                self._check_parent()
                self._check_core(now)
            if now - last_trim >= TRIM_SECONDS:
                last_trim = now
                give_back_memory()
            if now - last_check >= KEEPALIVE_SECONDS / 2:
                last_check = now
                self._keepalive(now)

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()
        if self.prompts is not None:
            self.prompts.close()
        if self.rejections is not None:
            self.rejections.stop()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=500)  # what is queued for clients (errors at a stop) goes out

    def _check_parent(self) -> None:
        if self.parent is not None and os.getppid() != self.parent:
            log.warning("the engine core went away; frontend %d exits", self.index)
            raise SystemExit(1)
        if self.http is not None and self.http.stopped:
            log.error("frontend %d: the HTTP server stopped; exiting to be restarted",
                      self.index)
            raise SystemExit(1)

    # ---- the core ---------------------------------------------------------------------------

    def _to_core(self, msg, frames=()) -> None:
        self.core.send_multipart(encode(msg, frames))
        self.last_to_core = time.monotonic()

    def _recv_core(self):
        try:
            return decode(self.core.recv_multipart(copy=False))
        except ProtocolError as e:
            log.error("dropped a malformed message from the core: %s", e)
            return None, []

    def _drain_core(self) -> bool:
        """Handle what the core sent; True once it says to shut down. `heard`: whether any of
        it was more than a heartbeat."""
        self.heard = False
        for _ in range(1000):
            if not self.core.poll(0):
                return False
            msg, frames = self._recv_core()
            self.last_from_core = time.monotonic()
            if self.core_down is not None:
                log.info("frontend %d: the engine core answers again", self.index)
                self.core_down = None
            self.heard |= not isinstance(msg, Heartbeat)
            if isinstance(msg, Outputs):
                self._on_outputs(msg, frames[0])
            elif isinstance(msg, StatusReply):
                if self.status_waiting:
                    self._send(self.status_waiting.popleft(), msg)
            elif isinstance(msg, Shutdown):
                return True
        return False

    def _check_core(self, now: float) -> None:
        """Take the core as down once it has been silent too long (see CORE_QUIET_SECONDS):
        every request here fails with `unavailable` (and is cancelled in the core, for when it
        comes back), and new ones and `status` are refused until it speaks again."""
        quiet = now - self.last_from_core
        if self.core_down is not None or quiet < CORE_QUIET_SECONDS:
            return
        if self.parent is not None and process_stopped(self.parent):
            why = f"the engine core (pid {self.parent}) is stopped and has not answered for "
        elif quiet >= CORE_SILENT_SECONDS:
            why = "the engine core has not answered for "
        else:
            return
        self.core_down = why + f"{quiet:.0f} s"
        log.error("frontend %d: %s; failing its %d requests", self.index, self.core_down,
                  len(self.requests) + len(self.prompts.pending))
        for out in list(self.requests.values()):
            self._forget(out)
            self._to_core(Cancel(key=out.key, reason="abort"))
            self._refuse(out.client, out.msg.request_id, self._core_down())
            self._log_cut_short(out, "failed (the engine core is down)")
        for (client, request_id) in list(self.prompts.pending):
            self.prompts.cancel(client, request_id)
            self._refuse(client, request_id, self._core_down())
        while self.status_waiting:
            self._refuse(self.status_waiting.popleft(), None, self._core_down())

    def _core_down(self) -> RequestError:
        return RequestError(ErrorCode.UNAVAILABLE, self.core_down)

    def _refuse(self, identity: bytes, request_id: str | None, e: RequestError) -> None:
        """A request (or `status`) refused here: counted for the core's metrics, and answered."""
        self.errors[e.code] += 1
        self._send(identity, Error(code=e.code, message=e.message, request_id=request_id))

    def _on_outputs(self, msg: Outputs, frame: memoryview) -> None:
        rows = array("q")
        rows.frombytes(frame)
        # the row a stop token ended a choice on: its last here (a message may hold several
        # steps' rows, --multi-step)
        stop_rows = {(f.key, f.index): -1 for f in msg.finished if f.reason == "stop"}
        if stop_rows:
            for row, choice in enumerate(zip(rows[0::3], rows[1::3])):
                if choice in stop_rows:
                    stop_rows[choice] = row
        touched: dict[int, RequestOutput] = {}
        for row, (key, index, token) in enumerate(zip(rows[0::3], rows[1::3], rows[2::3])):
            out = self.requests.get(key)
            if out is None:
                continue  # aborted here already
            touched[key] = out
            if out.add_token(index, token, bool(stop_rows) and stop_rows.get((key, index)) == row):
                self._to_core(Cancel(key=key, index=index, reason="stop"))
        for f in msg.finished:
            out = self.requests.get(f.key)
            if out is not None:
                out.end(f.index, f.reason, f.preemptions)
                touched[f.key] = out
        for f in msg.failed:
            out = self.requests.pop(f.key, None)
            if out is not None:
                touched.pop(f.key, None)
                self.by_client.pop((out.client, out.msg.request_id), None)
                self._log_cut_short(out, f"{f.code} ({f.message})")
                self._send(out.client, Error(code=f.code, message=f.message,
                                             request_id=out.msg.request_id))
        self._emit(touched.values())

    def _emit(self, outs) -> None:
        """Stream what is new, and send each result once the core has ended every choice. A
        client that asked for CHUNKS gets one message for all its streams' chunks of the step
        (then their results); chunks of any other request go one by one."""
        now = time.monotonic()
        batched: dict[bytes, list[bytes]] = {}
        done = []
        for out in outs:
            if out.key not in self.requests:
                continue  # its client went away during this loop: its requests were aborted
            if out.msg.stream and (headers := out.chunks()):
                out.last_sent = now
                if out.msg.batched_chunks:
                    batched.setdefault(out.client, []).extend(headers)
                else:
                    for header in headers:
                        self._send_frames(out.client, wire.chunk_frames(header))
            if out.done:
                done.append(out)
        for client, headers in batched.items():
            for frames in wire.chunk_messages(headers):
                self._send_frames(client, frames)
        for out in done:
            if out.key not in self.requests:
                continue  # as above
            self._forget(out)
            self._send(out.client, out.result())
            if log.isEnabledFor(logging.INFO):
                log.info("%s", out.log_line(now))

    def _forget(self, out: RequestOutput) -> None:
        self.requests.pop(out.key, None)
        self.by_client.pop((out.client, out.msg.request_id), None)

    def _log_cut_short(self, out: RequestOutput, why: str) -> None:
        """An aborted or failed request's line, beside the finished ones' (`_emit`)."""
        if log.isEnabledFor(logging.INFO):
            log.info("%s", out.log_line(time.monotonic(), why))

    def _rejected(self) -> None:
        self.rejected += 1

    def _report(self) -> None:
        if self.http is not None:
            self.errors.update(self.http.refusals())
        rejected = self.rejected - self.rejected_reported
        if self.errors or self.dropped or rejected:
            self.rejected_reported += rejected
            self._to_core(Report(errors=dict(self.errors), dropped=self.dropped,
                                 rejected=rejected))
            self.errors.clear()
            self.dropped = 0

    # ---- clients ----------------------------------------------------------------------------

    def _drain_clients(self) -> None:
        # A turn's budget: a flood of client messages must not hold back the core's outputs,
        # the keepalives (clients give up after 3 s of silence) or the heartbeats.
        wire.drain(self.clients, self._on_client_guarded,
                   lambda identity, e: self._drop(identity, e.message), seconds=0.05)

    def _on_client_guarded(self, identity: bytes, msg, frames) -> None:
        try:
            self._on_client(identity, msg)
        except Exception:  # a bug must not take the frontend down; say so loudly
            log.exception("failed to handle %s", type(msg).__name__)
            self.errors[ErrorCode.INTERNAL.value] += 1
            self._send(identity, Error(code="internal", message="internal error",
                                       request_id=getattr(msg, "request_id", None)))

    def _drop(self, identity: bytes, message: str) -> None:
        self.dropped += 1
        log.warning("dropped a malformed client message: %s", message)
        self._send(identity, Error(code=ErrorCode.INVALID_REQUEST.value, message=message))

    def _on_client(self, identity: bytes, msg) -> None:
        if isinstance(msg, Generate):
            try:
                self._admit(identity, msg)
            except RequestError as e:
                self._refuse(identity, msg.request_id, e)
        elif isinstance(msg, Abort):
            key = self.by_client.get((identity, msg.request_id))
            if key is not None:
                out = self.requests[key]
                self._forget(out)
                self._to_core(Cancel(key=key, reason="abort"))
                self._log_cut_short(out, "aborted (by the client)")
            if key is not None or self.prompts.cancel(identity, msg.request_id):
                self._send(identity, Error(code=ErrorCode.ABORTED.value,
                                           message="aborted by the client",
                                           request_id=msg.request_id))
            else:
                self._send(identity, Error(
                    code=ErrorCode.INVALID_REQUEST.value, request_id=msg.request_id,
                    message=f"no running request {msg.request_id!r} of this client to abort: "
                    "it has ended, or it is another client's (a client aborts only its own)"))
        elif isinstance(msg, Status):
            if self.core_down is not None:
                self._refuse(identity, None, self._core_down())
                return
            self.status_waiting.append(identity)
            self._to_core(Status())
        else:
            self._drop(identity, f"{type(msg).__name__} is not a client message")

    def _admit(self, identity: bytes, msg: Generate) -> None:
        msg.check()
        if self.core_down is not None:
            raise self._core_down()
        if (identity, msg.request_id) in self.by_client or (
                (identity, msg.request_id) in self.prompts.pending):
            raise RequestError(ErrorCode.INVALID_REQUEST,
                               f"request id {msg.request_id!r} is already in use")
        arrival = time.monotonic()
        if text_chars(msg) > INLINE_CHARS:
            self.prompts.submit(PromptJob(identity, msg, arrival, last_sent=arrival))
        else:
            self._submit(identity, msg, arrival, prompt_ids(msg, self.codec))

    def _submit_tokenized(self, job: PromptJob) -> None:
        try:
            if job.error is not None:
                raise job.error
            self._submit(job.client, job.msg, job.arrival, job.prompt)
        except RequestError as e:
            self._refuse(job.client, job.msg.request_id, e)

    def _submit(self, identity: bytes, msg: Generate, arrival: float,
                prompt: list[int] | array) -> None:
        """A tokenized request: checked against the context and the pool, then to the core."""
        s = self.serve_msg
        check_fits(prompt, msg, s.model, s.kv_pages, s.page_size)
        key = self.next_key
        self.next_key += 1
        out = RequestOutput(key, identity, msg, prompt, self.codec)
        out.last_sent = out.arrival = arrival
        self.requests[key] = out
        self.by_client[(identity, msg.request_id)] = key
        self._to_core(Submit(
            key=key, n_prompt=len(prompt), sampling=msg.sampling, priority=msg.priority,
            arrival=arrival, client=identity.hex() if msg.user is None else "user:" + msg.user),
            [prompt_bytes(prompt)])

    def _send(self, identity: bytes, msg) -> None:
        self._send_frames(identity, encode(msg))

    def _send_frames(self, identity: bytes, frames: list[bytes]) -> None:
        """Send to a client; a client that is gone or not reading loses its requests."""
        try:
            wire.send(self.clients, [identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
            for out in [o for o in self.requests.values() if o.client == identity]:
                self._forget(out)
                self._to_core(Cancel(key=out.key, reason="abort"))
                self._log_cut_short(out, "aborted (the client went away)")
            self.prompts.cancel(identity)
            log.info("client %s went away; its requests were aborted", identity.hex())

    def _keepalive(self, now: float) -> None:
        for out in [*self.requests.values(), *self.prompts.pending.values()]:
            if now - out.last_sent >= KEEPALIVE_SECONDS:
                out.last_sent = now
                self._send_frames(out.client, out.keepalive)


def process_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger): its state in /proc (False where
    there is none)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m coordinator.frontend",
                                description="a siding frontend (started by the engine core)")
    p.add_argument("--core", required=True, help="the engine core's frontend endpoint")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--listen", required=True, help="the client endpoint to bind")
    p.add_argument("--curve-keys", default=None)
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--exit-with-parent", action="store_true")
    p.add_argument("--http-fd", type=int, default=None, metavar="FD",
                   help="serve the OpenAI API on this inherited listening socket (its key, if "
                   "any, in SIDING_API_KEY)")
    p.add_argument("--metrics-socket", default=None, metavar="PATH",
                   help="the engine core's metrics exposition, served as /metrics on --http-fd")
    p.add_argument("--sse-keepalive", type=float, default=None, metavar="SECONDS",
                   help="HTTP streams send an SSE comment after this long without an event")
    p.add_argument("--http-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="an HTTP connection idle this long before a request is closed")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s frontend {a.index} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core drains on Ctrl-C, then stops us
    http = None
    if a.http_fd is not None:
        http = HttpServer(socket.socket(fileno=a.http_fd), os.environ.pop("SIDING_API_KEY", None),
                          a.sse_keepalive, a.http_timeout, a.metrics_socket)
    frontend = Frontend(a.core, a.index, a.listen, a.curve_keys, a.insecure, a.exit_with_parent,
                        http)
    try:
        frontend.run()
    finally:
        frontend.close()


if __name__ == "__main__":
    main()
