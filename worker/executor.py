"""The step executor: runs one plan on this worker's layers and hands on what it produced, the
next stage's activations or (on the last stage) the sampled tokens. A worker that is the whole
pipeline takes plans ahead (worker/overlap.py): it enqueues a plan, maybe on the tokens of steps
still on the device, and sends each step's tokens once they land, so the device runs one step
while the next one's plan travels. A step that holds (`Step.hold`, --multi-step) has its result
kept until that of the next step that does not, and then sent just before it: the engine core
hears of the whole group in one wake.

It knows plans and tensors, not sockets: the process gives it where results and activations go.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from protocol.errors import ProtocolError
from protocol.messages import Activations, Step, StepError, StepResult

from .metrics import WorkerMetrics
from .overlap import Enqueued, TokenCopy
from .runner import ModelRunner, SequenceFault

log = logging.getLogger("siding.worker")

# A message to the coordinator; activations and their raw frames to the next stage.
ToCoordinator = Callable[[object], None]
ToNext = Callable[[Activations, list], None]


class StepExecutor:
    def __init__(self, runner: ModelRunner, rank: int, dtype: torch.dtype, steps_ahead: int,
                 metrics: WorkerMetrics, to_coordinator: ToCoordinator, to_next: ToNext | None):
        self.runner = runner
        self.rank = rank
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.dim = runner.stage.args.dim
        # plans taken ahead of the steps before them (a stage of a split takes none)
        self.ahead = steps_ahead > 0 and runner.first and runner.last
        self.metrics = metrics
        self.to_coordinator = to_coordinator
        self.to_next = to_next
        self.enqueued: deque[Enqueued] = deque()  # steps whose tokens are not sent yet, in order
        self.held: list[StepResult] = []  # results of holding steps, for the group's last
        self.landed_at = 0.0  # perf_counter when the last step answered was seen to land
        self.forward_seconds, self.steps = 0.0, 0  # forward passes so far (the heartbeats)

    def run(self, plan: Step, upstream: Activations | tuple[Activations, torch.Tensor] | None
            ) -> None:
        """Run `plan`; `upstream` is the previous stage's activations for it (None on the
        first stage; a bare Activations: that stage failed the step)."""
        runner = self.runner
        try:
            meta = runner.apply(plan)
            if isinstance(upstream, Activations):
                self.forward_failure(plan.step)
                return
            hidden = None if upstream is None else upstream[1]
            if hidden is not None and hidden.shape != (len(meta.positions), self.dim):
                raise ProtocolError(f"step {plan.step}: activations do not match the plan")
            t0 = time.perf_counter()
            if self.ahead:
                self.metrics.ahead("queued" if self._device_busy() else "idle")
            out = runner.forward(plan, meta, hidden)
            if self.ahead:
                tokens = runner.draw(plan, meta, out)
                self.enqueued.append(Enqueued(plan.step, [s.id for s in plan.seqs if s.sample],
                                              TokenCopy.start(tokens), t0, runner.park_seconds,
                                              plan.hold))
                if self.enqueued[-1].copy.done is None:  # a CPU: the step is done already
                    self.answer()
            elif runner.last:
                self._send_tokens(plan.step, *runner.sample(plan, meta, out), t0,
                                  runner.park_seconds, plan.hold)
            else:
                out = out.contiguous().cpu()  # waits for the device: the stage's whole time
                self._forwarded(time.perf_counter() - t0)
                header = Activations(step=plan.step, dtype=self.dtype_name, shape=list(out.shape))
                self.to_next(header, [out.view(torch.uint8).numpy()])
        except Exception as e:  # a bad plan or a failed kernel fails this step, not the worker
            for s in plan.seqs:  # no row may be planned on what it did not draw
                runner.drawn.pop(s.id, None)
            self._failed(plan.step, e)
            self.forward_failure(plan.step)

    def _failed(self, step: int, e: Exception) -> None:
        """Tell the coordinator that `step` failed here, naming the sequence at fault if one
        is."""
        log.exception("step %d failed", step)
        culprits = [e.seq_id] if isinstance(e, SequenceFault) else []
        self._answer(StepError(step=step, code="internal", message=f"worker {self.rank}: {e}",
                               seq_ids=culprits))

    def _device_busy(self) -> bool:
        """Whether a step enqueued before is still running, so that the next one queues behind
        it rather than finding the device idle."""
        return bool(self.enqueued) and not self.enqueued[-1].copy.landed()

    def answer_landed(self, keep: int = 0) -> None:
        """Send the tokens of the oldest enqueued steps that have landed, leaving at least `keep`
        enqueued (1: only while a later step keeps the device busy)."""
        while len(self.enqueued) > keep and self.enqueued[0].copy.landed():
            self.answer()

    def answer(self) -> None:
        """Send the oldest enqueued step's tokens, waiting for them. Its forward time runs from
        when it was enqueued or the step before it landed, whichever was later."""
        e = self.enqueued.popleft()
        try:
            tokens = e.copy.read()
        except Exception as err:  # a kernel that failed shows here
            self._failed(e.step, err)
            return
        started, self.landed_at = max(e.started, self.landed_at), time.perf_counter()
        self._send_tokens(e.step, e.seq_ids, tokens, started, e.park_seconds, e.hold)

    def _forwarded(self, seconds: float) -> None:
        self.metrics.forward(seconds)
        self.forward_seconds += seconds
        self.steps += 1

    def forward_failure(self, step: int) -> None:
        """Tell the next stage that this step failed here (it fails the step too)."""
        if self.to_next is not None:
            self.to_next(Activations(step=step, dtype="", shape=[]), [b""])

    def _send_tokens(self, step: int, seq_ids: list[int], tokens: list[int], t0: float,
                     park_seconds: float, hold: bool) -> None:
        """The last stage's answer: the step's sampled tokens; `t0` when its forward began."""
        elapsed = time.perf_counter() - t0
        self._forwarded(elapsed)
        result = StepResult(step=step, seq_ids=seq_ids, tokens=tokens, forward_seconds=elapsed,
                            park_seconds=park_seconds)
        if hold:
            self.held.append(result)
        else:
            self._answer(result)

    def _answer(self, msg: StepResult | StepError) -> None:
        """Send a step's result or error to the coordinator, after the held results of the
        steps before it, in step order."""
        for result in self.held:
            self.to_coordinator(result)
        self.held.clear()
        self.to_coordinator(msg)
