"""What a request's tokens become on its frontend: each choice's text and stop strings, the
stream chunks (text that could still become a stop string held back), and one result. No
sockets, no scheduling."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from protocol.messages import Choice, Generate, Result, Usage
from protocol.wire import ChunkFrames

from .text import Detokenizer, TextCodec, find_stop

SETTLE_CHARS = 256  # an unstreamed choice's tail past its hold, settled once it is longer
JOIN_PIECES = 64  # settled pieces joined into one, so that a long stream is not 1 string a token


@dataclass(eq=False, slots=True)
class ChoiceText:
    """A choice's text (stop strings cut) is `settled`, `pieces`, then `tail`. The first two
    hold text no stop string can still begin in that was streamed already (or, unstreamed, lies
    past the hold), so that a token appends to a short tail rather than copying the whole
    text."""
    index: int
    detok: Detokenizer
    frames: ChunkFrames
    token_ids: list[int] = field(default_factory=list)  # generated
    settled: list[str] = field(default_factory=list)  # each JOIN_PIECES pieces joined
    pieces: list[str] = field(default_factory=list)  # settled since
    tail: str = ""
    finish_reason: str | None = None
    ended: bool = False  # the core has ended it too (preemptions are final)
    preemptions: int = 0
    sent_tokens: int = 0
    final_sent: bool = False

    @property
    def text(self) -> str:
        return "".join(self.settled) + "".join(self.pieces) + self.tail

    def settle(self, chars: int) -> str:
        """Move the tail's first `chars` characters to the settled text; returns them."""
        done, self.tail = self.tail[:chars], self.tail[chars:]
        if done:
            self.pieces.append(done)
            if len(self.pieces) == JOIN_PIECES:  # a stream settles a piece a token
                self.settled.append("".join(self.pieces))
                self.pieces.clear()
        return done


class RequestOutput:
    def __init__(self, key: int, client: bytes, msg: Generate, prompt_ids: list[int] | array,
                 codec: TextCodec):
        self.key = key
        self.client = client  # the client's ROUTER identity
        self.msg = msg
        self.prompt_ids = prompt_ids
        self.choices = [ChoiceText(i, Detokenizer(codec, prompt_ids),
                                   ChunkFrames(msg.request_id, i)) for i in range(msg.sampling.n)]
        self.hold = max((len(s) for s in msg.sampling.stop), default=1) - 1
        self.last_sent = 0.0  # when the client last heard of it (keepalives)
        self.arrival = 0.0  # time.monotonic() when it reached the frontend
        self.first_token_at: float | None = None
        self.keepalive = self.choices[0].frames.encode([])  # an empty chunk
        self.done = False  # the core has ended every choice

    def add_token(self, index: int, token: int, stop_token: bool) -> bool:
        """A choice's next token (`stop_token`: the core ended the choice on it, so it is not
        text). Returns whether a stop string ended the choice here."""
        c = self.choices[index]
        if c.finish_reason is not None:
            return False  # computed before the core heard of the stop string
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        c.token_ids.append(token)
        if stop_token or not (piece := c.detok.push(token)):
            return False
        searched = len(c.tail)
        c.tail += piece
        stop = self.msg.sampling.stop
        cut = find_stop(c.tail, stop, searched) if stop else None
        if cut is None:
            if not self.msg.stream and len(c.tail) > self.hold + SETTLE_CHARS:
                c.settle(len(c.tail) - self.hold)  # chunks() settles a stream's text
            return False
        c.tail, c.finish_reason = c.tail[:cut], "stop"
        return True

    def end(self, index: int, reason: str, preemptions: int) -> None:
        """The core ended a choice; a stop string's `stop` stands over what it says."""
        c = self.choices[index]
        if c.finish_reason is None:
            c.finish_reason = reason
        c.ended, c.preemptions = True, preemptions
        self.done = all(c.ended for c in self.choices)

    def chunks(self) -> list[bytes]:
        """Chunks (`ChunkFrames.header`s) for what each choice produced since the last call: its
        text but the last `hold` characters, which could still begin a stop string (all of it
        once the choice is done). What is sent is settled."""
        out = []
        for c in self.choices:
            done = c.finish_reason is not None
            new_tokens = c.token_ids[c.sent_tokens:]
            if c.final_sent or not (new_tokens or done):
                continue
            text = c.settle(len(c.tail) if done else max(0, len(c.tail) - self.hold))
            out.append(c.frames.header(new_tokens, text, c.finish_reason))
            c.sent_tokens, c.final_sent = len(c.token_ids), done
        return out

    def log_line(self, now: float, cut_short: str | None = None) -> str:
        """The request log's line for it, once done, or once `cut_short` (why it ended early:
        `aborted (by the client)`, ...) in place of its choices' finish reasons."""
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.arrival:.3f}s"
        c = self.choices
        ended = cut_short or ",".join(x.finish_reason or "-" for x in c)
        return (f"request {self.msg.request_id}: {len(self.prompt_ids)} prompt + "
                f"{sum(len(x.token_ids) for x in c)} output tokens, ttft {ttft}, "
                f"{now - self.arrival:.3f}s, {ended}, {sum(x.preemptions for x in c)} preemptions")

    def result(self) -> Result:
        return Result(
            request_id=self.msg.request_id, prompt_token_ids=list(self.prompt_ids),
            choices=[Choice(index=c.index, token_ids=c.token_ids, text=c.text,
                            finish_reason=c.finish_reason, preemptions=c.preemptions)
                     for c in self.choices],
            usage=Usage(prompt_tokens=len(self.prompt_ids),
                        completion_tokens=sum(len(c.token_ids) for c in self.choices)),
        )
