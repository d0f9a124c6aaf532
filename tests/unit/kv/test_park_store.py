import pytest
import torch

from protocol.errors import ProtocolError
from protocol.messages import PageMove, SeqPlan, Step
from worker.attention import choose_attention
from worker.kv.device_pool import KVPool
from worker.kv.park_store import ParkStore
from worker.runner import ModelRunner, SequenceFault


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

    runner = ModelRunner(Stage(), pool, ParkStore(pool, 6), "cpu")
    runner.apply(Step(step=0, park=[PageMove(id=3, pages=[1, 2], slots=[0, 1])]))
    bad = Step(step=1, restore=[PageMove(id=3, pages=[4, 5], slots=[2, 3])],
               seqs=[SeqPlan(id=3, start=8, n=1)])
    with pytest.raises(SequenceFault) as e:
        runner.apply(bad)
    assert e.value.seq_id == 3 and "park store" in str(e.value)
