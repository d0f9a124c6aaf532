"""Steps taken ahead, on a worker that is the whole pipeline (first and last stage).

A plain decode step is serial: the device runs step N while the host waits for its tokens,
sends them to the engine core, which plans step N+1 from them and sends it back; the device
idles all that time (0.3-0.6 ms of the worker's host on an H200, plus the round trip), and with
`--kv host` so does the link once the layers primed for step N+1 have landed.

So the engine core plans ahead (coordinator/scheduler.py): it keeps up to 1 + `steps_ahead`
steps in flight, and a sequence whose rows in flight end in a sampled token may have its next
row in a later one, its input "the token this sequence drew last" (`SeqPlan.after`), which
only the worker has, on the device (`ModelRunner.drawn`: greedy or drawn there, keyed by (seed,
position), worker/sampler.py). The worker enqueues each plan as it arrives, behind the steps
still running, and sends each step's tokens as soon as they land (`TokenCopy`: a pinned copy
and an event, so that reading them waits for that step only), in step order. The device then
has the next step while this one's tokens travel, and the step after it is the engine core's
whole plan: new prompts and decode rows together, in one step.

A row planned past a token that ends its sequence (a stop token only the result shows) costs a
row of device time, never bytes: its K and V go past the sequence's context, in its last page,
which it owns alone (a fork copies the tail page; a cached page is a full one), and a page
freed with it is given to another sequence only in a later plan, which runs after it.

`--overlap` (`on`, `off`) decides it; `auto`, the default, turns it on for a CUDA device
(docs/overlap-scheduling.md). On a CPU the forward pass is synchronous, so a step's tokens are
sent as it is run; the engine core still plans the next step while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def landed(self) -> bool:
        return self.done is None or self.done.query()

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


@dataclass
class Enqueued:
    """A step on the device whose tokens the engine core has not been sent yet."""

    step: int
    seq_ids: list[int]  # the sequences that sample in it, in order
    copy: TokenCopy
    started: float  # perf_counter when it was enqueued
    park_seconds: float  # its parks and restores
    hold: bool  # its result waits for a later step's (Step.hold)
