"""The exactness matrix on the CPU: with --exact, every request's tokens (the target's and each
neighbour's, greedy and seeded top-p) equal its tokens alone on one worker, beside 0, 3 or 15
others arriving at different times, on 1, 2 or 3 workers, in prompt chunks of 4, 16 or 512
tokens, preempted every 3 steps or by a pool too small for the crowd.

synthetic:tiny's random weights leave near-ties everywhere, so a changed bit shows as a changed
token; docs/exact-mode.md records which cells differ without --exact.
"""

import pytest
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

TINY = ("--model", "synthetic:tiny", "--exact")
SMOLLM2 = ("--model", "smollm2-135m", "--exact")
NEIGHBOURS = neighbours(15)
SAMPLINGS = {"greedy": GREEDY, "sampled": SAMPLED}

# name: (launch arguments, whether the crowd of 16 must see preemptions)
CONFIGS = {
    "workers1": (("--workers", "1"), False),
    "workers2-chunk16": (("--workers", "2", "--max-batch-tokens", "16"), False),
    "workers3-chunk4-preempt3": (
        ("--workers", "3", "--max-batch-tokens", "4", "--preempt-every", "3"), True),
    "workers2-small-pool": (("--workers", "2", "--kv-pages", "48", "--page-size", "4"), True),
}  # fmt: skip


@pytest.fixture(scope="module")
def solo() -> dict:
    """Every request's tokens alone, on one worker with default chunking and pages."""
    requests = [target(s) for s in SAMPLINGS.values()] + NEIGHBOURS
    with cluster(*TINY, "--workers", "1") as c:
        return dict(zip(requests, run_alone(c.endpoint, requests).tokens))


@pytest.fixture(scope="module", params=list(CONFIGS))
def config(request):
    args, preempts = CONFIGS[request.param]
    with cluster(*TINY, *args) as c:
        yield c, preempts


@pytest.mark.parametrize("crowd", [0, 3, 15])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_every_request_gets_its_solo_tokens_in_any_crowd_and_configuration(
    solo, config, crowd, sampling
):
    c, preempts = config
    requests = with_target(target(SAMPLINGS[sampling]), NEIGHBOURS[:crowd])
    outcome = run_crowd(c.endpoint, requests)
    assert outcome.tokens == [solo[r] for r in requests]
    if preempts and crowd == 15:
        assert outcome.preemptions > 0, "the configuration should have preempted someone"


def test_default_model_target_gets_its_solo_tokens_beside_others_and_when_preempted():
    requests = [target(s, max_tokens=12) for s in SAMPLINGS.values()]
    others = neighbours(3, max_tokens=14)
    with cluster(*SMOLLM2, "--workers", "1") as c:
        alone = run_alone(c.endpoint, requests).tokens
    with cluster(*SMOLLM2, "--workers", "2", "--max-batch-tokens", "16",
                 "--preempt-every", "3") as c:
        crowded = [run_crowd(c.endpoint, with_target(r, others)) for r in requests]
    assert [o.tokens[len(others) // 2] for o in crowded] == alone
    assert all(o.preemptions > 0 for o in crowded)
