"""The engine core's metrics: vLLM's names carry siding's figures, from the same observations."""

from __future__ import annotations

import random

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.metrics import (
    LATENCY_BUCKETS,
    VLLM_ITL_BUCKETS,
    VLLM_TTFT_BUCKETS,
    CoordinatorMetrics,
)

LABELS = {"model_name": "tiny", "engine": "0"}


def exported(m: CoordinatorMetrics) -> dict[str, dict]:
    """Each family the registry exports: its type and its samples as {(name, labels): value}."""
    text = generate_latest(m.registry).decode()
    return {f.name: {"type": f.type, "samples": {
        (s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}}
        for f in text_string_to_metric_families(text)}


def sample(families: dict, family: str, name: str | None = None, **labels) -> float:
    return families[family]["samples"][(name or family, tuple(sorted(labels.items())))]


def test_vllm_names_are_exported_once_the_model_is_known():
    m = CoordinatorMetrics()
    assert not any(name.startswith("vllm:") for name in exported(m))
    m.serving("tiny")
    assert {name for name in exported(m) if name.startswith("vllm:")} == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:request_success", "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"}


def test_vllm_gauges_and_counters_are_sidings_figures():
    m = CoordinatorMetrics()
    m.serving("tiny")
    m.kv_pages_total.set(12)
    m.kv_pages_used.set(3)
    m.requests_running.set(4)
    m.requests_waiting.set(2)
    m.requests_parked.set(1)
    m.preemptions.labels(action="park").inc(5)
    m.preemptions.labels(action="recompute").inc(2)
    m.prompt_tokens.inc(40)
    m.generation_tokens.inc(96)
    m.requests.labels(finish_reason="length").inc(6)
    m.requests.labels(finish_reason="stop").inc(1)
    f = exported(m)
    assert f["vllm:kv_cache_usage_perc"]["type"] == "gauge"
    assert sample(f, "vllm:kv_cache_usage_perc", **LABELS) == 3 / 12
    assert sample(f, "vllm:num_requests_running", **LABELS) == 4
    assert sample(f, "vllm:num_requests_waiting", **LABELS) == 2 + 1  # parked ones wait too
    assert f["vllm:num_preemptions"]["type"] == "counter"
    assert sample(f, "vllm:num_preemptions", "vllm:num_preemptions_total", **LABELS) == 7
    assert sample(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **LABELS) == 40
    assert sample(f, "vllm:generation_tokens", "vllm:generation_tokens_total", **LABELS) == 96
    success = {dict(labels)["finished_reason"]: v
               for (_, labels), v in f["vllm:request_success"]["samples"].items()}
    assert success == {"stop": 1, "length": 6, "abort": 0}


def test_an_empty_pool_is_no_division_by_zero():
    m = CoordinatorMetrics()
    m.serving("tiny")
    assert sample(exported(m), "vllm:kv_cache_usage_perc", **LABELS) == 0


def test_one_observation_feeds_both_histograms_each_at_its_own_bounds():
    m = CoordinatorMetrics()
    m.serving("tiny")
    rng = random.Random(0)
    ttfts = [rng.choice(VLLM_TTFT_BUCKETS + LATENCY_BUCKETS) * rng.choice((0.5, 1, 1.5))
             for _ in range(500)]
    for t in ttfts:
        m.ttft.observe(t)
    gaps = {0.003: 7, 0.3: 2, 0.0375: 11, 120.0: 1}
    for gap, count in gaps.items():
        m.itl.observe(gap, count)
    f = exported(m)
    for family, bounds, values in [
        ("siding_time_to_first_token_seconds", LATENCY_BUCKETS, ttfts),
        ("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS, ttfts),
    ]:
        labels = LABELS if family.startswith("vllm:") else {}
        buckets = {dict(k)["le"]: v for (name, k), v in f[family]["samples"].items()
                   if name.endswith("_bucket")}
        assert list(buckets) == [*map(_le, bounds), "+Inf"], family
        assert buckets == {_le(b): sum(v <= b for v in values) for b in bounds} | \
            {"+Inf": len(values)}, family
        assert sample(f, family, family + "_count", **labels) == len(values)
        assert sample(f, family, family + "_sum", **labels) == sum(values)
    for family in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert sample(f, family, family + "_count", **LABELS) == sum(gaps.values()) == \
            sample(f, "siding_inter_token_latency_seconds",
                   "siding_inter_token_latency_seconds_count")
        assert sample(f, family, family + "_bucket", le=_le(VLLM_ITL_BUCKETS[0]), **LABELS) == 7
        assert sample(f, family, family + "_bucket", le="0.05", **LABELS) == 18


def test_status_figures_are_unchanged_by_the_vllm_names():
    m = CoordinatorMetrics()
    m.generation_tokens.inc(5)
    before = m.figures()
    m.serving("tiny")
    assert m.figures() == before


def _le(bound: float) -> str:
    return str(float(bound))
