from coordinator.page_allocator import PageAllocator
from coordinator.scheduler import Scheduler
from coordinator.sequence import Request, Sequence
from protocol.messages import Generate


def make_seq(i: int, prompt_len: int, priority: int = 0) -> Sequence:
    req = Request(id=str(i), client=b"c", params=Generate(request_id=str(i), priority=priority),
                  prompt_ids=list(range(prompt_len)), arrival=float(i))
    seq = Sequence(id=i, request=req, index=0, token_ids=list(range(prompt_len)), seed=0,
                   detok=None)
    req.seqs.append(seq)
    return seq


def finish_step(batch):
    for seq, n in batch:
        seq.n_computed += n
        if seq.n_computed == len(seq.token_ids):
            seq.token_ids.append(7)


def test_prompt_is_chunked_by_the_token_budget():
    s = Scheduler(PageAllocator(64), page_size=4, max_batch_seqs=8, max_batch_tokens=10)
    seq = make_seq(0, 25)
    s.add(seq)
    sizes = []
    for _ in range(3):
        batch = s.schedule()
        sizes.append([n for _, n in batch])
        finish_step(batch)
    assert sizes == [[10], [10], [5]]
    assert len(seq.pages) == 7  # 25 positions in pages of 4


def test_pages_are_counted_not_tokens():
    s = Scheduler(PageAllocator(2), page_size=4, max_batch_seqs=8, max_batch_tokens=64)
    seq = make_seq(0, 4)
    s.add(seq)
    finish_step(s.schedule())
    assert len(seq.pages) == 1  # the tail page is full
    batch = s.schedule()  # position 4 crosses into a second page
    assert batch == [(seq, 1)] and len(seq.pages) == 2
    finish_step(batch)
    for _ in range(3):
        finish_step(s.schedule())
    assert s.schedule() == []  # position 8 needs a third page; the pool has two


def test_decodes_go_before_new_prompts_and_respect_max_seqs():
    s = Scheduler(PageAllocator(64), page_size=4, max_batch_seqs=2, max_batch_tokens=64)
    a, b, c = make_seq(0, 3), make_seq(1, 3), make_seq(2, 3)
    s.add(a)
    finish_step(s.schedule())
    s.add(b)
    s.add(c)
    batch = s.schedule()
    assert [x.id for x, _ in batch] == [0, 1]
    assert batch[0][1] == 1  # a decodes one row


def test_victim_is_lowest_priority_then_newest_and_recompute_resets():
    s = Scheduler(PageAllocator(64), page_size=4, max_batch_seqs=8, max_batch_tokens=64)
    seqs = [make_seq(0, 3, priority=1), make_seq(1, 3), make_seq(2, 3, priority=1)]
    for q in seqs:
        s.add(q)
    finish_step(s.schedule())
    victim = s.pick_victim()
    assert victim is seqs[1]
    s.recompute(victim)
    assert victim.n_computed == 0 and victim.pages == [] and s.waiting[0] is victim
    assert s.allocator.n_used == 2
