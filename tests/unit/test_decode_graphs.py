"""Decode steps run in pieces over padded buffers (worker/cuda_graphs.py), here without capture on
the CPU: in exact mode bit for bit the eager forward, for batches that pad by different amounts
and reuse a bucket's stale rows; with host KV bit for bit the device pool; steps the pieces do
not cover (prefill, mixed) still run eagerly."""

import pytest
import torch

from protocol.messages import SeqPlan, Step
from worker.cuda_graphs import MAX_ROWS, DecodeGraphs
from worker.exact import apply_exact
from worker.host_kv import HostKVPool
from worker.kv_pool import KVPool
from worker.loaders.synthetic import SyntheticSource
from worker.park_store import ParkStore
from worker.runner import ModelRunner
from worker.transport import CpuTransport, CudaTransport

PAGE = 4
PROMPTS = {1: 9, 2: 5, 3: 13, 4: 2, 5: 7}  # sequence id -> prompt length
# decode batches: 5 rows pad to 8, 3 to 4 (rows past them stale from the 5-row step), 1, 4, 2,
# then one batch twice (a host pool's second step takes its first layers primed)
DECODES = [[1, 2, 3, 4, 5], [2, 4, 5], [3], [1, 2, 3, 4], [5, 1], [1, 2, 3, 4, 5],
           [1, 2, 3, 4, 5]]


def schedule(prompts: dict[int, int] = PROMPTS) -> list[Step]:
    """Prompts of sequences 1-3, then (mixed) of 4 and 5 beside a decode row of 1, then DECODES;
    pages interleaved across sequences, so no table is a run."""
    pages = iter(range(pages_needed(prompts)))
    n_pages = {i: -(-(n + len(DECODES) + 1) // PAGE) for i, n in prompts.items()}
    tables = {i: [] for i in prompts}
    for k in range(max(n_pages.values())):
        for i in prompts:
            if k < n_pages[i]:
                tables[i].append(next(pages))
    steps = [Step(step=0, seqs=[SeqPlan(id=i, start=0, n=prompts[i], pages_add=tables[i],
                                        sample=True) for i in (1, 2, 3)]),
             # a mixed step: one prompt beside decode rows runs eagerly
             Step(step=1, seqs=[SeqPlan(id=4, start=0, n=prompts[4], pages_add=tables[4],
                                        sample=True),
                                SeqPlan(id=5, start=0, n=prompts[5], pages_add=tables[5],
                                        sample=True),
                                SeqPlan(id=1, start=prompts[1], n=1, sample=True)])]
    pos = dict(prompts)
    pos[1] += 1
    for k, ids in enumerate(DECODES):
        steps.append(Step(step=2 + k, seqs=[SeqPlan(id=i, start=pos[i], n=1, sample=True)
                                             for i in ids]))
        for i in ids:
            pos[i] += 1
    return steps


def pages_needed(prompts: dict[int, int]) -> int:
    return sum(-(-(n + len(DECODES) + 1) // PAGE) for n in prompts.values())


def run(runner: ModelRunner, prompts: dict[int, int] = PROMPTS
        ) -> list[tuple[torch.Tensor, list[int]]]:
    """Hidden rows and sampled tokens of every step of `schedule(prompts)`."""
    last = {i: 100 + i for i in prompts}
    out = []
    for plan in schedule(prompts):
        plan.token_ids = [(last[s.id] + j) % 500 for s in plan.seqs for j in range(s.n)]
        meta = runner.apply(plan)
        hidden = runner.forward(plan, meta, None)
        ids, tokens = runner.sample(plan, meta, hidden)
        last.update(zip(ids, tokens))
        out.append((hidden, tokens))
    return out


def runner(exact: bool, kv: str = "device", graphs: bool = True, device: str = "cpu",
           dtype: torch.dtype = torch.float32, n_pages: int = 64, depth: int = 1,
           slot_layers: int | None = 1) -> ModelRunner:
    """On a CUDA device the pieces are captured graphs and the host pool's copies go on a
    transfer stream; on the CPU the pieces run eagerly and copies go through the copy thread."""
    source = SyntheticSource("tiny")
    a = source.args
    stage = source.load_stage(0, a.n_layers, dtype, device)
    if exact:
        apply_exact(stage, device)
    shape = (a.n_layers, n_pages, PAGE, a.n_kv_heads, a.head_dim)
    if kv == "host":
        transport = CudaTransport(device, 0.5) if device != "cpu" else CpuTransport(0.5)
        pool = HostKVPool(*shape, dtype, device, exact=exact, depth=depth, transport=transport,
                          slot_layers=slot_layers)
    else:
        pool = KVPool(*shape, dtype, device, exact=exact)
    pieces = DecodeGraphs(stage, pool, device, capture=device != "cpu") if graphs else None
    return ModelRunner(stage, pool, ParkStore(pool, 4), device, pieces)


def test_pieces_match_the_eager_forward_bit_for_bit_in_exact_mode():
    eager, pieces = run(runner(True, graphs=False)), run(runner(True))
    for (h1, t1), (h2, t2) in zip(eager, pieces, strict=True):
        assert torch.equal(h1, h2) and t1 == t2


def test_pieces_keep_the_default_mode_tokens():
    eager, pieces = run(runner(False, graphs=False)), run(runner(False))
    for (h1, t1), (h2, t2) in zip(eager, pieces, strict=True):
        torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)
        assert t1 == t2


@pytest.mark.parametrize("slot_layers", [1, 3])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_host_kv_through_the_pieces_matches_device_kv_bit_for_bit(exact, depth, slot_layers):
    """With slots of several layers, a piece holds a slot's layers (the last one fewer)."""
    host_runner = runner(exact, kv="host", depth=depth, slot_layers=slot_layers)
    on_device, host = run(runner(exact)), run(host_runner)
    for (h1, t1), (h2, t2) in zip(on_device, host, strict=True):
        assert torch.equal(h1, h2) and t1 == t2
    ring = host_runner.pool.ring
    assert (ring.stats.primed_steps > 0) == (depth < ring.n_groups)
    graph = next(iter(host_runner.graphs.graphs.values()))
    assert len(graph.pieces) == 1 + ring.n_groups


def test_steps_whose_ring_takes_smaller_slots_use_pieces_of_that_size_bit_for_bit():
    """A budget that fits slots of 2 layers (2 of them: 4 windows) for the small batches and only
    slots of 1 (3 windows) for the large ones: the pieces are kept per slot size."""
    host_runner = runner(True, kv="host", slot_layers=2)
    ring = host_runner.pool.ring
    ring.budget = 66 * ring.page_bytes  # the 5-sequence window is 22 pages
    on_device, host = run(runner(True)), run(host_runner)
    for (h1, t1), (h2, t2) in zip(on_device, host, strict=True):
        assert torch.equal(h1, h2) and t1 == t2
    graphs = host_runner.graphs.graphs
    assert {size for _, _, size in graphs} == {1, 2}
    assert all(len(g.pieces) == 1 + 4 // size for (_, _, size), g in graphs.items())
    assert sum(ring.stats.declines.values()) == 0


def test_only_decode_steps_that_fit_a_bucket_use_the_pieces():
    r = runner(True)
    run(r)
    assert sorted(r.graphs.buckets) == [1, 2, 4, 8]
    assert [DecodeGraphs.bucket_rows(n) for n in (1, 3, 8, 9, MAX_ROWS, MAX_ROWS + 1)] == \
        [1, 4, 8, 16, MAX_ROWS, None]


def test_capture_needs_a_cuda_device():
    source = SyntheticSource("tiny")
    a = source.args
    stage = source.load_stage(0, a.n_layers, torch.float32, "cpu")
    pool = KVPool(a.n_layers, 8, PAGE, a.n_kv_heads, a.head_dim, torch.float32, "cpu")
    with pytest.raises(ValueError, match="cuda device"):
        DecodeGraphs(stage, pool, "cpu")


def test_prepare_builds_every_bucket_a_batch_limit_can_use():
    r = runner(False)
    r.graphs.prepare(20)
    assert sorted(r.graphs.buckets) == [1, 2, 4, 8, 16, 32]
    r.graphs.prepare(MAX_ROWS * 4)
    assert max(r.graphs.buckets) == MAX_ROWS
