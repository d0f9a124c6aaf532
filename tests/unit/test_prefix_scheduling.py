"""The scheduler's prefix cache: full pages found again by content, taken read-only, never the
page of a prompt's last token, kept idle after their sequences end and reused least recently
used first, reclaimed before anyone is preempted, forgotten when the workers lose their KV."""

from __future__ import annotations

from array import array

from coordinator.page_allocator import PageAllocator
from coordinator.prefix_cache import PrefixCache, packed_pages, page_key
from coordinator.schedule import Schedule
from coordinator.scheduler import Scheduler
from coordinator.sequence import Request
from protocol.messages import Submit
from protocol.sampling import SamplingParams

PAGE = 4


def scheduler(pages: int = 64, max_seqs: int = 8, max_tokens: int = 512,
              park: int = 64) -> Scheduler:
    pool = PageAllocator(pages)
    return Scheduler(pool, PageAllocator(park), PAGE, max_seqs, max_tokens,
                     prefix_cache=PrefixCache(pool, PAGE, "test-model|float32|exact=False"))


def request(key: int, prompt: list[int], max_tokens: int = 2, n: int = 1) -> Request:
    """As the core makes one: with the prompt's ids packed as its SUBMIT brought them."""
    return Request(frontend=0, key=key,
                   params=Submit(key=key, sampling=SamplingParams(
                       max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0.0)),
                   prompt_ids=list(prompt), arrival=float(key),
                   prompt_bytes=array("i", prompt).tobytes())


def run_to_end(s: Scheduler) -> list[list[tuple[int, int, int]]]:
    """Steps until nothing is left, each sampling token 5; every step's (seq, start, rows)."""
    steps = []
    for _ in range(1000):
        if not s.has_work:
            return steps
        sched = s.next_step()
        steps.append([(q.id, q.n_computed, n) for q, n in sched.batch])
        ids = [q.id for q, n in sched.batch if q.n_computed + n == len(q.token_ids)]
        s.update_from_output(sched, ids, [5] * len(ids))
    raise AssertionError("the scheduler did not finish")


PROMPT = list(range(100, 142))  # 42 tokens: 10 full pages and 2 tokens


def test_a_repeated_prompt_takes_its_full_pages_and_computes_only_the_rest():
    s = scheduler()
    first = request(0, PROMPT)
    s.add_request(first)
    run_to_end(s)
    cached = list(first.seqs[0].pages[:10])
    again = request(1, PROMPT)
    s.add_request(again)
    steps = run_to_end(s)
    seq = again.seqs[0]
    assert steps[0] == [(seq.id, 40, 2)]  # started at position 40: two rows to prefill
    assert seq.pages[:10] == cached
    assert (s.cache.queried, s.cache.hit) == (84, 40)


def test_a_partial_match_takes_the_pages_up_to_the_first_difference():
    s = scheduler()
    s.add_request(request(0, PROMPT))
    run_to_end(s)
    other = PROMPT[:22] + [7] * 20  # the same first 5 pages, then different
    r = request(1, other)
    s.add_request(r)
    assert run_to_end(s)[0] == [(r.seqs[0].id, 20, 22)]


def test_the_page_of_the_last_prompt_token_is_never_taken():
    s = scheduler()
    exact = PROMPT[:40]  # exactly 10 pages
    s.add_request(request(0, exact))
    run_to_end(s)
    r = request(1, exact)
    s.add_request(r)
    assert run_to_end(s)[0] == [(r.seqs[0].id, 36, 4)]  # 9 pages taken: the 10th is computed


def test_generated_tokens_are_cached_too_so_a_conversation_reuses_its_last_turn():
    s = scheduler()
    first = request(0, PROMPT, max_tokens=10)
    s.add_request(first)
    run_to_end(s)
    turn = first.seqs[0].token_ids + [9, 9, 9]  # the reply, then the next user message
    r = request(1, turn)
    s.add_request(r)
    assert run_to_end(s)[0][0][1] == 48  # 52 positions were computed before: 12 full pages


def test_cached_pages_wait_idle_are_reused_last_and_evicted_least_recent_first():
    s = scheduler(pages=24)
    a, b = request(0, PROMPT[:21]), request(1, [1] * 21)  # 5 full pages each
    s.add_request(a)
    run_to_end(s)
    s.add_request(b)
    run_to_end(s)
    pool = s.allocator
    assert pool.n_used == 0 and s.cache.idle_pages == 10 and len(pool.free_pages) == 14
    s.add_request(request(2, [2] * 70))  # 18 pages: the free 14, then 4 of a's (the older)
    run_to_end(s)
    assert pool.evictions == 4
    assert_found_by_what_made_them(s.cache)
    s.add_request(request(3, [1] * 21))
    assert run_to_end(s)[0][0][1] == 20  # b's pages are all still there
    s.add_request(request(4, PROMPT[:21]))
    assert run_to_end(s)[0][0][1] == 0  # a's first ones were evicted: its chain is broken


def test_cached_pages_are_reclaimed_before_a_running_sequence_is_preempted():
    s = scheduler(pages=12)
    s.add_request(request(0, PROMPT[:33]))  # 8 full pages, cached once it ends
    run_to_end(s)
    s.add_request(request(1, [3] * 2, max_tokens=40))  # grows to 11 pages
    run_to_end(s)
    assert s.allocator.evictions > 0
    assert not s.parked and all(q.preemptions == 0 for q in s.running)


def test_n_choices_share_cached_pages_and_everything_drains():
    s = scheduler()
    s.add_request(request(0, PROMPT))
    run_to_end(s)
    r = request(1, PROMPT, n=3)
    s.add_request(r)
    steps = run_to_end(s)
    assert steps[0] == [(r.seqs[0].id, 40, 1)]  # up to the fork, before the last token
    pool = s.allocator
    assert pool.n_used == 0 and all(x == 0 for x in pool.refs)


def test_the_workers_losing_their_kv_empties_the_cache():
    s = scheduler()
    s.add_request(request(0, PROMPT))
    run_to_end(s)
    assert s.cache.by_key
    s.recompute_all()
    assert not s.cache.by_key and s.cache.idle_pages == 0 and s.allocator.n_free == 64
    assert not s.cache.child and not s.cache.made_of
    r = request(1, PROMPT)
    s.add_request(r)
    assert run_to_end(s)[0][0][1] == 0


def page_keys(parent: bytes, tokens: list[int], page_size: int) -> list[bytes]:
    """The key of each full page of `tokens` in turn, the first's parent `parent`, as the cache
    makes them."""
    keys = []
    for page in packed_pages(tokens, page_size):
        parent = page_key(parent, page)
        keys.append(parent)
    return keys


def test_pages_packed_from_a_known_prefix_are_the_pages_packed_from_the_ids():
    tokens = list(range(1000, 1042))
    for known in (0, 3, 4, 17, 40, 42, 60):  # none, inside a page, on a page, past the ids
        packed = array("i", (tokens + [7] * 20)[:known]).tobytes()
        assert packed_pages(tokens, PAGE, packed) == packed_pages(tokens, PAGE)
    assert len(packed_pages(tokens, PAGE)) == 10


def test_keys_chain_the_whole_prefix_and_the_salt():
    root = PrefixCache(PageAllocator(1), PAGE, "m|bfloat16|exact=True").root
    other = PrefixCache(PageAllocator(1), PAGE, "m|float32|exact=True").root
    page = [1, 2, 3, 4]
    assert list(page_keys(root, page, PAGE)) != list(page_keys(other, page, PAGE))  # other bits
    after_nines = list(page_keys(root, [9] * 4 + page, PAGE))[1]
    after_eights = list(page_keys(root, [8] * 4 + page, PAGE))[1]
    assert after_nines != after_eights  # the same page after another parent
    assert list(page_keys(root, page + [5, 6], PAGE)) == list(page_keys(root, page, PAGE))


def test_a_cache_off_scheduler_computes_every_prompt_in_full():
    pool = PageAllocator(64)
    s = Scheduler(pool, PageAllocator(64), PAGE, 8, 512)
    s.add_request(request(0, PROMPT))
    run_to_end(s)
    r = request(1, PROMPT)
    s.add_request(r)
    assert run_to_end(s)[0] == [(r.seqs[0].id, 0, 42)]


def assert_found_by_what_made_them(cache: PrefixCache) -> None:
    """Every cached key, and only those, is found by its parent's key and its page's ids: what a
    lookup walks."""
    assert cache.made_of.keys() == cache.by_key.keys()
    assert cache.child == {made_of: key for key, made_of in cache.made_of.items()}
    for key, (parent, ids) in cache.made_of.items():
        assert page_key(parent, ids) == key


def parked_and_back(s: Scheduler, seq, meanwhile=lambda: None) -> tuple:
    """Run a step, park `seq` alone (as a preemption would), call `meanwhile`, then run steps
    until it is restored: (its park Move, its restore Move)."""
    out = s.next_step()
    ids = [q.id for q, n in out.batch if q.n_computed + n == len(q.token_ids)]
    s.update_from_output(out, ids, [5] * len(ids))
    parked = Schedule()
    s.preempt(seq, parked)
    meanwhile()
    for _ in range(50):
        sched = s.next_step()
        restore = [m for m in sched.restores if m.seq is seq]
        ids = [q.id for q, n in sched.batch if q.n_computed + n == len(q.token_ids)]
        s.update_from_output(sched, ids, [5] * len(ids))
        if restore:
            return (parked.parks[0] if parked.parks else None), restore[0]
    raise AssertionError("never restored")


def test_a_parked_sequence_keeps_the_pages_it_shares_and_parks_only_its_own():
    s = scheduler()
    s.add_request(request(0, PROMPT))
    run_to_end(s)  # 10 full pages cached
    a, b = request(1, PROMPT + [1, 2, 3], max_tokens=30), request(2, PROMPT + [4], max_tokens=30)
    s.add_request(a)
    s.add_request(b)
    seq = a.seqs[0]
    park, restore = parked_and_back(s, seq)
    shared = b.seqs[0].pages[:10]
    assert restore.kept[:10] == shared  # never left the pool, never copied
    assert park.pages and not set(park.pages) & set(shared)
    assert len(park.slots) == len(park.pages) == len(seq.pages) - 10
    assert seq.pages[:10] == shared
    run_to_end(s)
    assert s.allocator.n_used == 0 and s.park_slots.n_used == 0


def test_a_restore_takes_its_pages_still_cached_and_moves_only_the_rest():
    """Its own full pages, freed by the park, wait idle in the cache: the restore takes them
    again, and only the partly filled tail comes back from the park store."""
    s = scheduler()
    r = request(0, PROMPT, max_tokens=30)
    s.add_request(r)
    seq = r.seqs[0]
    park, restore = parked_and_back(s, seq)
    assert len(park.pages) == 11  # 10 full pages and the tail (42 prompt tokens, one more)
    assert len(restore.kept) == 10 and len(restore.pages) == len(restore.slots) == 1
    assert restore.slots == park.slots[-1:]
    run_to_end(s)
    assert s.allocator.n_used == 0 and s.park_slots.n_used == 0


def test_a_restore_after_its_cached_pages_were_reused_moves_them_all_and_keys_them_again():
    s = scheduler(pages=20)
    r = request(0, PROMPT, max_tokens=30)
    s.add_request(r)
    seq = r.seqs[0]

    def reuse_every_page() -> None:  # another sequence's growth, as far as the pool goes
        s.allocator.free(s.allocator.allocate(s.allocator.n_free))

    park, restore = parked_and_back(s, seq, reuse_every_page)
    assert len(park.pages) == len(restore.pages) == len(restore.slots) == 11
    assert restore.kept == []
    assert all(s.cache.by_key[k] == p for k, p in zip(seq.page_keys, seq.pages, strict=False))
    assert_found_by_what_made_them(s.cache)
    run_to_end(s)
    again = request(1, PROMPT)  # finds the pages the restore keyed again
    s.add_request(again)
    assert run_to_end(s)[0] == [(again.seqs[0].id, 40, 2)]
    assert s.allocator.n_used == 0 and s.park_slots.n_used == 0
