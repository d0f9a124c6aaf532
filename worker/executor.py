"""The step executor: runs one plan on this worker's layers and hands on what it produced, the
next stage's activations or (on the last stage) the sampled tokens; with overlap, enqueues the
step that follows a decode step before reading its tokens (worker/overlap.py).

It knows plans and tensors, not sockets: the process gives it where results and activations go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from protocol.errors import ProtocolError
from protocol.messages import Activations, Step, StepError, StepResult

from .metrics import WorkerMetrics
from .overlap import Ahead, continues, follow_on
from .runner import ModelRunner, SequenceFault

log = logging.getLogger("siding.worker")

# A message to the coordinator; activations and their raw frames to the next stage.
ToCoordinator = Callable[[object], None]
ToNext = Callable[[Activations, list], None]


class StepExecutor:
    def __init__(self, runner: ModelRunner, rank: int, dtype: torch.dtype, overlap: bool,
                 metrics: WorkerMetrics, to_coordinator: ToCoordinator, to_next: ToNext | None):
        self.runner = runner
        self.rank = rank
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.dim = runner.stage.args.dim
        self.overlap = overlap
        self.metrics = metrics
        self.to_coordinator = to_coordinator
        self.to_next = to_next
        self.ahead: Ahead | None = None  # a step enqueued before its plan arrived
        self.last_plan: Step | None = None  # the last plan run, to tell a steady batch
        self.forward_seconds, self.steps = 0.0, 0  # forward passes so far (the heartbeats)

    def run(self, plan: Step, upstream: Activations | tuple[Activations, torch.Tensor] | None
            ) -> None:
        """Run `plan`; `upstream` is the previous stage's activations for it (None on the
        first stage; a bare Activations: that stage failed the step)."""
        runner = self.runner
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
                self.forward_failure(plan.step)
                return
            hidden = None if upstream is None else upstream[1]
            if hidden is not None and hidden.shape != (len(meta.positions), self.dim):
                raise ProtocolError(f"step {plan.step}: activations do not match the plan")
            t0 = time.perf_counter()
            out = runner.forward(plan, meta, hidden)
            nxt = follow_on(plan, runner) if self.overlap and continues(last, plan) else None
            if nxt is not None:
                self._overlapped(plan, runner.draw(plan, meta, out), t0, nxt)
            elif runner.last:
                self._send_tokens(plan, *runner.sample(plan, meta, out), t0, runner.park_seconds)
            else:
                out = out.contiguous().cpu()  # waits for the device: the stage's whole time
                self._forwarded(time.perf_counter() - t0)
                header = Activations(step=plan.step, dtype=self.dtype_name, shape=list(out.shape))
                self.to_next(header, [out.view(torch.uint8).numpy()])
        except Exception as e:  # a bad plan or a failed kernel fails this step, not the worker
            log.exception("step %d failed", plan.step)
            culprits = [e.seq_id] if isinstance(e, SequenceFault) else []
            self.to_coordinator(StepError(step=plan.step, code="internal",
                                          message=f"worker {self.rank}: {e}", seq_ids=culprits))
            self.forward_failure(plan.step)

    def _forwarded(self, seconds: float) -> None:
        self.metrics.forward(seconds)
        self.forward_seconds += seconds
        self.steps += 1

    def forward_failure(self, step: int) -> None:
        """Tell the next stage that this step failed here (it fails the step too)."""
        if self.to_next is not None:
            self.to_next(Activations(step=step, dtype="", shape=[]), [b""])

    def _overlapped(self, plan: Step, tokens: torch.Tensor, t0: float, nxt: Step | None
                    ) -> None:
        """Send `plan`'s tokens (on the device, maybe still being computed), and enqueue
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
                guess = (runner.draw(nxt, nxt_meta, out), started)
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
        self._forwarded(elapsed)
        self.to_coordinator(StepResult(step=plan.step, seq_ids=seq_ids, tokens=tokens,
                                       forward_seconds=elapsed, park_seconds=park_seconds))
