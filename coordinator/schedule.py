"""What the scheduler hands out: a step as it decided it (`Schedule`, with its parks and restores
as `Move`s), and what the step's results did (`StepOutput`). Plain data; the scheduler
(`scheduler.py`) fills them, the plan (`plan.py`) and the requests (`requests.py`) read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class Move:
    seq: Sequence
    pages: list[int]  # moved to (park) or from (restore) the park store's slots
    slots: list[int]
    kept: list[int] = field(default_factory=list)  # a restore: the resident pages before them


@dataclass
class Schedule:
    """One step as the scheduler decided it; `plan.step_frames` turns it into the wire's STEP."""

    batch: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, rows)
    parks: list[Move] = field(default_factory=list)
    restores: list[Move] = field(default_factory=list)
    recomputed: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) pages
    # Set when the step is emitted, for each batch entry: where it starts, whether it samples,
    # whether its input is a token still in flight (planned ahead), and its sequence's epoch (a
    # result for an older epoch is stale), ...
    starts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    after: list[bool] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    # ... and what the workers learn with it.
    new_pages: dict[int, list[int]] = field(default_factory=dict)  # sequence id -> pages added
    announce: set[int] = field(default_factory=set)  # sequences whose sampling goes with it
    free: list[int] = field(default_factory=list)  # sequences the workers forget first
    only_first_tokens: bool = False  # it samples, and only sequences' first tokens

    def __bool__(self) -> bool:
        return bool(self.batch or self.parks or self.restores or self.recomputed or self.copies)


@dataclass
class StepOutput:
    """What a step's results did: each sampled token, and the sequences that ended."""

    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    # rows planned on a token in flight: applied, or computed for nothing (the sequence had
    # ended by then, or recomputes)
    ahead_used: int = 0
    ahead_dropped: int = 0
