import pytest
import torch

from protocol.errors import ProtocolError
from protocol.messages import PageMove, SeqPlan, Step
from worker.attention import choose_attention
from worker.build import build_runner
from worker.kv.device_pool import KVPool
from worker.kv.park_store import ParkStore
from worker.runner import SequenceFault


def filled_pool() -> KVPool:
    pool = KVPool(3, 10, 4, 2, 8, torch.float32, "cpu", choose_attention(False, "cpu", 8))
    pool.k.copy_(torch.randn_like(pool.k))
    pool.v.copy_(torch.randn_like(pool.v))
    return pool


def test_parked_pages_come_back_identical_at_other_pages():
    pool = filled_pool()
    store = ParkStore(pool, 6)
    k_before, v_before = pool.k[:, [2, 5, 7]].clone(), pool.v[:, [2, 5, 7]].clone()
    moved = store.park(1, [2, 5, 7], [0, 1, 2])
    assert moved == 3 * pool.bytes_per_page
    pool.k.zero_()
    pool.v.zero_()
    store.restore(1, [0, 1, 2], [9, 0, 4])
    assert torch.equal(pool.k[:, [9, 0, 4]], k_before)
    assert torch.equal(pool.v[:, [9, 0, 4]], v_before)


def test_scattered_slots_work_too():
    pool = filled_pool()
    store = ParkStore(pool, 6)
    before = pool.k[:, [1, 3]].clone()
    store.park(4, [1, 3], [5, 2])
    store.restore(4, [5, 2], [6, 8])
    assert torch.equal(pool.k[:, [6, 8]], before)


@pytest.mark.parametrize("slots,pages,words", [
    ([0, 1], [3, 4], "does not hold"),  # slots of another sequence
    ([0], [3], "does not hold"),  # short
])
def test_a_restore_the_store_cannot_honour_is_refused(slots, pages, words):
    store = ParkStore(filled_pool(), 6)
    store.park(1, [2, 5], [2, 3])
    with pytest.raises(ProtocolError, match=words):
        store.restore(1, slots, pages)


def test_runner_names_the_sequence_of_a_corrupt_restore():
    pool = filled_pool()

    class Stage:  # the runner only needs to know which ends of the model it holds
        embed = output = None

    runner = build_runner(Stage(), pool, "cpu", park_pages=6)
    runner.apply(Step(step=0, park=[PageMove(id=3, pages=[1, 2], slots=[0, 1])]))
    bad = Step(step=1, restore=[PageMove(id=3, pages=[4, 5], slots=[2, 3])],
               seqs=[SeqPlan(id=3, start=8, n=1)])
    with pytest.raises(SequenceFault) as e:
        runner.apply(bad)
    assert e.value.seq_id == 3 and "park store" in str(e.value)


def test_the_last_slots_of_a_park_can_be_restored_alone():
    """A restore whose leading pages were found resident (shared, or in the prefix cache)
    brings back only the rest; a restore of the leading slots alone is refused."""
    pool = filled_pool()
    store = ParkStore(pool, 6)
    tail = pool.k[:, [5, 7]].clone()
    store.park(1, [2, 5, 7], [0, 1, 2])
    with pytest.raises(ProtocolError, match="does not hold"):
        store.restore(1, [0, 1], [8, 9])
    store.restore(1, [1, 2], [8, 9])
    assert torch.equal(pool.k[:, [8, 9]], tail)


def test_a_restore_of_resident_pages_only_sets_the_table_and_forgets_the_park():
    pool = filled_pool()

    class Stage:
        embed = output = None

    runner = build_runner(Stage(), pool, "cpu", park_pages=6)
    runner.apply(Step(step=0, park=[PageMove(id=3, pages=[1, 2], slots=[0, 1])]))
    runner.apply(Step(step=1, restore=[PageMove(id=3, pages=[6], slots=[1], kept=[4])]))
    assert runner.tables[3] == [4, 6]
    runner.apply(Step(step=2, park=[PageMove(id=5, pages=[8], slots=[2])]))
    runner.apply(Step(step=3, restore=[PageMove(id=5, pages=[], slots=[], kept=[8])]))
    assert runner.tables[5] == [8] and 5 not in runner.park.records
    with pytest.raises(SequenceFault, match="out of range"):
        runner.apply(Step(step=4, restore=[PageMove(id=6, kept=[99])]))
