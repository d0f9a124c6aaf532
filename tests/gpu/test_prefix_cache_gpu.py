"""The prefix cache on CUDA in exact mode: a request's tokens are the same bytes whether its
prefix was a hit, a miss or a partial hit, with prompts chunked beside a crowd, on device KV and
on host KV (`helpers/prefix_workload.py`'s workload, as the CPU test runs it). Skipped without a
GPU."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from helpers.prefix_workload import cache_figures, tokens  # noqa: E402

from coordinator.local_cluster import LocalCluster  # noqa: E402

ARGS = ("--model", "synthetic:smollm2-135m", "--devices", "cuda:0", "--dtype", "bfloat16",
        "--page-size", "16", "--exact")


@pytest.fixture(scope="module")
def uncached() -> list[list[int]]:
    pytest.importorskip("triton")
    with LocalCluster(*ARGS, "--no-prefix-cache", timeout=300) as c:
        return tokens(c.endpoint, crowd=False)


@pytest.mark.parametrize("kv", [("--kv", "device"), ("--kv", "host", "--pipeline-depth", "1")])
def test_exact_tokens_are_the_same_bytes_cached_or_not_on_cuda(uncached, kv):
    with LocalCluster(*ARGS, *kv, "--max-batch-tokens", "48", timeout=300) as c:
        assert tokens(c.endpoint, crowd=True) == uncached
        assert cache_figures(c.endpoint)["hit_tokens"] >= 144 * 5 + 64 * 2
