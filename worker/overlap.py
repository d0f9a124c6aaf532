"""Overlapped decode steps, on a worker that is the whole pipeline (first and last stage).

The coordinator plans step N+1 only once step N's tokens are back. Between the two, a worker's
host spends 0.3-0.6 ms (on an H200) turning step N's logits into tokens, sending them, and
enqueuing step N+1, plus the round trip to the coordinator: the device idles all that time, and
with `--kv host` so does the link once the layers primed for step N+1 have landed
(docs/overlap-scheduling.md).

So after enqueuing a decode step in which every sequence decodes, the worker also enqueues the
steps that would follow it (`follow_on`: each sequence one position on, its input the token just
chosen, still on the device: greedy or drawn, since the draw is made on the device and keyed by
(seed, position), worker/sampler.py) before it reads that token on the host: up to
`STEPS_AHEAD` of them, each on the one before's tokens, so that a round trip to the coordinator
longer than a step is hidden too (one on a CPU, where a guess is a whole synchronous step, and
with host KV, whose staging ring was measured with one: `protocol.messages.steps_ahead`). When
the coordinator's plan arrives and is the first of them (`Ahead.matches`: the same sequences,
positions and tokens, nothing freed, parked, restored or copied; pages it adds are taken), its
work is already on the device; otherwise it and those after it are dropped and the plan runs as
usual. Only a worker whose last steps continued one another guesses (`continues`): right after
the batch changed, it is likely to change again. The coordinator gives decoding sequences their
pages `STEPS_AHEAD` positions early while pages are free (coordinator/scheduler.py), so that a
page boundary does not stop the guesses.

A dropped step costs device time, never bytes: it computes what the real step would (the same
rows of the same sequences on the same pages), and the K and V rows it writes past each context
lie in the sequence's last pages, which it owns alone (a fork copies the tail page; a cached page
is a full one), where the next step to reach that position writes again before anything reads
it. Exact mode keeps its guarantee: a row's bits do not depend on which step carried it.

`--overlap` (`on`, `off`) decides it; `auto`, the default, turns it on for a CUDA device, where
it was measured to help with either KV mode (docs/overlap-scheduling.md). On a CPU the forward
pass is synchronous, so a guess computes a whole step before anything else can run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.messages import SeqPlan, Step

from .runner import ModelRunner


def continues(last: Step | None, plan: Step) -> bool:
    """Whether `plan` is a decode step of exactly `last`'s sequences, each one position on."""
    return (last is not None and len(plan.seqs) == len(last.seqs)
            and all(s.id == p.id and s.n == 1 and s.start == p.start + p.n
                    for s, p in zip(plan.seqs, last.seqs)))


def follow_on(plan: Step, runner: ModelRunner) -> Step | None:
    """The step that continues `plan` if the worker may enqueue it before it is asked: every
    sequence decodes and has room for one more position in its pages and in the model's
    context."""
    if not (runner.first and runner.last and plan.seqs):
        return None
    seqs = []
    max_context = runner.stage.args.max_context
    for s in plan.seqs:
        if s.n != 1 or not s.sample:
            return None
        # the next position needs a page only the coordinator can give, or lies past the
        # model's positions (pages given ahead end on a page boundary)
        if s.start + 2 > min(len(runner.tables[s.id]) * runner.pool.page_size, max_context):
            return None
        seqs.append(SeqPlan(id=s.id, start=s.start + 1, n=1, sample=True))
    return Step(step=plan.step, seqs=seqs, token_ids=[0] * len(seqs))  # inputs on the device


@dataclass
class TokenCopy:
    """A step's tokens on their way to the host: a pinned copy enqueued right behind the step,
    so that reading them waits for that step only, not for steps enqueued after it."""

    host: torch.Tensor
    done: torch.cuda.Event | None  # None on a CPU, where the copy is made at once

    @classmethod
    def start(cls, tokens: torch.Tensor) -> TokenCopy:
        cuda = tokens.device.type == "cuda"
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return cls(host, done)

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


@dataclass
class Ahead:
    """A step enqueued before its plan arrived."""

    plan: Step  # as guessed: its token ids are placeholders
    inputs: list[int] | None  # the tokens it was enqueued on (the step before's), once read
    tokens: torch.Tensor  # its tokens, on the device
    started: float  # perf_counter when it was enqueued: its forward time counts from there
    copy: TokenCopy | None = None  # its tokens' copy to the host, started when it was enqueued

    def matches(self, plan: Step) -> bool:
        """Whether `plan` is this step exactly: the same sequences at the same positions on
        the same inputs, and nothing else to apply but pages added (no frees, parks, restores,
        copies or sampling parameters), so that skipping the rest of `apply` loses nothing."""
        if (plan.free or plan.park or plan.restore or plan.copies or self.inputs is None
                or plan.token_ids != self.inputs):
            return False
        return len(plan.seqs) == len(self.plan.seqs) and all(
            s.id == g.id and s.start == g.start and s.n == 1 and s.sample and s.sampling is None
            for s, g in zip(plan.seqs, self.plan.seqs))
