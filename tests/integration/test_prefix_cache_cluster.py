"""The prefix cache through real clusters: in exact mode a request's tokens are byte-identical
whether its prefix was a hit, a miss or a partial hit, and whatever chunking computed the cached
pages; in default mode greedy tokens agree for these prompts; a pool smaller than the working
set evicts instead of preempting, and everything drains; `--no-prefix-cache` turns it off."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from helpers.prefix_workload import GREEDY, MODEL, cache_figures, tokens

from coordinator.prometheus_config import free_metrics_port
from protocol import AsyncClient, Client


@pytest.fixture(scope="module")
def uncached_exact(launch) -> list[list[int]]:
    c = launch(*MODEL, "--exact", "--no-prefix-cache")
    out = tokens(c.endpoint, crowd=False)
    assert cache_figures(c.endpoint)["queried_tokens"] == 0
    c.stop()
    return out


def test_exact_mode_tokens_are_the_same_bytes_cached_or_not(launch, uncached_exact):
    # prompts chunked 48 rows a step beside a crowd: the cached pages come from steps of
    # other shapes than an uncached request's own prefill
    c = launch(*MODEL, "--exact", "--max-batch-tokens", "48")
    assert tokens(c.endpoint, crowd=True) == uncached_exact
    figures = cache_figures(c.endpoint)
    # hits: 9 pages (144 tokens) for each later full match, 4 for the partial one
    assert figures["hit_tokens"] >= 144 * 5 + 64 * 2, figures
    c.stop()


def test_exact_tokens_keep_their_bytes_when_parked_sequences_come_back_on_cached_pages(
        launch, uncached_exact):
    """Every sequence parked every 2 decode steps: a restore takes the full pages still cached
    (its own, idle since the park) and moves only the rest back, with the same bytes out."""
    port = free_metrics_port(1)
    c = launch(*MODEL, "--exact", "--preempt-every", "2", "--metrics-port", str(port))
    assert tokens(c.endpoint, crowd=True) == uncached_exact
    parked = scrape(port, "siding_park_bytes_total{direction=\"out\"}")
    restored = scrape(port, "siding_park_bytes_total{direction=\"in\"}")
    assert scrape(port, "siding_restores_total") > 0
    assert 0 < restored < parked / 2, (restored, parked)
    c.stop()


def test_default_mode_greedy_tokens_agree_cached_or_not(launch):
    off = launch(*MODEL, "--no-prefix-cache")
    expected = tokens(off.endpoint, crowd=False, options=(GREEDY,))
    off.stop()
    on = launch(*MODEL)
    assert tokens(on.endpoint, crowd=False, options=(GREEDY,)) == expected
    on.stop()


def scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(name + " "))


def test_a_pool_smaller_than_the_working_set_evicts_instead_of_preempting(launch):
    port = free_metrics_port(1)
    # 40 pages: two requests of 13 pages at a time fit, the 8 distinct prefixes (104) do not
    small = launch(*MODEL, "--kv-pages", "40", "--max-batch-seqs", "2", "--metrics-port",
                   str(port))
    prompts = [[100 * k + i for i in range(200)] for k in range(8)]

    async def main() -> None:
        async with AsyncClient(small.endpoint, timeout=300) as c:
            for _ in range(2):  # the second round finds the earliest prefixes evicted
                await asyncio.gather(*(c.generate(prompt_token_ids=p, max_tokens=4,
                                                  ignore_eos=True) for p in prompts))
            # a hit abandoned mid-stream, and a client that vanishes during one
            stream = c.stream(prompt_token_ids=prompts[-1], max_tokens=200, ignore_eos=True)
            await stream.__anext__()
            await stream.aclose()
        gone = AsyncClient(small.endpoint, timeout=300)
        task = asyncio.ensure_future(gone.generate(prompt_token_ids=prompts[-2],
                                                   max_tokens=200, ignore_eos=True))
        await asyncio.sleep(0.5)
        task.cancel()
        await gone.close()

    asyncio.run(main())
    deadline = time.monotonic() + 60
    with Client(small.endpoint, timeout=60) as c:
        while (s := c.status())["pool"]["pages_used"] or s["requests"]["running"]:
            assert time.monotonic() < deadline, s["pool"]
            time.sleep(0.2)
    assert scrape(port, "siding_prefix_cache_evictions_total") > 0
    assert scrape(port, "siding_prefix_cache_hits_total") > 0
    assert scrape(port, "siding_preemptions_total{action=\"park\"}") == 0
    assert scrape(port, "siding_preemptions_total{action=\"recompute\"}") == 0
    assert 0 < scrape(port, "siding_prefix_cache_pages") <= 40
