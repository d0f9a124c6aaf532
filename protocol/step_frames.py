"""STEP on the wire: the plan's rare parts in a small msgpack header (`StepHeader`), its
per-sequence columns and token ids as three raw int64 frames, checked whole rather than item by
item.

A step is the one message a worker decodes on the critical path of every step. Field by field,
as the other messages are, a step of 256 decoding sequences cost the worker about 0.4 ms to
decode and the core 0.25 ms to encode on a 2-core VM (more than a whole H200 decode step's host
budget); as columns it costs about a tenth. The checks are the same: every id, position and page
id non-negative, every count in range, the frames exactly as long as the header says.

    frame 0, sequences  int64 [n_seqs, 6]: id, start, n, sample (0 or 1), pages added,
                                           after (0 or 1: its input is the token it last sampled)
    frame 1, pages      int64 [n_pages]: each sequence's added pages, in sequence order
    frame 2, token ids  int64 [n_tokens]: the step's input ids (first stage), in row order
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Annotated

from msgspec import Meta

from .errors import ProtocolError
from .messages import (
    MAX_LIST,
    MAX_TOKENS_LIST,
    Count,
    Ints,
    PageCopy,
    PageMove,
    SeqPlan,
    Step,
    Wire,
)
from .sampling import SamplingParams

COLUMNS = 6  # id, start, n, sample, pages added, after
FRAMES = 3
_SWAP = sys.byteorder != "little"  # the frames are little-endian


class SeqSampling(Wire):
    seq: Annotated[int, Meta(ge=0, le=MAX_LIST - 1)]  # the sequence's index in the step
    sampling: SamplingParams


class StepHeader(Wire):
    step: Count
    n_seqs: Annotated[int, Meta(ge=0, le=MAX_LIST)] = 0
    n_pages: Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIST)] = 0
    n_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIST)] = 0
    sampling: Annotated[list[SeqSampling], Meta(max_length=MAX_LIST)] = []
    free: Ints = []
    park: Annotated[list[PageMove], Meta(max_length=MAX_LIST)] = []
    restore: Annotated[list[PageMove], Meta(max_length=MAX_LIST)] = []
    copies: Annotated[list[PageCopy], Meta(max_length=MAX_LIST)] = []
    hold: bool = False


def _little(a: array) -> array:
    """An int64 array in the frames' byte order (in place), or back from it."""
    if _SWAP:
        a.byteswap()
    return a


class StepColumns:
    """A STEP's sequences written straight into its frames, one `add` a sequence: the engine
    core plans each step this way, without a `SeqPlan` a sequence (half the cost of a plan of 64
    decoding sequences on a 2-core VM, `siding bench core-step`)."""

    def __init__(self) -> None:
        self.cols, self.pages, self.tokens = array("q"), array("q"), array("q")
        self.sampling: list[SeqSampling] = []

    def add(self, seq_id: int, start: int, n: int, sample: bool, pages_add: Sequence[int],
            after: bool, sampling: SamplingParams | None = None) -> None:
        """The next sequence's columns and added pages (its input ids go to `tokens`)."""
        if sampling is not None:
            self.sampling.append(SeqSampling(len(self.cols) // COLUMNS, sampling))
        self.cols.extend((seq_id, start, n, 1 if sample else 0, len(pages_add),
                          1 if after else 0))
        self.pages.extend(pages_add)

    def encode(self, step: int, free: list[int], park: list[PageMove],
               restore: list[PageMove], copies: list[PageCopy], hold: bool = False
               ) -> tuple[dict, list[array]]:
        """(the header map, the three frames) of the step numbered `step`."""
        header = {"step": step, "n_seqs": len(self.cols) // COLUMNS, "n_pages": len(self.pages),
                  "n_tokens": len(self.tokens), "sampling": self.sampling, "free": free,
                  "park": park, "restore": restore, "copies": copies}
        if hold:  # absent is False: most steps
            header["hold"] = True
        return header, [_little(self.cols), _little(self.pages), _little(self.tokens)]


def encode_step(step: Step) -> tuple[dict, list[array]]:
    """`step` -> (its header map, its three frames)."""
    c = StepColumns()
    for s in step.seqs:
        c.add(s.id, s.start, s.n, s.sample, s.pages_add, s.after, s.sampling)
    c.tokens.extend(step.token_ids)
    return c.encode(step.step, step.free, step.park, step.restore, step.copies, step.hold)


def _column(frame: memoryview, n: int, what: str) -> array:
    if frame.nbytes != 8 * n:
        raise ProtocolError(f"STEP's {what} frame holds {frame.nbytes} bytes; the header says "
                            f"{n} int64 values")
    a = array("q")
    a.frombytes(frame if frame.format == "B" else frame.cast("B"))
    _little(a)
    if n and min(a) < 0:
        raise ProtocolError(f"STEP's {what} must not be negative")
    return a


def decode_step(h: StepHeader, frames: list[memoryview]) -> Step:
    """A STEP's decoded header and FRAMES frames -> the Step; raises ProtocolError."""
    cols = _column(frames[0], COLUMNS * h.n_seqs, "sequences")
    pages = _column(frames[1], h.n_pages, "pages").tolist()
    tokens = _column(frames[2], h.n_tokens, "token ids").tolist()
    if h.n_seqs:
        if min(cols[2::COLUMNS]) < 1:
            raise ProtocolError("STEP: a sequence with no rows")
        if max(cols[3::COLUMNS]) > 1:
            raise ProtocolError("STEP: a sequence's sample flag is neither 0 nor 1")
        if max(cols[5::COLUMNS]) > 1:
            raise ProtocolError("STEP: a sequence's after flag is neither 0 nor 1")
        if sum(cols[4::COLUMNS]) != h.n_pages:
            raise ProtocolError("STEP: the sequences' page counts do not add up to its pages")
    seqs, k, row = [], 0, cols.tolist()
    for i in range(0, len(row), COLUMNS):
        sid, start, n, sample, count, after = row[i:i + COLUMNS]
        seqs.append(SeqPlan(sid, start, n, pages[k:k + count], sample == 1, None, after == 1))
        k += count
    for x in h.sampling:
        if x.seq >= h.n_seqs:
            raise ProtocolError(f"STEP: sampling for sequence {x.seq} of {h.n_seqs}")
        seqs[x.seq].sampling = x.sampling
    return Step(step=h.step, seqs=seqs, token_ids=tokens, free=h.free, park=h.park,
                restore=h.restore, copies=h.copies, hold=h.hold)
