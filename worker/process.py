"""The worker process: register, load a layer range, then run plans in step order.

Sockets: a DEALER to the coordinator for control and results, a PULL bound for the previous
stage's activations, a PUSH to the next stage. Heartbeats go on a socket of their own from a
thread, so a long model load or a long step never looks like a dead worker.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from collections import deque

import torch
import zmq

from protocol import security
from protocol.errors import ProtocolError
from protocol.messages import (
    Activations,
    Assign,
    Heartbeat,
    ModelInfo,
    Ready,
    Register,
    Shutdown,
    Step,
    StepError,
    StepResult,
)
from protocol.wire import MAX_MESSAGE_BYTES, decode, encode

from .cuda_graphs import DecodeGraphs
from .exact import apply_exact
from .host_kv import HostKVPool
from .kv_pool import KVPool
from .loaders import resolve
from .metrics import WorkerMetrics
from .overlap import Ahead, continues, follow_on, overlap_enabled
from .park_store import ParkStore
from .runner import ModelRunner, SequenceFault

log = logging.getLogger("siding.worker")

HEARTBEAT_SECONDS = 0.5  # the coordinator's deadline is 2 s; each beat wakes it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_range(n_layers: int, n_workers: int, rank: int) -> tuple[int, int]:
    """Even split; the first n_layers % n_workers ranks take one extra layer."""
    base, extra = divmod(n_layers, n_workers)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class Worker:
    def __init__(self, coordinator: str, rank: int, device: str, advertise: str,
                 curve_keys: str | None, insecure: bool, exit_with_parent: bool):
        security.check_bind(f"tcp://{advertise}:0", curve_keys, insecure)
        self.coordinator = coordinator
        self.advertise = advertise  # the activation and metrics sockets bind here
        self.requested_rank = rank
        self.device = device
        self.curve_keys = curve_keys
        self.ctx = zmq.Context()
        self.ctl = self._dealer()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.auth = security.secure_server(self.pull, curve_keys) if curve_keys else None
        self.metrics: WorkerMetrics | None = None
        self.rejected = 0  # peers refused before the metrics exist
        if curve_keys:
            security.count_rejections(self.pull, self._rejected)
        port = self.pull.bind_to_random_port(f"tcp://{advertise}")
        self.data_endpoint = f"tcp://{advertise}:{port}"
        self.push: zmq.Socket | None = None
        self.parent = os.getppid() if exit_with_parent else None
        self.stop = threading.Event()
        self.last_result = 0.0  # time.monotonic() of the last STEP_RESULT, itself a sign of life
        self.plans: deque[Step] = deque()
        self.arrived: dict[int, Activations | tuple[Activations, torch.Tensor]] = {}
        self.rank = -1
        self.runner: ModelRunner | None = None
        self.overlap = False  # set by _load
        self.ahead: Ahead | None = None  # a step enqueued before its plan arrived
        self.last_plan: Step | None = None  # the last plan run, to tell a steady batch

    def _rejected(self) -> None:
        log.warning("refused a peer of the activation socket: it lacks the cluster's keys")
        if self.metrics is None:
            self.rejected += 1
        else:
            self.metrics.reject()

    def _dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.curve_keys:
            security.secure_client(s, self.curve_keys)
        s.connect(self.coordinator)
        return s

    # ---- start-up ---------------------------------------------------------------------------

    def run(self) -> None:
        self.ctl.send_multipart(encode(Register(
            rank=self.requested_rank, device=self.device, pid=os.getpid(),
            hostname=socket.gethostname(), data_endpoint=self.data_endpoint,
        )))
        assign = self._wait_assign()
        self.rank = assign.rank
        threading.Thread(target=self._heartbeat, daemon=True).start()
        try:
            ready = self._load(assign)
        except Exception as e:
            message = str(e) or type(e).__name__
            log.error("worker %d failed to load: %s", self.rank, message)
            self.ctl.send_multipart(encode(StepError(step=0, code="internal", message=message)))
            time.sleep(0.2)
            raise SystemExit(1) from None
        self.ctl.send_multipart(encode(ready))
        self._serve()

    def _wait_assign(self) -> Assign:
        while not self.stop.is_set():
            if self.ctl.poll(500):
                msg = self._recv(self.ctl)
                if isinstance(msg, Assign):
                    return msg
                if isinstance(msg, Shutdown):
                    raise SystemExit(0)
            self._check_parent()
        raise SystemExit(0)

    def _load(self, a: Assign) -> Ready:
        t0 = time.perf_counter()
        metrics = WorkerMetrics(a.rank, self.device, a.pipeline_depth, a.exact)
        metrics.reject(self.rejected)
        self.metrics = metrics
        if a.metrics_port is not None:
            try:
                self.metrics.serve(a.metrics_port, self.advertise)
            except OSError as e:
                raise RuntimeError(f"cannot serve metrics on {self.advertise}:"
                                   f"{a.metrics_port}: {e.strerror}") from None
        source = resolve(a.model)
        args = source.args
        if a.layer_start is not None and a.layer_end is not None:
            start, end = a.layer_start, a.layer_end
        else:
            start, end = layer_range(args.n_layers, a.n_workers, a.rank)
        dtype = resolve_dtype(a.dtype, self.device)
        stage = source.load_stage(start, end, dtype, self.device)
        if a.exact:
            apply_exact(stage, self.device)
        shape = (end - start, a.kv_pages, a.page_size, args.n_kv_heads, args.head_dim)
        if a.kv_mode == "host":
            pool = HostKVPool(*shape, dtype, self.device, exact=a.exact, depth=a.pipeline_depth,
                              ring_budget_mib=a.ring_budget_mib, metrics=self.metrics)
        elif a.kv_mode == "device":
            pool = KVPool(*shape, dtype, self.device, exact=a.exact)
        else:
            raise ValueError(f"unknown KV mode {a.kv_mode!r}: use device or host")
        park = ParkStore(pool, a.park_pages or a.kv_pages)
        self.overlap = overlap_enabled(self.device)
        graphs = None
        if a.cuda_graphs and torch.device(self.device).type == "cuda":
            try:
                graphs = DecodeGraphs(stage, pool, self.device)
            except ValueError as e:
                log.warning("decode steps run eagerly: %s", e)
            else:
                graphs.prepare(a.max_batch_seqs)  # no request pays for a capture
        self.runner = ModelRunner(stage, pool, park, self.device, graphs)
        self.dtype = dtype
        self.dim = args.dim
        if a.next_endpoint:
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 0)
            if self.curve_keys:
                security.secure_client(self.push, self.curve_keys)
            self.push.connect(a.next_endpoint)
        log.info("worker %d: layers [%d, %d) of %s on %s in %.1fs", a.rank, start, end,
                 source.name, self.device, time.perf_counter() - t0)
        info = None
        if a.rank == 0:
            tok = source.tokenizer
            info = ModelInfo(
                name=source.name, n_layers=args.n_layers, vocab_size=args.vocab_size,
                max_context=args.max_context, tokenizer_json=tok.tokenizer_json,
                chat_template=tok.chat_template, bos_id=tok.bos_id, add_bos=tok.add_bos,
                eos_ids=list(tok.eos_ids),
            )
        return Ready(rank=a.rank, layer_start=start, layer_end=end, device=self.device,
                     kv_bytes_per_page=pool.bytes_per_page, model=info)

    # ---- serving ----------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        while not self.stop.is_set():
            events = dict(poller.poll(200))
            if self.ctl in events:
                msg = self._recv(self.ctl)
                if isinstance(msg, Step):
                    self.plans.append(msg)
                elif isinstance(msg, Shutdown):
                    return
            if self.pull in events:
                self._receive_activations()
            while self.plans and (self.runner.first or self.plans[0].step in self.arrived):
                self._run(self.plans.popleft())
            self._check_parent()

    def _receive_activations(self) -> None:
        try:
            msg, frames = decode(self.pull.recv_multipart(copy=False))
            if not isinstance(msg, Activations):
                raise ProtocolError(f"expected ACTIVATIONS, got {type(msg).__name__}")
            if not msg.shape:  # the previous stage failed this step
                self.arrived[msg.step] = msg
                return
            if msg.dtype != str(self.dtype).removeprefix("torch.") or len(msg.shape) != 2:
                raise ProtocolError(f"activations of dtype {msg.dtype} shape {msg.shape}")
            raw = bytearray(frames[0])
            hidden = torch.empty(0, dtype=torch.uint8)
            if raw:  # frombuffer refuses an empty buffer (a step with no rows)
                hidden = torch.frombuffer(raw, dtype=torch.uint8)
            hidden = hidden.view(self.dtype).reshape(msg.shape).to(self.device)
            self.arrived[msg.step] = (msg, hidden)
        except Exception as e:  # whatever arrives, a malformed frame never stops the worker
            log.warning("dropped bad activations: %s", e)

    def _run(self, plan: Step) -> None:
        runner = self.runner
        upstream = None if runner.first else self.arrived.pop(plan.step)
        ahead, self.ahead = self.ahead, None
        last, self.last_plan = self.last_plan, plan
        try:
            if ahead is not None:
                used = ahead.matches(plan)
                self.metrics.ahead("used" if used else "dropped")
                if used:  # its work is enqueued already
                    self._overlapped(plan, ahead.tokens, ahead.started, follow_on(plan, runner))
                    return
            meta = runner.apply(plan)
            if isinstance(upstream, Activations):
                self._forward_failure(plan.step)
                return
            hidden = None if upstream is None else upstream[1]
            if hidden is not None and hidden.shape != (len(meta.positions), self.dim):
                raise ProtocolError(f"step {plan.step}: activations do not match the plan")
            t0 = time.perf_counter()
            out = runner.forward(plan, meta, hidden)
            nxt = follow_on(plan, runner) if self.overlap and continues(last, plan) else None
            if nxt is not None:
                self._overlapped(plan, runner.greedy(meta, out), t0, nxt)
            elif runner.last:
                self._send_tokens(plan, *runner.sample(plan, meta, out), t0, runner.park_seconds)
            else:
                out = out.contiguous().cpu()  # waits for the device: the stage's whole time
                self.metrics.forward(time.perf_counter() - t0)
                header = Activations(step=plan.step, dtype=str(self.dtype).removeprefix("torch."),
                                     shape=list(out.shape))
                self.push.send_multipart(encode(header, [out.view(torch.uint8).numpy()]),
                                         copy=False)
        except Exception as e:  # a bad plan or a failed kernel fails this step, not the worker
            log.exception("step %d failed", plan.step)
            culprits = [e.seq_id] if isinstance(e, SequenceFault) else []
            self.ctl.send_multipart(encode(StepError(step=plan.step, code="internal",
                                                     message=f"worker {self.rank}: {e}",
                                                     seq_ids=culprits)))
            self._forward_failure(plan.step)

    def _overlapped(self, plan: Step, tokens: torch.Tensor, t0: float, nxt: Step | None
                    ) -> None:
        """Send `plan`'s greedy tokens (on the device, maybe still being computed), and enqueue
        `nxt`, the step that follows it (`follow_on`), if there is one: on a GPU before reading
        the tokens, so that the device goes on while the host waits; on a CPU after sending
        them (the forward pass is synchronous there)."""
        runner = self.runner
        park_seconds = runner.park_seconds  # the next step's apply resets it
        cuda = tokens.device.type == "cuda"
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        ids = [s.id for s in plan.seqs]  # every one samples (follow_on)
        chosen = None
        if not cuda:
            chosen = host.tolist()
            self._send_tokens(plan, ids, chosen, t0, park_seconds)
        guess = None
        if nxt is not None:
            try:
                started = time.perf_counter()
                nxt_meta = runner.apply(nxt)
                out = runner.forward(nxt, nxt_meta, None, tokens)
                guess = (runner.greedy(nxt_meta, out), started)
            except Exception:  # the plan itself is unharmed: the guess is dropped
                log.exception("step %d: the step after it could not be enqueued", plan.step)
        if cuda:
            done.synchronize()
            chosen = host.tolist()
            self._send_tokens(plan, ids, chosen, t0, park_seconds)
        if guess is not None:
            self.ahead = Ahead(nxt, chosen, *guess)

    def _send_tokens(self, plan: Step, seq_ids: list[int], tokens: list[int], t0: float,
                     park_seconds: float) -> None:
        """The last stage's answer: the step's sampled tokens; `t0` when its forward began
        (for a guessed step, when it was enqueued)."""
        elapsed = time.perf_counter() - t0
        self.metrics.forward(elapsed)
        self.ctl.send_multipart(encode(StepResult(
            step=plan.step, seq_ids=seq_ids, tokens=tokens,
            forward_seconds=elapsed, park_seconds=park_seconds,
        )))
        self.last_result = time.monotonic()

    def _forward_failure(self, step: int) -> None:
        if self.push is not None:
            self.push.send_multipart(encode(Activations(step=step, dtype="", shape=[]), [b""]))

    def _recv(self, sock: zmq.Socket):
        try:
            msg, _ = decode(sock.recv_multipart(copy=False))
            return msg
        except ProtocolError as e:
            log.warning("dropped a bad message: %s", e)
            return None

    def _heartbeat(self) -> None:
        """Beats from a thread of its own, skipped while step results come more often: every
        message wakes the coordinator's loop."""
        sock = self._dealer()
        try:
            while not self.stop.wait(HEARTBEAT_SECONDS):
                if time.monotonic() - self.last_result >= HEARTBEAT_SECONDS:
                    sock.send_multipart(encode(Heartbeat(rank=self.rank)))
        finally:
            sock.close()

    def _check_parent(self) -> None:
        if self.parent is not None and os.getppid() != self.parent:
            log.warning("coordinator process went away; worker %d exits", self.rank)
            self.stop.set()
            raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="siding worker", description="a siding worker process")
    p.add_argument("--coordinator", default="tcp://127.0.0.1:5556",
                   help="the coordinator's worker endpoint")
    p.add_argument("--rank", type=int, default=-1, help="pipeline rank (default: by arrival)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--advertise", default="127.0.0.1",
                   help="address the previous stage reaches this worker's activation socket "
                   "on, and Prometheus its metrics")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--curve-keys", default=None, help="directory with CURVE keys")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback activation socket without CURVE")
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--debug", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s worker %(levelname)s %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        worker = Worker(a.coordinator, a.rank, a.device, a.advertise, a.curve_keys, a.insecure,
                        a.exit_with_parent)
    except ValueError as e:
        p.error(str(e))
    worker.run()
