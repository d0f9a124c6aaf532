"""A `Schedule` as the wire's STEP: what every worker is told about one step, written straight
into its frames (`StepColumns`). Reads the scheduler's decisions and changes nothing."""

from __future__ import annotations

import msgspec

from protocol.messages import MsgType, PageCopy, PageMove
from protocol.step_frames import StepColumns
from protocol.wire import message

from .schedule import Schedule


def step_frames(step: int, sched: Schedule, hold: bool = False) -> list:
    """The STEP message numbered `step` that carries out `sched` (`hold`: the worker keeps its
    result until a later step's, `Step.hold`)."""
    c = StepColumns()
    for (seq, n), start, sample, after in zip(sched.batch, sched.starts, sched.samples,
                                              sched.after):
        sampling = None
        if seq.id in sched.announce:
            sampling = msgspec.structs.replace(seq.request.params.sampling, seed=seq.seed)
        c.add(seq.id, start, n, sample, sched.new_pages.get(seq.id, ()), after, sampling)
        if after:
            c.tokens.append(0)  # a placeholder: the worker has the token
        else:
            c.tokens.extend(seq.token_ids[start:start + n])
    fields, frames = c.encode(
        step, sched.free,
        park=[PageMove(id=m.seq.id, pages=m.pages, slots=m.slots) for m in sched.parks],
        restore=[PageMove(id=m.seq.id, pages=m.pages, slots=m.slots, kept=m.kept)
                 for m in sched.restores],
        copies=[PageCopy(src=a, dst=b) for a, b in sched.copies], hold=hold)
    return message(MsgType.STEP, fields, frames)
