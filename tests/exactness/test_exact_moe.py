"""Exact mode on a mixture of experts (synthetic:moe-tiny: Qwen3-MoE's block, 16 experts, 4 a
token), on the CPU: a request's tokens, greedy and seeded, equal its tokens alone beside 15
neighbours routed elsewhere, parked and restored, with host KV, over 2 workers, and when its
prompt is served from its own cached prefix. A layer's row keeps its bits alone and beside
others only under exact mode: default mode's float32 products do not. (Tokens are a coarse
read: on this model default mode's crowds gave every request its solo tokens too, 32 of 32 in
the 2-worker preempting crowd; the layer's bits are what the last test compares.)"""

import pytest
import torch
from exactness.crowd import (
    GREEDY,
    SAMPLED,
    cluster,
    neighbours,
    run_alone,
    run_crowd,
    target,
    with_target,
)

from protocol import Client
from worker.build import load_stage

MOE = ("--model", "synthetic:moe-tiny", "--exact")
TARGETS = [target(GREEDY), target(SAMPLED)]
NEIGHBOURS = neighbours(15)

# name: (launch arguments, whether the crowd must see preemptions)
CONFIGS = {
    "workers2-chunk16-preempt3": (("--workers", "2", "--max-batch-tokens", "16",
                                   "--preempt-every", "3"), True),
    "host-kv": (("--kv", "host", "--max-batch-tokens", "32"), False),
}


@pytest.fixture(scope="module")
def solo() -> dict:
    """Every request's tokens alone, on one worker, without a prefix cache."""
    requests = TARGETS + NEIGHBOURS
    with cluster(*MOE, "--workers", "1", "--no-prefix-cache") as c:
        return dict(zip(requests, run_alone(c.endpoint, requests).tokens))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_moe_request_gets_its_solo_tokens_in_a_crowd_routed_elsewhere(solo, config):
    args, preempts = CONFIGS[config]
    with cluster(*MOE, *args) as c:
        for t in TARGETS:
            requests = with_target(t, NEIGHBOURS)
            outcome = run_crowd(c.endpoint, requests)
            assert outcome.tokens == [solo[r] for r in requests]
            assert outcome.preemptions > 0 or not preempts


def test_a_moe_request_gets_its_solo_tokens_from_its_own_cached_prefix(solo):
    with cluster(*MOE, "--workers", "1") as c:
        cold = run_alone(c.endpoint, TARGETS).tokens
        warm = run_alone(c.endpoint, TARGETS).tokens
        with Client(c.endpoint, timeout=60) as client:
            cache = client.status()["prefix_cache"]
    assert cold == warm == [solo[t] for t in TARGETS]
    assert cache["hit_tokens"] > 0


@pytest.mark.parametrize("exact", [True, False])
def test_a_moe_layers_row_keeps_its_bits_beside_others_only_in_exact_mode(exact):
    moe = load_stage("synthetic:moe-tiny", torch.float32, "cpu", exact=exact).layers[0]
    x = torch.randn(64, moe.feed_forward.router.in_features,
                    generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        crowd = moe.feed_forward(x)
        alone = [torch.equal(moe.feed_forward(x[i:i + 1])[0], crowd[i]) for i in range(64)]
    assert all(alone) if exact else not all(alone)
