"""The step executor: runs one plan on this worker's layers and hands on what it produced, the
next stage's activations or (on the last stage) the sampled tokens; with overlap, enqueues the
steps that follow a step before reading its tokens, and answers a plan from them, whole or in
part (worker/overlap.py).

It knows plans and tensors, not sockets: the process gives it where results and activations go.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from protocol.errors import ProtocolError
from protocol.messages import Activations, SeqPlan, Step, StepError, StepResult

from .metrics import WorkerMetrics
from .overlap import Ahead, TokenCopy, follow_on, take
from .runner import ModelRunner, SequenceFault

log = logging.getLogger("siding.worker")

DEEPEN_AFTER = 8  # guesses used in a row before more than one step is kept ahead

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
        self.depth = steps_ahead if runner.first and runner.last else 0  # a stage of a split: none
        self.metrics = metrics
        self.to_coordinator = to_coordinator
        self.to_next = to_next
        # steps enqueued before their plans arrived, oldest first, each on the one before's
        # tokens (worker/overlap.py)
        self.ahead: deque[Ahead] = deque()
        self.used_streak = 0  # guesses used in a row: past DEEPEN_AFTER, `depth` are kept ahead
        self.forward_seconds, self.steps = 0.0, 0  # forward passes so far (the heartbeats)

    def run(self, plan: Step, upstream: Activations | tuple[Activations, torch.Tensor] | None
            ) -> None:
        """Run `plan`; `upstream` is the previous stage's activations for it (None on the
        first stage; a bare Activations: that stage failed the step)."""
        runner = self.runner
        try:
            if self.ahead:
                ahead = self.ahead.popleft()
                if ahead.matches(plan):  # its work is enqueued already
                    self.metrics.ahead("used")
                    self.used_streak += 1
                    for s in plan.seqs:
                        runner.add_pages(s)
                    self._overlapped(plan, ahead.tokens, ahead.started, ahead.copy)
                    return
                split = ahead.split(plan)
                self.metrics.ahead("dropped" if split is None else "partial")
                self._drop_ahead()  # those after it were enqueued on it whole
                if split is not None:
                    self._partly(ahead, *split)
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
            if self.depth:
                self._overlapped(plan, runner.draw(plan, meta, out), t0)
            elif runner.last:
                self._send_tokens(plan, *runner.sample(plan, meta, out), t0, runner.park_seconds)
            else:
                out = out.contiguous().cpu()  # waits for the device: the stage's whole time
                self._forwarded(time.perf_counter() - t0)
                header = Activations(step=plan.step, dtype=self.dtype_name, shape=list(out.shape))
                self.to_next(header, [out.view(torch.uint8).numpy()])
        except Exception as e:  # a bad plan or a failed kernel fails this step, not the worker
            log.exception("step %d failed", plan.step)
            self._drop_ahead()
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

    def _drop_ahead(self) -> None:
        for _ in self.ahead:
            self.metrics.ahead("dropped")
        self.ahead.clear()
        self.used_streak = 0

    def _partly(self, ahead: Ahead, kept: list[tuple[int, SeqPlan]], rest: Step) -> None:
        """Answer a plan that holds a part of a guessed step (`Ahead.split`): that part's tokens
        are enqueued already; the rest of the plan (its other sequences, its frees) runs after
        it as a step of its own. The plan's answer names the kept sequences first."""
        runner = self.runner
        for _, s in kept:
            runner.add_pages(s)
        tokens = take(ahead.tokens, [i for i, _ in kept])  # some left out, or reordered
        seqs = [s for _, s in kept]
        if rest.seqs or rest.free:
            meta = runner.apply(rest)
            if rest.seqs:
                out = runner.forward(rest, meta, None)
                tokens = torch.cat([tokens, runner.draw(rest, meta, out)])
                seqs += rest.seqs
        self._overlapped(Step(step=rest.step, seqs=seqs, token_ids=[]), tokens, ahead.started)

    def _overlapped(self, plan: Step, tokens: torch.Tensor, t0: float,
                    copy: TokenCopy | None = None) -> None:
        """Send `plan`'s tokens (on the device, maybe still being computed; `copy`: their copy
        to the host, if it was started) and top up the steps enqueued ahead of it, where they
        can be guessed. With a step still enqueued behind `plan` the device is busy: the tokens
        go as soon as they land, then more is enqueued. Without, on a GPU, the next step is
        enqueued first, so that the device goes on while the host waits; on a CPU the forward
        pass is synchronous and the tokens are there already."""
        park_seconds = self.runner.park_seconds  # the next step's apply resets it
        copy = copy or TokenCopy.start(tokens)
        ids = [s.id for s in plan.seqs if s.sample]
        if self.ahead or copy.done is None:
            chosen = copy.read()
            self._send_tokens(plan, ids, chosen, t0, park_seconds)
            self._enqueue_ahead(plan, tokens)
        else:
            self._enqueue_ahead(plan, tokens)
            chosen = copy.read()
            self._send_tokens(plan, ids, chosen, t0, park_seconds)
        if self.ahead and self.ahead[0].inputs is None:  # the step after `plan`
            self.ahead[0].read_inputs(chosen)

    def _enqueue_ahead(self, plan: Step, tokens: torch.Tensor) -> None:
        """Enqueue the steps that follow `plan` (whose tokens are `tokens`, on the device) or the
        last step already ahead of it: one while the batch keeps changing, `depth` once guesses
        have been used DEEPEN_AFTER times in a row (each dropped guess is a step of device time,
        and those enqueued after it are dropped with it)."""
        runner = self.runner
        if self.ahead:
            plan, tokens = self.ahead[-1].plan, self.ahead[-1].tokens
        depth = self.depth if self.used_streak >= DEEPEN_AFTER else min(self.depth, 1)
        while len(self.ahead) < depth:
            nxt = follow_on(plan, runner)
            if nxt is None:
                return
            picked = None
            sampled = [s.id for s in plan.seqs if s.sample]  # `tokens` are theirs, in order
            if len(nxt.seqs) < len(sampled):  # some are left out: their tokens are no inputs
                where = {seq_id: k for k, seq_id in enumerate(sampled)}
                picked = [where[s.id] for s in nxt.seqs]
            try:
                started = time.perf_counter()
                meta = runner.apply(nxt)
                out = runner.forward(nxt, meta, None, take(tokens, picked))
                tokens = runner.draw(nxt, meta, out)
            except Exception:  # the plans themselves are unharmed: the guess is not made
                log.exception("a decode step could not be enqueued ahead of its plan")
                return
            self.ahead.append(Ahead(nxt, None, tokens, started, TokenCopy.start(tokens),
                                    picked))
            plan = nxt

    def _send_tokens(self, plan: Step, seq_ids: list[int], tokens: list[int], t0: float,
                     park_seconds: float) -> None:
        """The last stage's answer: the step's sampled tokens; `t0` when its forward began
        (for a guessed step, when it was enqueued)."""
        elapsed = time.perf_counter() - t0
        self._forwarded(elapsed)
        self.to_coordinator(StepResult(step=plan.step, seq_ids=seq_ids, tokens=tokens,
                                       forward_seconds=elapsed, park_seconds=park_seconds))
