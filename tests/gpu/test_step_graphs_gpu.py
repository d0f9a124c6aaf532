"""Steps replayed from captured CUDA graphs (prompts, a mixed step and decodes), in bfloat16: bit
for bit the eager forward in exact mode (Triton kernels), and with host KV (transfer stream,
delayed copies) bit for bit the device pool in both modes, also for a context already in the
pool whose first step is a captured decode; a drawing step's tokens through captured draw
graphs, the eager step's. Skipped without a GPU."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from helpers.graph_steps import SAMPLING, pages_needed, run, runner  # noqa: E402

from benchmarks.kv_pipeline import build_arms, parse_args  # noqa: E402
from worker.loaders import resolve  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
LONG = {1: 700, 2: 300, 3: 530, 4: 260, 5: 45}  # contexts over several 256-key splits


def test_captured_graphs_match_the_eager_forward_bit_for_bit_in_exact_mode():
    pytest.importorskip("triton")
    eager = run(runner(True, graphs=False, device=DEV, dtype=DT))
    r = runner(True, device=DEV, dtype=DT)
    graphed = run(r)
    assert sorted(r.graphs.buckets) == [1, 2, 4, 8, 16, 32]  # the prompts and mixed step too
    for (h1, t1), (h2, t2) in zip(eager, graphed, strict=True):
        assert torch.equal(h1, h2) and t1 == t2


def test_captured_draw_graphs_draw_the_eager_steps_tokens():
    pytest.importorskip("triton")
    eager = run(runner(True, graphs=False, device=DEV, dtype=DT), sampling=SAMPLING)
    r = runner(True, device=DEV, dtype=DT)
    graphed = run(r, sampling=SAMPLING)
    assert [t for _, t in graphed] == [t for _, t in eager]
    assert all(g.graph is not None for g in r.graphs.draws.graphs.values())
    assert [t for _, t in graphed] != [t for _, t in run(runner(True, device=DEV, dtype=DT))]


@pytest.mark.parametrize("slot_layers", [1, 3])
@pytest.mark.parametrize("exact", [False, True])
def test_captured_graphs_with_host_kv_match_device_kv_bit_for_bit(exact, slot_layers):
    """Also with a graph per ring slot of three layers."""
    if exact:
        pytest.importorskip("triton")
    on_device = run(runner(exact, device=DEV, dtype=DT))
    host = run(runner(exact, kv="host", device=DEV, dtype=DT, slot_layers=slot_layers))
    for (h1, t1), (h2, t2) in zip(on_device, host, strict=True):
        assert torch.equal(h1, h2) and t1 == t2


def test_captured_graphs_of_each_slot_size_a_budget_makes_the_ring_take_match_bit_for_bit():
    """As the CPU test: slots of 2 layers for the small batches, of 1 for the large ones."""
    host_runner = runner(True, kv="host", device=DEV, dtype=DT, slot_layers=2)
    ring = host_runner.pool.ring
    ring.budget = 66 * ring.page_bytes  # the 5-sequence window is 22 pages
    on_device, host = run(runner(True, device=DEV, dtype=DT)), run(host_runner)
    for (h1, t1), (h2, t2) in zip(on_device, host, strict=True):
        assert torch.equal(h1, h2) and t1 == t2
    assert {size for _, _, size in host_runner.graphs.graphs} == {1, 2}


def test_captured_graphs_keep_the_default_mode_tokens():
    eager = run(runner(False, graphs=False, device=DEV, dtype=DT))
    graphed = run(runner(False, device=DEV, dtype=DT))
    assert [t for _, t in eager] == [t for _, t in graphed]


@pytest.mark.parametrize("kv", ["device", "host"])
def test_captured_graphs_over_several_splits_match_the_eager_forward_bit_for_bit(kv):
    """Splits bucketed to a power of two, tables and page bases in fixed buffers, padding rows
    written to the spare page: the same bits as the eager step."""
    pytest.importorskip("triton")
    n = pages_needed(LONG)
    eager = run(runner(True, graphs=False, device=DEV, dtype=DT, n_pages=n), LONG)
    r = runner(True, kv=kv, device=DEV, dtype=DT, n_pages=n)
    graphed = run(r, LONG)
    assert {splits for _, splits, _ in r.graphs.graphs} == {2, 4}
    for (h1, t1), (h2, t2) in zip(eager, graphed, strict=True):
        assert torch.equal(h1, h2) and t1 == t2


@pytest.mark.parametrize("depth", [1, 2])
def test_a_context_already_in_a_host_pool_decodes_from_its_first_step_in_captured_graphs(
        depth):
    """The first step is a decode, so its graphs are captured before the ring has delivered
    most layers even once (a wait captured on an event never recorded would not wait: see
    docs/kv-pipelining.md, "Captured ring events"); every copy is delayed on the transfer
    stream, so a missing wait reads a slot before it lands."""
    a = parse_args(["--model", "synthetic:tiny", "--depths", str(depth),
                    "--transport-delay-ms", "0.3"])
    source = resolve(a.model)
    stage = source.load_stage(0, source.args.n_layers, DT, DEV)
    arms = build_arms(stage, source.args, 1500, 24, DT, torch.device(DEV), a, graphs=True)
    for arm in arms:
        for _ in range(24):
            arm.step()
    device, ordered, pipelined = arms
    assert pipelined.pool.ring.stats.ring_steps == 24
    assert pipelined.tokens == device.tokens == ordered.tokens
