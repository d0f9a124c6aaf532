"""Steps run in pieces over padded buffers (worker/cuda_graphs.py), here without capture on the
CPU: prompts, a mixed step whose sampled rows are not its first, and decode batches that pad by
different amounts and reuse a bucket's stale rows. In exact mode bit for bit the eager forward,
and drawing rows the eager step's tokens through draw graphs; with host KV bit for bit the
device pool; a step of more rows than the largest bucket still runs eagerly."""

import pytest
import torch
from helpers.graph_steps import PAGE, SAMPLING, run, runner

from protocol.messages import SeqPlan, Step
from worker.build import load_stage, make_pool
from worker.cuda_graphs import DEFAULT_ROWS, MAX_ROWS, PREPARED_ROWS, StepGraphs


def test_pieces_match_the_eager_forward_bit_for_bit_in_exact_mode():
    eager, pieces = run(runner(True, graphs=False)), run(runner(True))
    for (h1, t1), (h2, t2) in zip(eager, pieces, strict=True):
        assert torch.equal(h1, h2) and t1 == t2


def test_pieces_keep_the_default_mode_tokens():
    eager, pieces = run(runner(False, graphs=False)), run(runner(False))
    for (h1, t1), (h2, t2) in zip(eager, pieces, strict=True):
        torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)
        assert t1 == t2


def test_pieces_draw_the_eager_steps_tokens_through_draw_graphs():
    eager, r = run(runner(True, graphs=False), sampling=SAMPLING), runner(True)
    pieces = run(r, sampling=SAMPLING)
    assert [t for _, t in pieces] == [t for _, t in eager]
    greedy = run(runner(True))
    assert [t for _, t in pieces] != [t for _, t in greedy]  # the draws are not the argmax
    # graphs by (drawing rows padded, largest top-k padded, top-p): the prompts' step draws 2
    # rows (top-k 20, no top-p), the mixed step 2 (top-k 5, top-p), the decode batches 1 to 4
    assert set(r.graphs.draws.graphs) == {(2, 32, False), (2, 8, True), (4, 32, True),
                                          (1, 32, False)}


@pytest.mark.parametrize("slot_layers", [1, 3])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_host_kv_through_the_pieces_matches_device_kv_bit_for_bit(exact, depth, slot_layers):
    """With slots of several layers, a piece holds a slot's layers (the last one fewer), the
    first also the embedding."""
    host_runner = runner(exact, kv="host", depth=depth, slot_layers=slot_layers)
    on_device, host = run(runner(exact)), run(host_runner)
    for (h1, t1), (h2, t2) in zip(on_device, host, strict=True):
        assert torch.equal(h1, h2) and t1 == t2
    ring = host_runner.pool.ring
    assert (ring.stats.primed_steps > 0) == (depth < ring.n_groups)
    graph = next(iter(host_runner.graphs.graphs.values()))
    assert len(graph.pieces) == ring.n_groups


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
    assert all(len(g.pieces) == 4 // size for (_, _, size), g in graphs.items())
    assert sum(ring.stats.declines.values()) == 0


def test_prompt_mixed_and_decode_steps_that_fit_a_bucket_use_the_pieces():
    r = runner(True)
    run(r)
    # the prompts' step (27 rows), the mixed step (10), the decode batches (5, 3, 1, 4, 2)
    assert sorted(r.graphs.buckets) == [1, 2, 4, 8, 16, 32]
    # powers of two up to 64 rows, then multiples of 64, up to the step budget
    assert [r.graphs.bucket_rows(n) for n in (1, 3, 8, 9, 64, 65, 129, 384, DEFAULT_ROWS,
                                              DEFAULT_ROWS + 1)] == \
        [1, 4, 8, 16, 64, 128, 192, 384, DEFAULT_ROWS, None]


def test_a_step_of_more_rows_than_the_largest_bucket_runs_eagerly_with_the_same_bits():
    pages = -(-(DEFAULT_ROWS + 1) // PAGE)
    plan = Step(step=0, token_ids=[i % 500 for i in range(DEFAULT_ROWS + 1)], seqs=[
        SeqPlan(id=1, start=0, n=DEFAULT_ROWS + 1, pages_add=list(range(pages)), sample=True)])
    out = []
    for r in (runner(True, graphs=False, n_pages=pages), runner(True, n_pages=pages)):
        meta = r.apply(plan)
        hidden = r.forward(plan, meta, None)
        out.append((hidden, r.sample(plan, meta, hidden)))
    assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]
    assert r.graphs.buckets == set()


def test_capture_needs_a_cuda_device():
    stage = load_stage("synthetic:tiny", torch.float32, "cpu")
    pool = make_pool(stage, 8, PAGE, "cpu")
    with pytest.raises(ValueError, match="cuda device"):
        StepGraphs(stage, pool, "cpu")


def test_prepare_builds_every_bucket_a_batch_limit_can_use():
    r = runner(False)
    r.graphs.prepare(20)
    assert sorted(r.graphs.buckets) == [1, 2, 4, 8, 16, 32]
    r.graphs.prepare(DEFAULT_ROWS * 4)
    assert max(r.graphs.buckets) == DEFAULT_ROWS


def test_a_larger_step_budget_gets_graphs_up_to_it_and_no_further_than_max_rows():
    graphs = runner(False).graphs
    for budget, top in ((700, 704), (MAX_ROWS * 2, MAX_ROWS)):
        wide = StepGraphs(graphs.stage, graphs.kv_pool, "cpu", capture=False, max_rows=budget)
        assert wide.bucket_rows(min(budget, MAX_ROWS)) == top
        assert wide.bucket_rows(top + 1) is None
        assert wide.logits.shape[0] == top
    # built at load up to PREPARED_ROWS; past it, on first use
    wide = StepGraphs(graphs.stage, graphs.kv_pool, "cpu", capture=False, max_rows=700)
    wide.prepare()
    assert sorted(wide.buckets) == [1, 2, 4, 8, 16, 32, 64, *range(128, PREPARED_ROWS + 1, 64)]
