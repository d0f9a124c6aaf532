"""A `Schedule` as the wire's `Step`: what every worker is told about one step. Reads the
scheduler's decisions and changes nothing."""

from __future__ import annotations

from protocol.messages import PageCopy, PageMove, Sampling, SeqPlan, Step

from .schedule import Schedule


def step_plan(step: int, sched: Schedule) -> Step:
    plans, tokens = [], []
    for (seq, n), start, sample, after in zip(sched.batch, sched.starts, sched.samples,
                                              sched.after):
        sampling = None
        if seq.id in sched.announce:
            p = seq.request.params
            sampling = Sampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                seed=seq.seed)
        plans.append(SeqPlan(id=seq.id, start=start, n=n,
                             pages_add=sched.new_pages.get(seq.id, []),
                             sample=sample, sampling=sampling, after=after))
        tokens.extend([0] if after else seq.token_ids[start:start + n])
    return Step(
        step=step, seqs=plans, token_ids=tokens, free=sched.free,
        park=[PageMove(id=m.seq.id, pages=m.pages, slots=m.slots) for m in sched.parks],
        restore=[PageMove(id=m.seq.id, pages=m.pages, slots=m.slots, kept=m.kept)
                 for m in sched.restores],
        copies=[PageCopy(src=a, dst=b) for a, b in sched.copies],
    )
