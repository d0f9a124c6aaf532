import time

from coordinator.page_allocator import PageAllocator
from coordinator.schedule import Schedule
from coordinator.scheduler import Scheduler
from coordinator.sequence import Request, Sequence
from protocol.messages import Submit
from protocol.sampling import SamplingParams


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


def ahead_scheduler(pages: int = 16, max_seqs: int = 8) -> Scheduler:
    s = Scheduler(PageAllocator(pages), PageAllocator(8), 4, max_seqs, 64, plan_ahead=True)
    s.set_model(frozenset([0]), 1 << 20)
    return s


def request_of(i: int, prompt_len: int, **params) -> Request:
    return Request(frontend=0, key=i, params=Submit(key=i, sampling=SamplingParams(**params)),
                   prompt_ids=list(range(1, prompt_len + 1)), arrival=float(i))


def one_request(**params) -> tuple[Scheduler, Sequence]:
    """A scheduler planning ahead with one request of a 3-token prompt queued: its sequence."""
    s = ahead_scheduler()
    req = request_of(0, 3, **params)
    s.add_request(req)
    return s, req.seqs[0]


def rows(sched: Schedule) -> list[tuple[int, int, int, bool]]:
    """(sequence, start, rows, on a token in flight) of each batch entry."""
    return [(q.id, start, n, after)
            for (q, n), start, after in zip(sched.batch, sched.starts, sched.after)]


def test_a_decoding_sequence_is_planned_ahead_on_its_tokens_in_flight():
    s, seq = one_request(max_tokens=8)
    first, second, third = s.next_step(), s.next_step(), s.next_step()
    assert rows(first) == [(0, 0, 3, False)]  # the prompt
    assert rows(second) == [(0, 3, 1, True)] and rows(third) == [(0, 4, 1, True)]
    assert len(seq.pages) == 2  # position 4 opened its second page
    s.update_from_output(first, [0], [50])
    s.update_from_output(second, [0], [51])
    assert seq.token_ids == [1, 2, 3, 50, 51] and seq.n_computed == 4
    assert rows(s.next_step()) == [(0, 5, 1, True)]  # on the token of `third`, in flight


def test_nothing_is_planned_past_a_sequences_length():
    s, seq = one_request(max_tokens=2)
    first, second = s.next_step(), s.next_step()
    assert rows(second) == [(0, 3, 1, True)] and not s.next_step()  # its second token: its last
    out = s.update_from_output(first, [0], [50])
    assert out.ahead_used == 0 and not s.next_step()
    out = s.update_from_output(second, [0], [51])
    assert out.ahead_used == 1 and seq.finish_reason == "length" and s.allocator.n_used == 0


def test_the_rows_planned_past_a_stop_token_are_computed_for_nothing_and_every_page_drains():
    s, seq = one_request(max_tokens=8, stop_token_ids=[99])
    steps = [s.next_step(), s.next_step(), s.next_step()]
    out = s.update_from_output(steps[0], [0], [50])
    assert out.ahead_used == 0 and not out.finished
    out = s.update_from_output(steps[1], [0], [99])  # the stop token
    assert out.finished == [seq] and out.ahead_used == 1
    out = s.update_from_output(steps[2], [0], [51])  # planned on it: dropped
    assert out.ahead_dropped == 1 and not out.tokens and seq.token_ids[-1] == 99
    assert s.allocator.n_used == 0 and not s.has_work


def test_a_sequence_with_rows_in_flight_is_never_preempted_and_one_without_a_page_waits():
    s = ahead_scheduler(pages=2, max_seqs=2)
    a, b = request_of(0, 4, max_tokens=8), request_of(1, 3, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    first = s.next_step()  # both prompts: a page each
    assert rows(first) == [(0, 0, 4, False), (1, 0, 3, False)]
    second = s.next_step()  # a's next position needs a page none has; b's fits its first
    assert rows(second) == [(1, 3, 1, True)] and not second.parks and not second.recomputed
    assert s.allocator.n_used == 2
    s.update_from_output(first, [0, 1], [50, 60])
    # a is idle and needs a page; b, worse than a, is in flight: not preempted, and b's next
    # position needs a page too, which a (better) does not give up
    assert not s.next_step()
    s.update_from_output(second, [1], [61])
    fourth = s.next_step()  # b is idle now: parked for a
    assert [m.seq for m in fourth.parks] == b.seqs and rows(fourth) == [(0, 4, 1, False)]


def test_a_failed_step_makes_the_rows_planned_after_it_stale():
    s, seq = one_request(max_tokens=8)
    first, second = s.next_step(), s.next_step()
    s.update_from_output(first, [0], [50])
    third = s.next_step()
    failed, recomputed = s.fail_step(second, [99])  # another sequence at fault: it recomputes
    assert recomputed == [seq] and seq.n_computed == 0 and not seq.in_flight
    out = s.update_from_output(third, [0], [52])  # planned on the failed step's token
    assert out.ahead_dropped == 1 and seq.token_ids == [1, 2, 3, 50] and seq.n_computed == 0
    assert rows(s.next_step()) == [(0, 0, 4, False)]  # it recomputes its tokens


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
    return Request(frontend=0, key=key,
                   params=Submit(key=key, sampling=SamplingParams(max_tokens=1)),
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
    return Request(frontend=0, key=key, params=Submit(key=key, priority=priority,
                                                      sampling=SamplingParams(max_tokens=1000)),
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


def test_a_long_prompts_chunks_are_planned_back_to_back_and_its_first_decode_on_the_last():
    s = Scheduler(PageAllocator(16), PageAllocator(8), 4, 8, 4, plan_ahead=True)  # 4 rows a step
    s.set_model(frozenset([0]), 1 << 20)
    req = request_of(0, 10, max_tokens=8)
    s.add_request(req)
    steps = [s.next_step() for _ in range(4)]
    assert [rows(x) for x in steps] == [[(0, 0, 4, False)], [(0, 4, 4, False)],
                                        [(0, 8, 2, False)], [(0, 10, 1, True)]]
    assert [x.samples for x in steps] == [[False], [False], [True], [True]]
    for x, token in zip(steps, [None, None, 50, 51]):
        s.update_from_output(x, [] if token is None else [0], [] if token is None else [token])
    assert req.seqs[0].token_ids[10:] == [50, 51] and req.seqs[0].n_computed == 11


def test_a_forking_prompt_is_not_planned_past_its_fork_point():
    s = Scheduler(PageAllocator(16), PageAllocator(8), 4, 8, 4, plan_ahead=True)
    s.set_model(frozenset([0]), 1 << 20)
    req = request_of(0, 9, max_tokens=8, n=2)
    s.add_request(req)
    first, second = s.next_step(), s.next_step()
    assert rows(first) == [(0, 0, 4, False)] and rows(second) == [(0, 4, 4, False)]
    assert not s.next_step()  # position 8 is the choices' own: after the fork
    s.update_from_output(first, [], [])
    s.update_from_output(second, [], [])
    assert [rows(s.next_step())] == [[(0, 8, 1, False), (1, 8, 1, False)]]
