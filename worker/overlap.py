"""Overlapped decode steps, on a worker that is the whole pipeline (first and last stage).

The coordinator plans step N+1 only once step N's tokens are back. Between the two, a worker's
host spends 0.3-0.6 ms (on an H200) turning step N's logits into tokens, sending them, and
enqueuing step N+1, plus the round trip to the coordinator: the device idles all that time, and
with `--kv host` so does the link once the layers primed for step N+1 have landed
(docs/overlap-scheduling.md).

So after enqueuing a step, the worker also enqueues the steps that would follow it
(`follow_on`: one row for each sequence that sampled, one position on, its input the token just
chosen, still on the device: greedy or drawn, since the draw is made on the device and keyed by
(seed, position), worker/sampler.py) before it reads that token on the host: up to
`STEPS_AHEAD` of them, each on the one before's tokens, so that a round trip to the coordinator
longer than a step is hidden too (one on a CPU, where a guess is a whole synchronous step, and
with host KV, whose staging ring was measured with one: `protocol.messages.steps_ahead`). When
the coordinator's plan arrives and is the first of them (`Ahead.matches`: the same sequences,
positions and tokens, nothing freed, parked, restored or copied; pages it adds are taken), its
work is already on the device. A serving load's plan seldom is: about every step a sequence
ends and a new prompt starts. Where the plan holds a part of the guess (`Ahead.split`: the
guessed rows of the sequences still decoding, beside a new prompt or freed sequences), that
part is kept and the plan's other rows run after it as a step of their own, so the device
computes the decode rows during the round trip. Otherwise (the plan parks, restores, copies or
recomputes) the guess and those after it are dropped and the plan runs as usual. The
coordinator gives decoding sequences their pages `STEPS_AHEAD` positions early while pages are
free (coordinator/scheduler.py), so that a page boundary does not stop the guesses.

A dropped step (or a dropped row of a step used in part) costs device time, never bytes: it
computes what the real step would (the same rows of the same sequences on the same pages), and
the K and V rows it writes past each context lie in the sequence's last pages, which it owns
alone (a fork copies the tail page; a cached page is a full one), where the next step to reach
that position writes again before anything reads it; a page freed with its sequence and given
to another in the same plan is written by the plan's other rows after the guess, in stream
order. Exact mode keeps its guarantee: a row's bits do not depend on which step carried it, so a
plan split in two computes the bits of the plan whole.

`--overlap` (`on`, `off`) decides it; `auto`, the default, turns it on for a CUDA device, where
it was measured to help with either KV mode (docs/overlap-scheduling.md). On a CPU the forward
pass is synchronous, so a guess computes a whole step before anything else can run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.messages import SeqPlan, Step

from .runner import ModelRunner


def follow_on(plan: Step, runner: ModelRunner) -> Step | None:
    """The step that continues `plan` if the worker may enqueue it before it is asked: one row
    for each sequence that samples in it (a decode row, or a prompt's last chunk) with room for
    one more position in its pages and in the model's context. The others are left out: a
    prompt chunk before its last has nothing to go on yet, and a sequence at the end of its
    pages needs one that only the coordinator gives (its row is then the plan's, run after the
    guess: `Ahead.split`)."""
    if not (runner.first and runner.last):
        return None
    seqs = []
    max_context = runner.stage.args.max_context
    for s in plan.seqs:
        nxt = s.start + s.n  # pages given ahead end on a page boundary
        if s.sample and nxt < min(len(runner.tables[s.id]) * runner.pool.page_size,
                                  max_context):
            seqs.append(SeqPlan(id=s.id, start=nxt, n=1, sample=True))
    if not seqs:
        return None
    return Step(step=plan.step, seqs=seqs, token_ids=[0] * len(seqs))  # inputs on the device


def as_guessed(s: SeqPlan, g: SeqPlan) -> bool:
    """Whether a plan asks of a sequence the row `g` guessed for it: the same position, one
    row that samples, no new sampling parameters (its input is compared apart)."""
    return s.start == g.start and s.n == 1 and s.sample and s.sampling is None


def take(tokens: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """`tokens` at the places `order` names, in its order (None: all of them as they are)."""
    if order is None or order == list(range(len(tokens))):
        return tokens
    return tokens[torch.tensor(order, device=tokens.device)]


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
    # where its sequences' inputs are among the step before's tokens (None: all of them, in
    # order; a sequence left out of the guess leaves a gap)
    picked: list[int] | None = None

    def read_inputs(self, before: list[int]) -> None:
        """The step before's tokens have reached the host: note this step's inputs among them."""
        self.inputs = before if self.picked is None else [before[k] for k in self.picked]

    def matches(self, plan: Step) -> bool:
        """Whether `plan` is this step exactly: the same sequences at the same positions on
        the same inputs, and nothing else to apply but pages added (no frees, parks, restores,
        copies or sampling parameters), so that skipping the rest of `apply` loses nothing."""
        if (plan.free or plan.park or plan.restore or plan.copies or self.inputs is None
                or plan.token_ids != self.inputs):
            return False
        return len(plan.seqs) == len(self.plan.seqs) and all(
            s.id == g.id and as_guessed(s, g) for s, g in zip(plan.seqs, self.plan.seqs))

    def split(self, plan: Step) -> tuple[list[tuple[int, SeqPlan]], Step] | None:
        """Where `plan` is not this step but holds a part of it: (the plan's rows this step
        computed, each with its place among this step's sequences; the step of the plan's other
        rows, to run after it). A part is what the plan asks of a guessed sequence exactly as
        guessed (the same position, one row, on the same input, no new sampling parameters, not
        freed); the plan may leave guessed sequences out (ended, or not scheduled: their rows
        are dropped) and add others (a new prompt, a prompt's next chunk). None where it parks,
        restores or copies pages, or asks a guessed sequence for something else (a recompute),
        or keeps none of it."""
        if plan.park or plan.restore or plan.copies or self.inputs is None:
            return None
        guessed = {g.id: (i, g) for i, g in enumerate(self.plan.seqs)}
        free = set(plan.free)
        kept, rest, rest_tokens, at = [], [], [], 0
        for s in plan.seqs:
            tokens, at = plan.token_ids[at:at + s.n], at + s.n
            hit = guessed.get(s.id)
            if hit is None:
                rest.append(s)
                rest_tokens += tokens
                continue
            i, g = hit
            if not (as_guessed(s, g) and tokens == [self.inputs[i]] and s.id not in free):
                return None
            kept.append((i, s))
        if not kept:
            return None
        return kept, Step(step=plan.step, seqs=rest, token_ids=rest_tokens, free=plan.free)
