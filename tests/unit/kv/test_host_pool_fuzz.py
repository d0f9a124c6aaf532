"""Random schedules of a host pool against a device pool, bit for bit: batches that continue the
last step (carrying its rows) and batches that do not, sequences joining, finishing and copied
into new pages between steps, steps forced onto the ordered path by the budget and back, host
settles, new pages anywhere in the window, every depth, slots of one to three layers (and of
fewer where a budget allows only those), default and exact attention, with and without delayed
copies, the ring's event protocol checked as it is issued. Written by a review of the carried
rows; it catches a carry without the window check and a non-continuing step that does not land
the last step's rows."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.ring import CheckedTransport, P, pools, run_step

N_PAGES = 48


def copy_pages(pools_, src: list[int], dst: list[int]) -> None:
    for pool in pools_:
        pool.settle()
        for t in (pool.k, pool.v):
            t[:, dst] = t[:, src].clone()


@pytest.mark.parametrize("seed", range(12))
def test_random_schedules_match_the_device_pool(seed):
    run_schedule(seed)


def test_the_random_schedules_take_every_slot_size_and_the_ordered_path():
    """What the schedules cover, across seeds: slots smaller than the most, and declines."""
    assert set().union(*map(run_schedule, range(12))) == {0, 1, 2, 3}


def run_schedule(seed: int) -> set[int]:
    """One random schedule, checked step by step; the slot sizes its ring steps took (0: the
    ordered path)."""
    rng = random.Random(seed)
    transport = CheckedTransport(delay_ms=rng.choice([0.0, 0.3]))
    device, host = pools(rng.choice([0, 1, 2, 3, 8]), exact=bool(seed % 2),
                         transport=transport, bridge=rng.choice([0, None]),
                         n_pages=N_PAGES, slot_layers=rng.choice([1, 2, 3]))
    transport.start(host.ring)
    sizes = set()
    free = list(range(N_PAGES))
    rng.shuffle(free)
    seqs: dict[int, list] = {}  # id -> [pages, context]
    next_id = 0
    for step in range(40):
        event = rng.random()
        if event < 0.1 and seqs:  # a new sequence starts as a copy of another (a fork)
            pages, ctx = seqs[rng.choice(list(seqs))]
            if ctx and len(free) >= len(pages):
                new = [free.pop() for _ in pages]
                copy_pages((device, host), pages, new)
                seqs[next_id] = [new, ctx]
                next_id += 1
        elif event < 0.15:
            # 1 byte: every ring step declines; pages' worth: some take smaller slots
            host.ring.budget = rng.choice([0, 1, rng.randint(6, 60) * host.ring.page_bytes])
        elif event < 0.2 and len(seqs) > 1:  # a sequence finishes
            free.extend(seqs.pop(rng.choice(list(seqs)))[0])
            rng.shuffle(free)
        elif event < 0.25:
            host.settle()
        if not seqs or (len(seqs) < 3 and rng.random() < 0.3 and len(free) >= 4):
            seqs[next_id] = [[], 0]
            next_id += 1
        ids = sorted(seqs)  # usually every sequence, in order: the batch continues
        if rng.random() < 0.15 and len(ids) > 1:
            ids = rng.sample(ids, rng.randint(1, len(ids)))
        chunk = []
        for i in ids:
            pages, ctx = seqs[i]
            n = rng.randint(1, 9) if ctx == 0 else (1 if rng.random() < 0.9 else rng.randint(1, 4))
            need = -(-(ctx + n) // P) - len(pages)
            if need > len(free):
                continue
            for _ in range(need):  # from either end of the free list: before or after the window
                free.sort(reverse=rng.random() < 0.5)
                pages.append(free.pop())
            chunk.append((i, ctx, n))
        if not chunk:
            continue
        tables = {i: seqs[i][0] for i, _, _ in chunk}
        a = run_step(device, chunk, tables, step)
        b = run_step(host, chunk, tables, step)
        sizes.add(host.ring.group if host.ring.ahead else 0)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (step, chunk)
        for i, start, n in chunk:
            seqs[i][1] = start + n
    host.settle()
    assert torch.equal(device.k, host.k) and torch.equal(device.v, host.v)
    return sizes
