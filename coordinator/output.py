"""What a sampled token does to its sequence (text, stop conditions) and what the client is
sent: stream chunks with stop strings held back, then one result. No sockets, no scheduling."""

from __future__ import annotations

from protocol.messages import Choice, Chunk, Result, Usage

from .sequence import Request, Sequence
from .text import find_stop


def append_token(seq: Sequence, token: int, eos_ids: frozenset[int], max_context: int) -> bool:
    """Add a sampled token; returns whether the sequence finished (finish_reason is set)."""
    p = seq.request.params
    seq.token_ids.append(token)
    stop = (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids
    if not stop:
        searched = len(seq.text)
        seq.text += seq.detok.push(token)
        cut = find_stop(seq.text, p.stop, searched) if p.stop else None
        if cut is not None:
            seq.text = seq.text[:cut]
            stop = True
    if stop:
        seq.finish_reason = "stop"
    elif len(seq.generated) >= p.max_tokens or len(seq.token_ids) >= max_context:
        seq.finish_reason = "length"
    return seq.finish_reason is not None


def stream_chunks(req: Request) -> list[Chunk]:
    """Chunks for what each sequence produced since the last call. Text that could still
    become a stop string is held back until it cannot."""
    hold = max((len(s) for s in req.params.stop), default=1) - 1
    chunks = []
    for seq in req.seqs:
        done = seq.finish_reason is not None
        new_tokens = seq.generated[seq.sent_tokens:]
        if seq.final_sent or not (new_tokens or done):
            continue
        upto = len(seq.text) if done else max(seq.sent_text, len(seq.text) - hold)
        chunks.append(Chunk(request_id=req.id, index=seq.index, token_ids=new_tokens,
                            text=seq.text[seq.sent_text:upto], finish_reason=seq.finish_reason))
        seq.sent_tokens, seq.sent_text, seq.final_sent = len(seq.generated), upto, done
    return chunks


def final_result(req: Request) -> Result:
    return Result(
        request_id=req.id, prompt_token_ids=req.prompt_ids,
        choices=[Choice(index=s.index, token_ids=s.generated, text=s.text,
                        finish_reason=s.finish_reason, preemptions=s.preemptions)
                 for s in req.seqs],
        usage=Usage(prompt_tokens=len(req.prompt_ids),
                    completion_tokens=sum(len(s.generated) for s in req.seqs)),
    )
