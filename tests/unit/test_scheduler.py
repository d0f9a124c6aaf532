import time

from coordinator.page_allocator import PageAllocator
from coordinator.scheduler import Schedule, Scheduler
from coordinator.sequence import Request, Sequence
from protocol.messages import Submit


def make_seq(i: int, prompt_len: int, priority: int = 0) -> Sequence:
    req = Request(frontend=0, key=i, params=Submit(key=i, priority=priority),
                  prompt_ids=list(range(prompt_len)), arrival=float(i))
    seq = Sequence(id=i, request=req, index=0, token_ids=list(range(prompt_len)), seed=0)
    req.seqs.append(seq)
    return seq


def make_scheduler(pages: int, page_size: int, max_seqs: int, max_tokens: int,
                   park_slots: int = 64) -> Scheduler:
    return Scheduler(PageAllocator(pages), PageAllocator(park_slots), page_size, max_seqs,
                     max_tokens)


def finish_step(sched):
    for seq, n in sched.batch:
        seq.n_computed += n
        if seq.n_computed == len(seq.token_ids):
            seq.token_ids.append(7)


def test_prompt_is_chunked_by_the_token_budget():
    s = make_scheduler(64, 4, 8, 10)
    seq = make_seq(0, 25)
    s.add(seq)
    sizes = []
    for _ in range(3):
        sched = s.schedule()
        sizes.append([n for _, n in sched.batch])
        finish_step(sched)
    assert sizes == [[10], [10], [5]]
    assert len(seq.pages) == 7  # 25 positions in pages of 4


def test_pages_are_counted_not_tokens():
    s = make_scheduler(2, 4, 8, 64)
    seq = make_seq(0, 4)
    s.add(seq)
    finish_step(s.schedule())
    assert len(seq.pages) == 1  # the tail page is full
    sched = s.schedule()  # position 4 crosses into a second page
    assert sched.batch == [(seq, 1)] and len(seq.pages) == 2
    finish_step(sched)
    for _ in range(3):
        finish_step(s.schedule())
    assert not s.schedule()  # position 8 needs a third page; the pool has two


def test_decoding_sequences_get_pages_ahead_from_free_pages_only():
    s = Scheduler(PageAllocator(4), PageAllocator(4), 4, 8, 64, lookahead=2)
    seq = make_seq(0, 6)
    s.add(seq)
    finish_step(s.schedule())  # the prompt: positions 0-5, two pages
    assert len(seq.pages) == 2
    finish_step(s.schedule())  # decodes position 6, and 7-8 are ahead: a third page
    assert len(seq.pages) == 3
    for _ in range(3):  # positions 7-9, ahead up to 11
        finish_step(s.schedule())
    assert len(seq.pages) == 3
    cached = s.allocator.allocate(1)  # the last page comes to hold a cached prefix
    s.allocator.retain(cached[0])
    s.allocator.free(cached)
    finish_step(s.schedule())  # position 10, ahead 11-12: not by evicting the cached page
    assert len(seq.pages) == 3 and s.allocator.n_unused == 0 and s.allocator.n_free == 1
    finish_step(s.schedule())  # 11
    finish_step(s.schedule())  # 12 needs the page: now it is taken
    assert len(seq.pages) == 4 and s.allocator.evictions == 1


def test_pages_ahead_leave_a_free_page_for_every_running_sequence():
    s = Scheduler(PageAllocator(5), PageAllocator(4), 4, 8, 64, lookahead=2)
    a, b = make_seq(0, 7), make_seq(1, 7)
    s.add(a)
    s.add(b)
    finish_step(s.schedule())  # both prompts: two pages each, one left
    finish_step(s.schedule())  # both decode position 7; 8-9 ahead would take the last page
    assert len(a.pages) == len(b.pages) == 2 and s.allocator.n_unused == 1


def test_no_page_is_given_ahead_while_a_prompt_waits_and_parking_frees_those_given():
    s = Scheduler(PageAllocator(8), PageAllocator(8), 4, 1, 64, lookahead=2)  # one row a step
    a, b = make_seq(0, 7), make_seq(1, 7)
    s.add(a)
    finish_step(s.schedule())
    finish_step(s.schedule())  # a decodes position 7, and 8-9 are ahead: a third page
    assert len(a.pages) == 3
    out = Schedule()
    s.preempt(a, out)  # 8 positions computed: two pages parked, the one ahead freed
    assert [len(m.pages) for m in out.parks] == [2] and s.allocator.n_unused == 8
    s.add(b)
    finish_step(s.schedule())  # a comes back first (restores go before admissions), decodes 8
    assert len(a.pages) == 3 and s.waiting
    for _ in range(3):  # 9-11; at 11 the positions ahead need a fourth page, but b waits
        finish_step(s.schedule())
    assert len(a.pages) == 3 and s.waiting and s.allocator.n_unused == 5


def test_no_page_is_given_ahead_past_a_sequences_length():
    s = Scheduler(PageAllocator(8), PageAllocator(4), 4, 8, 64, lookahead=2)
    seq = make_seq(0, 6)
    seq.request.params.max_tokens = 2  # the token at position 7 is its last
    s.add(seq)
    finish_step(s.schedule())
    finish_step(s.schedule())  # decodes position 6, its last step
    assert len(seq.pages) == 2


def test_decodes_go_before_new_prompts_and_respect_max_seqs():
    s = make_scheduler(64, 4, 2, 64)
    a, b, c = make_seq(0, 3), make_seq(1, 3), make_seq(2, 3)
    s.add(a)
    finish_step(s.schedule())
    s.add(b)
    s.add(c)
    batch = s.schedule().batch
    assert [x.id for x, _ in batch] == [0, 1]
    assert batch[0][1] == 1  # a decodes one row


def test_victim_is_lowest_priority_then_newest_and_recompute_resets():
    s = make_scheduler(64, 4, 8, 64)
    seqs = [make_seq(0, 3, priority=1), make_seq(1, 3), make_seq(2, 3, priority=1)]
    for q in seqs:
        s.add(q)
    finish_step(s.schedule())
    victim = s.pick_victim()
    assert victim is seqs[1]
    s.recompute(victim)
    assert victim.n_computed == 0 and victim.pages == [] and s.waiting[0] is victim
    assert s.allocator.n_used == 2


def test_a_sequence_that_cannot_grow_parks_the_newest_lower_ranked_one():
    s = make_scheduler(4, page_size=4, max_seqs=8, max_tokens=64)
    old, new = make_seq(0, 4), make_seq(1, 4)
    s.add(old)
    s.add(new)
    finish_step(s.schedule())  # both prompts fill one page each
    for _ in range(4):  # both grow into a second page: 4 pages used
        finish_step(s.schedule())
    assert s.allocator.n_free == 0
    sched = s.schedule()  # old needs a third page: new is parked, not failed
    assert [m.seq for m in sched.parks] == [new]
    assert sched.parks[0].pages and len(sched.parks[0].slots) == 2
    assert [q for q, _ in sched.batch] == [old]
    assert new in s.parked and new.pages == [] and new.preemptions == 1
    assert not sched.restores  # never restore in the step that had to make room


def test_parked_sequences_are_restored_oldest_first_into_free_pages():
    s = make_scheduler(6, page_size=4, max_seqs=8, max_tokens=64)
    a, b = make_seq(0, 4), make_seq(1, 4)
    for q in (a, b):
        s.add(q)
    finish_step(s.schedule())
    out = type(s.schedule())()
    s.preempt(b, out)
    s.preempt(a, out)
    left_pages = {m.seq.id: m.pages for m in out.parks}
    sched = s.schedule()
    assert [m.seq for m in sched.restores] == [b, a]  # b was parked first
    for m in sched.restores:
        assert len(m.pages) == len(left_pages[m.seq.id])
        assert m.pages != left_pages[m.seq.id]  # same contents, other pages
    assert s.park_slots.n_used == 0


def test_a_full_park_store_falls_back_to_recompute():
    s = make_scheduler(3, page_size=4, max_seqs=8, max_tokens=64, park_slots=1)
    old, new = make_seq(0, 4), make_seq(1, 8)
    s.add(old)
    s.add(new)
    finish_step(s.schedule())
    sched = s.schedule()
    assert sched.recomputed == [new] and not sched.parks
    assert new.n_computed == 0 and s.waiting[0] is new


def test_fork_shares_full_prompt_pages_and_copies_the_tail():
    s = make_scheduler(16, page_size=4, max_seqs=8, max_tokens=64)
    parent = make_seq(0, 10)
    kids = [make_seq(1, 10), make_seq(2, 10)]
    parent.fork_at, parent.children = 9, kids
    s.add(parent)
    sched = s.schedule()
    assert sched.batch == [(parent, 9)]  # the prompt stops before its last token
    parent.n_computed += 9
    s.fork(parent)
    assert all(k.pages[:2] == parent.pages[:2] for k in kids)  # positions 0-7: shared
    assert [src for src, _ in s.copies] == [parent.pages[2]] * 2  # the tail is copied
    assert len({k.pages[2] for k in kids} | {parent.pages[2]}) == 3
    assert s.allocator.refs[parent.pages[0]] == 3
    nxt = s.schedule()
    assert len(nxt.copies) == 2 and {q.id for q, n in nxt.batch} == {0, 1, 2}
    assert all(n == 1 for _, n in nxt.batch)
    for q in (parent, *kids):
        s.remove(q)
    assert s.allocator.n_used == 0


def test_with_a_prefill_hold_new_prompts_wait_while_others_decode_then_join_together():
    s = Scheduler(PageAllocator(64), PageAllocator(64), 4, 8, 64, prefill_hold=60.0)
    a = make_seq(0, 3)
    a.request.arrival = time.monotonic()
    s.add(a)
    finish_step(s.schedule())  # nothing decodes yet: a prefills at once
    b, c = make_seq(1, 3), make_seq(2, 3)
    for q in (b, c):
        q.request.arrival = time.monotonic()
        s.add(q)
    assert [(x.id, n) for x, n in s.schedule().batch] == [(0, 1)]  # b and c wait
    a.n_computed, a.token_ids = 3, a.token_ids[:3] + [7]
    big = make_seq(3, 30)  # with it the waiting prompts fill half of the 64 rows
    big.request.arrival = time.monotonic()
    s.add(big)
    assert [x.id for x, _ in s.schedule().batch] == [0, 1, 2, 3]


def test_a_held_prompt_joins_once_it_has_waited_the_hold():
    s = Scheduler(PageAllocator(64), PageAllocator(64), 4, 8, 64, prefill_hold=0.05)
    a = make_seq(0, 3)
    s.add(a)
    finish_step(s.schedule())
    b = make_seq(1, 3)
    b.request.arrival = time.monotonic()
    s.add(b)
    assert [x.id for x, _ in s.schedule().batch] == [0]
    a.n_computed, a.token_ids = 3, a.token_ids[:3] + [7]
    time.sleep(0.06)
    assert [x.id for x, _ in s.schedule().batch] == [0, 1]


def client_request(key: int, client: str, prompt_len: int = 2) -> Request:
    return Request(frontend=0, key=key, params=Submit(key=key, max_tokens=1),
                   prompt_ids=list(range(1, prompt_len + 1)), arrival=float(key), client=client)


def run_tokens(s: Scheduler) -> Schedule:
    """One step out and back, each sequence sampling token 5 (max_tokens 1 ends it)."""
    sched = s.next_step()
    seqs = [q for q, _ in sched.batch]
    s.update_from_output(sched, [q.id for q in seqs], [5] * len(seqs))
    return sched


def run_step(s: Scheduler) -> list[Sequence]:
    """`run_tokens`, and the sequences the step ran."""
    return [q for q, _ in run_tokens(s).batch]


def test_a_flood_from_one_client_does_not_queue_ahead_of_another():
    s = make_scheduler(4096, 16, 4, 512)
    for i in range(1000):
        s.add_request(client_request(i, "flood"))
    assert [q.request.client for q in run_step(s)] == ["flood"] * 4
    lone = client_request(5000, "lone")
    s.add_request(lone)
    assert lone.seqs[0] in run_step(s)  # the next step, not 250 steps later
    assert s.waiting[0].request.client == "flood" and len(s.waiting) == 1000 - 7


def test_the_fair_queue_keeps_each_clients_order_and_alternates_between_clients():
    s = make_scheduler(4096, 16, 2, 512)
    for i in range(6):
        s.add_request(client_request(i, "a"))
    for i in range(6, 9):
        s.add_request(client_request(i, "b"))
    order = [q.request.key for _ in range(5) for q in run_step(s)]
    assert order == [0, 6, 1, 7, 2, 8, 3, 4, 5]


def long_request(key: int, client: str, priority: int = 0) -> Request:
    return Request(frontend=0, key=key, params=Submit(key=key, max_tokens=1000,
                                                      priority=priority),
                   prompt_ids=[1, 2], arrival=float(key), client=client)


def test_rows_held_by_one_clients_long_requests_give_way_to_another_client():
    s = make_scheduler(4096, 16, 4, 512)
    hog = [long_request(i, "hog") for i in range(4)]
    for r in hog:
        s.add_request(r)
    run_tokens(s)
    assert len(s.running) == 4
    lone = long_request(100, "lone")
    s.add_request(lone)
    parked = run_tokens(s).parks  # the newest of the hog's makes the row
    assert [m.seq for m in parked] == [hog[3].seqs[0]]
    assert lone.seqs[0] in [q for q, _ in run_tokens(s).batch]  # and lone takes it
    for _ in range(5):  # the parked one waits: its client runs three, lone one
        sched = run_tokens(s)
        assert not sched.restores and not sched.parks and len(sched.batch) == 4
    s.finish(lone.seqs[0], "stop")
    assert [m.seq for m in run_tokens(s).restores] == [hog[3].seqs[0]]


def test_rows_are_not_taken_from_a_client_one_ahead_or_of_higher_priority():
    s = make_scheduler(4096, 16, 3, 512)
    for i, client in enumerate(["a", "a", "b"]):
        s.add_request(long_request(i, client))
    run_tokens(s)
    s.add_request(long_request(10, "b"))  # b runs one, a two: one apart is fair
    assert not any(run_tokens(s).parks for _ in range(3))
    s = make_scheduler(4096, 16, 3, 512)
    for i in range(3):
        s.add_request(long_request(i, "a", priority=5))
    run_tokens(s)
    s.add_request(long_request(10, "b", priority=0))
    assert not any(run_tokens(s).parks for _ in range(3))
