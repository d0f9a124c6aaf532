"""A process's exposition: over HTTP as Prometheus negotiates it, and to another process over a
Unix socket (the engine core's, for the frontends' `/metrics`), the same bytes either way."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from coordinator.prometheus_config import free_metrics_port
from protocol.metrics_http import encoder, read_exposition, serve_exposition, serve_metrics

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,"
                     "application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # Prometheus 2's


def registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name"], registry=r) \
        .labels(model_name="tiny").inc(7)
    Counter("siding_prompt_tokens", "Prompt tokens", registry=r).inc(7)
    return r


def test_openmetrics_keeps_the_colons_of_vllm_names():
    encode, content_type = encoder(PROMETHEUS_ACCEPT)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    families = {f.name: f for f in text_string_to_metric_families(encode(registry()).decode())}
    assert [(s.name, s.value) for s in families["vllm:prompt_tokens"].samples
            if s.name.endswith("_total")] == [("vllm:prompt_tokens_total", 7)]


def test_a_scrape_without_accept_gets_the_text_format():
    assert encoder("")[1] == "text/plain; version=0.0.4; charset=utf-8"


def test_the_unix_socket_serves_what_the_port_serves(tmp_path):
    r = registry()
    path = str(tmp_path / "metrics")
    serve_exposition(r, path)
    port = free_metrics_port(0)
    serve_metrics(r, port, "127.0.0.1")
    for accept in (PROMETHEUS_ACCEPT, ""):
        content_type, body = asyncio.run(read_exposition(path, accept))
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                         headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert (reply.headers["Content-Type"], reply.read()) == (content_type, body)
