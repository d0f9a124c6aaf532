"""The host KV pool and its staging ring on the CPU transport: byte-identical to the device pool
for any placement, batch, depth and exact mode, also with every copy delayed; slots refilled only
after their readers released them; budget and headroom declines that last one step."""

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.ring import (
    KVH,
    LAYERS,
    CheckedTransport,
    D,
    P,
    assert_same_run,
    pools,
    random_schedule,
    run_step,
)

from protocol.messages import PageCopy, PageMove, SeqPlan, Step
from worker.attention import choose_attention
from worker.build import build_runner, load_stage, make_pool
from worker.kv.device_pool import KVPool
from worker.kv.host_pool import HostKVPool
from worker.kv.park_store import ParkStore
from worker.kv.staging_ring import keeps_places, pack

ATTENTION = choose_attention(False, "cpu", D)


def test_pack_makes_one_run_per_contiguous_range_and_bridges_small_gaps():
    assert pack([1, 2, 3, 7, 8, 20]) == [(1, 3, 0), (7, 2, 3), (20, 1, 5)]
    assert pack([1, 2, 3, 7, 8, 20], bridge=3) == [(1, 8, 0), (20, 1, 8)]
    assert pack([4]) == [(4, 1, 0)]


@pytest.mark.parametrize("slot_layers", [1, 2])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_host_pool_matches_device_pool_bit_for_bit_with_delayed_copies(depth, exact, slot_layers):
    # bridge 0: a copy per run, every one of them delayed
    device, host = pools(depth, exact, delay_ms=1.0, bridge=0, slot_layers=slot_layers)
    tables, steps = random_schedule(random.Random(depth), device.n_pages)
    assert_same_run(device, host, tables, steps)
    assert host.ring.stats.ring_steps == (len(steps) if depth else 0)
    assert (host.ring.stats.primed_steps > 0) == (0 < depth < host.ring.n_groups)


@pytest.mark.parametrize("seed", range(4))
def test_host_pool_matches_device_pool_for_random_placements_and_batches(seed):
    device, host = pools(depth=seed % 3 + 1)
    tables, steps = random_schedule(random.Random(100 + seed), device.n_pages)
    assert_same_run(device, host, tables, steps)


def test_a_missing_ready_wait_is_exposed_by_delayed_copies():
    """The identity tests can see a missing wait: without it attention reads an empty slot."""
    device, host = pools(depth=2, delay_ms=5.0, bridge=0)
    host.transport.wait = lambda ev: None
    tables, steps = random_schedule(random.Random(7), device.n_pages)
    outs = [(run_step(device, c, tables, s), run_step(host, c, tables, s))
            for s, c in enumerate(steps[:2])]
    assert not all(torch.equal(x, y) for a, b in outs for x, y in zip(a, b))


@pytest.mark.parametrize("slot_layers", [1, 2, 3])
@pytest.mark.parametrize("depth", [1, 2, 4, 8])
def test_slots_are_recycled_stream_to_stream_only_after_release(depth, slot_layers):
    """Also with slots of several layers: a group is delivered, waited for and released as one."""
    transport = CheckedTransport(delay_ms=0.5)
    host = HostKVPool(LAYERS, 64, P, KVH, D, torch.float32, "cpu", ATTENTION, depth=depth,
                      transport=transport, bridge_bytes=0, slot_layers=slot_layers)
    transport.start(host.ring)
    device = KVPool(LAYERS, 64, P, KVH, D, torch.float32, "cpu", ATTENTION)
    tables, steps = random_schedule(random.Random(depth), 64)
    assert_same_run(device, host, tables, steps)
    groups = -(-LAYERS // slot_layers)
    assert host.ring.n_groups == groups and host.ring.n_slots == min(depth + 2, groups)
    assert transport.reads == groups * len(steps)
    # the host blocks once a step, for the write-back, never for a slot; it drains every side
    # only around a new buffer: before giving the old one back, and once the new one is zeroed
    assert transport.host_waits == len(steps)
    assert transport.syncs == 2 * host.ring.stats.reallocations - 1
    assert (host.ring.stats.primed_steps > 0) == (depth < groups)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_continuing_step_enqueues_every_layer_before_the_host_blocks(depth):
    """The last step's rows reach the host pages (the host waiting for their write-back) in the
    next step's end_step, once its layers are all enqueued: it carries them into its slots
    meanwhile. A step that does not continue the last lands them before its first layer."""
    transport = CheckedTransport(delay_ms=0.5)
    host = HostKVPool(LAYERS, 64, P, KVH, D, torch.float32, "cpu", ATTENTION, depth=depth,
                      transport=transport, bridge_bytes=0)
    transport.start(host.ring)
    device = KVPool(LAYERS, 64, P, KVH, D, torch.float32, "cpu", ATTENTION)
    tables = {0: [3, 4, 5, 6], 1: [9, 10, 11]}
    # decode steps on the prefill's pages, then one without sequence 1
    steps = ([[(0, 0, 9), (1, 0, 5)]] + [[(0, 9 + i, 1), (1, 5 + i, 1)] for i in range(3)]
             + [[(0, 12, 1)]])
    before = []  # per step: primed, and its compute-side waits before the host blocked
    for seed, chunk in enumerate(steps):
        start, primed = len(transport.log), host.ring.stats.primed_steps
        a = run_step(device, chunk, tables, seed)
        b = run_step(host, chunk, tables, seed)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {seed}"
        log = transport.log[start:]
        blocked = log.index("host") if "host" in log else None
        before.append((host.ring.stats.primed_steps > primed, blocked))
    host.settle()
    assert torch.equal(device.k, host.k) and torch.equal(device.v, host.v)
    # the prefill has nothing to wait for and the first decode step does not continue a decode
    # step: it lands the prefill's rows first; the next two carry; the last does not continue
    assert before == [(False, None), (False, 0), (True, LAYERS), (True, LAYERS), (False, 0)]


def test_decode_steps_take_their_first_layers_primed_by_the_step_before():
    device, host = pools(depth=2, delay_ms=1.0)
    tables = {0: [3, 4, 5], 1: [9, 10]}
    steps = [[(0, 0, 9), (1, 0, 5)]] + [[(0, 9 + i, 1), (1, 5 + i, 1)] for i in range(3)]
    assert_same_run(device, host, tables, steps)
    # the prefill primes nothing; each decode step primes the next
    assert host.ring.stats.primed_steps == 2


def test_a_window_of_other_pages_but_the_same_size_is_delivered_from_its_own_pages():
    """The copies a delivery issues are cached per (layer, slot) and must follow the window's
    runs, not only its slots: two sequences of two pages each decode in turn, so every step
    reads a window of the same size (the same buffer and slots) on other pages."""
    device, host = pools(depth=1, bridge=0)
    tables = {0: [3, 4], 1: [20, 21]}
    assert_same_run(device, host, tables, [[(0, 0, 6)], [(1, 0, 6)], [(0, 6, 1)], [(1, 6, 1)],
                                           [(0, 7, 1)], [(1, 7, 1)]])
    assert host.ring.stats.reallocations == 1


def test_a_window_keeps_the_places_of_its_pages_when_pages_are_added_after_them():
    assert keeps_places([(3, 2, 0)], [(3, 3, 0)])
    assert keeps_places([(3, 2, 0), (9, 1, 2)], [(3, 2, 0), (9, 2, 2), (20, 1, 4)])
    assert not keeps_places([(3, 2, 0)], [(2, 4, 0)])  # a page before them moves them
    assert not keeps_places([(3, 2, 0), (9, 1, 2)], [(3, 3, 0), (9, 1, 3)])


@pytest.mark.parametrize(("pages", "primed"), [
    ([3, 4, 5, 30], 4),  # the new pages come after the window: every decode step but the first
    ([3, 4, 5, 13], 4),  # 13 extends the run of sequence 1's pages 10-12
    ([3, 4, 5, 6], 3),  # 6 moves sequence 1's pages: that step delivers its first layers itself
])
def test_decode_steps_stay_primed_when_a_sequence_takes_a_new_page_after_the_window(pages, primed):
    """A step that adds a page (one in `P` decode steps a sequence) still uses what the last one
    primed, as long as no page of the window moves: the buffer has room, so no slot moves."""
    device, host = pools(depth=2, delay_ms=1.0, bridge=0)
    tables = {0: pages, 1: [10, 11, 12]}
    # sequence 1 takes page 12 at position 8, sequence 0 its fourth page at position 12
    steps = [[(0, 0, 9), (1, 0, 6)]] + [[(0, 9 + i, 1), (1, 6 + i, 1)] for i in range(5)]
    assert_same_run(device, host, tables, steps)
    assert host.ring.stats.reallocations == 1
    assert host.ring.stats.primed_steps == primed


def test_a_layers_window_keeps_its_place_in_a_slot_of_several_when_the_window_grows():
    """Slots of two layers: the second layer's window starts at the slot's stride shared out,
    not at the window's size, so a step that adds a page after the window reads what the last
    step primed where it was put."""
    device, host = pools(depth=2, delay_ms=1.0, bridge=0, slot_layers=2)
    tables = {0: [3, 4, 30], 1: [10, 11]}
    # a window of 4 pages (room for 5 in the buffer); sequence 0 takes page 30 at position 8
    steps = [[(0, 0, 6), (1, 0, 5)]] + [[(0, 6 + i, 1), (1, 5 + i, 1)] for i in range(3)]
    assert_same_run(device, host, tables, steps)
    assert host.ring.stats.reallocations == 1
    assert host.ring.stats.primed_steps == 2  # the last of them on the grown window


def test_primed_bytes_are_dropped_when_sequences_move_within_the_same_pages():
    """Two sequences swap pages between steps (as a park and restore in one plan can do): the
    window is the same, but what the last step primed is not this step's."""
    device, host = pools(depth=2, delay_ms=1.0)
    tables = {0: [3, 4], 1: [5, 6]}
    assert_same_run(device, host, tables, [[(0, 0, 6), (1, 0, 6)], [(0, 6, 1), (1, 6, 1)]])
    for pool in (device, host):
        pool.settle()
        for t in (pool.k, pool.v):
            t[:, [3, 4, 5, 6]] = t[:, [5, 6, 3, 4]].clone()
    primed = host.ring.stats.primed_steps
    assert_same_run(device, host, {0: [5, 6], 1: [3, 4]}, [[(0, 7, 1), (1, 7, 1)]])
    assert host.ring.stats.primed_steps == primed


BIG = (4, 16, 2, 64)  # 16 KiB a page and layer: a 1 MiB ring holds 64 pages, 21 a slot of 3


def test_a_step_over_the_budget_declines_and_a_later_small_step_takes_the_ring_again():
    device, host = pools(depth=1, shape=BIG, n_pages=96, budget_mib=1, bridge=0)
    small = {0: [3, 4]}
    big = {0: list(range(10, 40))}  # 30 pages: 3 slots = 1.4 MiB
    assert_same_run(device, host, small, [[(0, 0, 20)]])
    assert host.ring.stats.ring_steps == 1
    assert_same_run(device, host, big, [[(0, 0, 470)], [(0, 470, 1)]])
    stats = host.ring.stats
    assert stats.declines == {"budget": 2, "headroom": 0, "unsupported": 0}
    assert stats.ordered_steps == 2
    assert_same_run(device, host, small, [[(0, 20, 1)], [(0, 21, 1)]])
    assert stats.ring_steps == 3 and stats.declines["budget"] == 2


def test_a_step_takes_the_largest_slots_whose_ring_fits_before_it_declines():
    """Slots of up to 4 layers of 8 (16 KiB a page and layer, a 1 MiB budget, depth 1): 2 slots
    of 4 layers fit a window of 8 pages, 3 of 2 layers 10, 3 of 1 layer 21. Each change of
    layout fences the slots (every release recorded again after the compute so far): without
    it the checker sees a delivery into a slot the ordered step's compute side still reads."""
    transport = CheckedTransport(delay_ms=1.0)
    device, host = pools(depth=1, shape=(8, 16, 2, 64), n_pages=96, budget_mib=1, bridge=0,
                         transport=transport, slot_layers=4)
    ring, begin = host.ring, host.ring.begin_step
    transport.start(ring)
    layouts = []

    def logged_begin(*args, **kwargs):
        begin(*args, **kwargs)
        layouts.append(ring.group if ring.ahead else 0)

    ring.begin_step = logged_begin
    for pages in (6, 10, 15, 30, 6, 15):
        tables = {0: list(range(40, 40 + pages))}
        assert_same_run(device, host, tables, [[(0, 0, 16 * pages - 8)], [(0, 16 * pages - 8, 1)]])
    assert layouts == [4, 4, 2, 2, 1, 1, 0, 0, 4, 4, 1, 1]
    assert ring.stats.declines["budget"] == 2
    assert transport.fences == 5  # each ring step after a change of layout


def test_the_default_slots_hold_up_to_four_layers_and_leave_depth_plus_two_slots():
    def ring(layers: int, depth: int, slot_layers: int | None = None):
        _, host = pools(depth, shape=(layers, P, KVH, D), slot_layers=slot_layers)
        return host.ring.max_group

    assert ring(16, 1) == 4 and ring(30, 1) == 4  # llama-1b, smollm2-135m
    assert ring(16, 4) == 2 and ring(8, 1) == 2 and ring(5, 1) == 1
    assert ring(16, 0) == 1  # the ordered path takes a layer at a time
    assert ring(5, 1, slot_layers=3) == 3 and ring(5, 1, slot_layers=9) == 5


def test_a_step_declined_right_after_priming_lets_the_primes_land_first():
    """The ordered path writes its slot from the compute side, where late primes would land."""
    device, host = pools(depth=1, shape=BIG, n_pages=64, budget_mib=1, bridge=0, delay_ms=5.0)
    ring, begin = host.ring, host.ring.begin_step
    ordered_steps = []

    def checked_begin(*args, **kwargs):
        begin(*args, **kwargs)
        if not ring.ahead:  # nothing may still be landing in the buffer
            ordered_steps.append(all(ev.done == ev.recorded for ev in ring.ready))

    ring.begin_step = checked_begin
    tables = {0: list(range(1, 23))}  # 21 pages fit the budget's ring (3 x 21 x 16 KiB), 22 not
    steps = [[(0, 0, 330)]] + [[(0, 330 + i, 1)] for i in range(7)]
    assert_same_run(device, host, tables, steps)
    assert ring.stats.primed_steps > 0 and ring.stats.declines["budget"] == 1
    assert ordered_steps == [True]


def test_declining_costs_what_the_ordered_path_costs_and_never_holds_a_ring():
    _, declined = pools(depth=2, shape=BIG, n_pages=96, budget_mib=1, bridge=0)
    _, ordered = pools(depth=0, shape=BIG, n_pages=96, bridge=0)
    tables = {0: list(range(10, 40))}
    for pool in (declined, ordered):
        run_step(pool, [(0, 0, 470)], tables, 0)
        pool.settle()
    a, b = declined.ring.stats, ordered.ring.stats
    assert a.bytes == b.bytes and a.copies == b.copies and a.reallocations == b.reallocations
    assert declined.ring.capacity == ordered.ring.capacity == 32  # one slot, not three


def test_a_device_short_of_headroom_declines_until_memory_frees_up():
    device, host = pools(depth=1, shape=BIG, bridge=0)
    free = [0]
    host.ring.free_bytes = lambda: free[0]
    tables = {0: [1, 2, 3]}
    assert_same_run(device, host, tables, [[(0, 0, 40)]])
    assert host.ring.stats.declines["headroom"] == 1
    free[0] = 1 << 30
    assert_same_run(device, host, tables, [[(0, 40, 1)]])
    assert host.ring.stats.ring_steps == 1


def test_contiguous_pages_move_in_one_copy_per_layer_and_gaps_in_one_more():
    _, host = pools(depth=1, bridge=0)
    run_step(host, [(0, 0, 24)], {0: [8, 9, 10, 11, 12, 13]}, 0)
    stats = host.ring.stats
    assert stats.copies["ahead"] == LAYERS
    assert stats.bytes["ahead"] == LAYERS * 6 * host.ring.page_bytes
    run_step(host, [(0, 0, 8), (1, 0, 8)], {0: [8, 9], 1: [30, 31]}, 1)
    assert stats.copies["ahead"] == LAYERS + 2 * LAYERS
    assert stats.copies["writeback"] == 2  # one a step, all layers together


def test_the_buffer_gives_memory_back_after_a_long_window():
    _, host = pools(depth=1, n_pages=96, bridge=0)
    run_step(host, [(0, 0, 200)], {0: list(range(50))}, 0)
    assert host.ring.capacity == 256  # 3 slots of 50, rounded up
    run_step(host, [(0, 0, 8)], {0: [60, 61]}, 1)
    assert host.ring.capacity == 8


def test_park_and_restore_work_on_a_host_pool():
    _, host = pools(depth=1)
    host.kv.copy_(torch.randn_like(host.kv))
    store = ParkStore(host, 6)
    k_before, v_before = host.k[:, [2, 5, 7]].clone(), host.v[:, [2, 5, 7]].clone()
    store.park(1, [2, 5, 7], [0, 1, 2])
    host.kv.zero_()
    store.restore(1, [0, 1, 2], [9, 0, 4])
    assert torch.equal(host.k[:, [9, 0, 4]], k_before)
    assert torch.equal(host.v[:, [9, 0, 4]], v_before)


def runner_steps() -> list[Step]:
    """Two sequences prefill and decode; one is parked right after a decode step and restored
    into other pages; a page is copied (copy on write) into a third's table."""
    return [
        Step(step=0, seqs=[SeqPlan(id=1, start=0, n=9, pages_add=[5, 2, 7], sample=True),
                           SeqPlan(id=2, start=0, n=5, pages_add=[0, 1], sample=True)]),
        Step(step=1, seqs=[SeqPlan(id=1, start=9, n=1, sample=True),
                           SeqPlan(id=2, start=5, n=1, sample=True)]),
        Step(step=2, seqs=[SeqPlan(id=2, start=6, n=1, sample=True)],
             park=[PageMove(id=1, pages=[5, 2, 7], slots=[0, 1, 2])]),
        Step(step=3, seqs=[SeqPlan(id=1, start=10, n=1, sample=True),
                           SeqPlan(id=2, start=7, n=1, sample=True),
                           SeqPlan(id=3, start=4, n=2, pages_add=[11, 12], sample=True)],
             restore=[PageMove(id=1, pages=[20, 3, 9], slots=[0, 1, 2])],
             copies=[PageCopy(src=0, dst=11)]),
        Step(step=4, seqs=[SeqPlan(id=1, start=11, n=1, sample=True),
                           SeqPlan(id=3, start=6, n=1, sample=True)]),
    ]


@pytest.mark.parametrize("depth", [0, 2])
def test_model_runner_hidden_states_and_tokens_match_the_device_pool(depth):
    stage = load_stage("synthetic:tiny", torch.float32, "cpu")
    results = []
    for kv in ("device", "host"):
        pool = make_pool(stage, 24, P, "cpu", kv=kv, depth=depth, slot_layers=1, delay_ms=1.0)
        runner = build_runner(stage, pool, "cpu", park_pages=4)
        last: dict[int, int] = {1: 7, 2: 9, 3: 11}
        out = []
        for plan in runner_steps():
            plan.token_ids = [t for s in plan.seqs
                              for t in ([last[s.id] + j for j in range(s.n)]
                                        if s.n > 1 else [last[s.id]])]
            meta = runner.apply(plan)
            hidden = runner.forward(plan, meta, None)
            ids, tokens = runner.sample(plan, meta, hidden)
            last.update(zip(ids, tokens))
            out.append((hidden, tokens))
        results.append(out)
    for (h1, t1), (h2, t2) in zip(*results, strict=True):
        assert torch.equal(h1, h2) and t1 == t2


def test_a_process_exits_cleanly_while_primes_are_still_copying():
    """The copy threads are stopped at exit: a thread still inside a torch copy while the
    interpreter tears down aborts the process (a worker would die with SIGABRT on shutdown)."""
    script = textwrap.dedent("""
        import torch
        from worker.attention import choose_attention
        from worker.batch import build_meta
        from worker.kv.host_pool import HostKVPool
        pool = HostKVPool(16, 300, 16, 8, 64, torch.bfloat16, "cpu",
                          choose_attention(False, "cpu", 64), depth=2)
        table, z = list(range(1, 200)), torch.zeros(1, 8, 64, dtype=torch.bfloat16)
        for pos in range(2048, 2052):  # decode steps: each ends by priming 4 large layers
            meta = build_meta([pos], [1], [table], [True], 16, "cpu")
            pool.begin_step(meta, [1])
            for layer in pool.layers:
                layer.enter()
                layer.leave(z, z)
            pool.end_step()
    """)
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
