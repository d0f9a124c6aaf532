"""A real Prometheus scrapes a running two-worker cluster, and reads back what a workload did.

The cluster writes its own scrape config (`--write-prometheus-config`); the test only shortens
the intervals and adds ops/alerts.yml. The pool is small and `--preempt-every 2` parks and
restores every running sequence every two decode steps, so the preemption series move too; the
KV lives in host memory (`--kv host`), so the staging ring's transfer series move as well.

A third job scrapes `/metrics` on the OpenAI API's port, as a vLLM user's Prometheus does, keeping
vLLM's names only: they carry siding's figures (`coordinator/metrics.py`, `VllmView`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from coordinator.prometheus_config import free_metrics_port, worker_ports
from protocol import Client

OPS = Path(__file__).resolve().parents[2] / "ops"
PROMPTS = [[7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40, 41],
           [50, 51, 52, 53], [60, 61, 62, 63, 64, 65]]
MAX_TOKENS = 16
API_KEY = "prometheus-test-key"


@pytest.fixture(scope="module")
def cluster(launch, tmp_path_factory):
    port = free_metrics_port(2)
    written = tmp_path_factory.mktemp("prometheus") / "written.yml"
    key = written.parent / "api-key"
    key.write_text(API_KEY)
    c = launch("--model", "synthetic:tiny", "--workers", "2", "--page-size", "4",
               "--kv-pages", "12", "--preempt-every", "2", "--kv", "host",
               "--metrics-port", str(port), "--http", "127.0.0.1:0", "--api-key-file", str(key),
               "--write-prometheus-config", str(written))
    return SimpleNamespace(endpoint=c.endpoint, metrics_port=port, prometheus_config=written,
                           http=c.http)


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    """A Prometheus server scraping `cluster` every second; yields its query URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: `make test` installs it "
                    "(apt-get install -y prometheus)")
    home = tmp_path_factory.mktemp("prometheus-data")
    config = yaml.safe_load(cluster.prometheus_config.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(OPS / "alerts.yml")]
    config["scrape_configs"].append({
        "job_name": "vllm-api", "static_configs": [{"targets": [urllib.parse.urlsplit(
            cluster.http).netloc]}],
        "metric_relabel_configs": [{"source_labels": ["__name__"], "regex": "vllm:.*",
                                    "action": "keep"}]})
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = free_metrics_port(0)
    log = (home / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home}",
         f"--web.listen-address=127.0.0.1:{web}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{web}"
    try:
        wait_for(lambda: _get(f"{url}/-/ready") is not None, 60, "prometheus to start")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def workload(cluster, prometheus):
    """Concurrent requests, more than the pool holds at once; returns their results."""
    wait_for(lambda: len(query(prometheus, "up == 1")) == 4, 30, "four targets up")
    results, errors = [None] * len(PROMPTS), []

    def run(i: int) -> None:
        try:
            with Client(cluster.endpoint, timeout=600) as c:
                results[i] = c.generate(prompt_token_ids=PROMPTS[i], max_tokens=MAX_TOKENS,
                                        ignore_eos=True)
        except Exception as e:  # asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert errors == []
    generated = len(PROMPTS) * MAX_TOKENS
    wait_for(lambda: value(prometheus, "siding_generation_tokens_total") == generated
             and value(prometheus, "siding_requests_running") == 0
             and value(prometheus, "siding_kv_pages_used") == 0, 30,
             "the workload's figures to be scraped")
    done = time.time()  # every step has run: the workers' next scrapes are final too
    wait_for(lambda: value(prometheus, "min(timestamp(siding_forward_seconds_count))") > done,
             30, "the workers' figures to be scraped")
    return results


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read()
    except OSError:
        return None
    return json.loads(body) if body.startswith(b"{") else {}


def query(url: str, expr: str) -> list[tuple[dict, float]]:
    """An instant query: (labels, value) per series."""
    reply = _get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert reply is not None and reply["status"] == "success", (expr, reply)
    return [(r["metric"], float(r["value"][1])) for r in reply["data"]["result"]]


def value(url: str, expr: str) -> float | None:
    """The value of a query that yields one series (None when it yields none)."""
    series = query(url, expr)
    assert len(series) <= 1, (expr, series)
    return series[0][1] if series else None


def by_worker(url: str, expr: str) -> dict[str, float]:
    return {labels["worker"]: v for labels, v in query(url, expr)}


def wait_for(ok, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def test_the_written_config_scrapes_the_coordinator_and_every_worker(cluster, prometheus):
    p = cluster.metrics_port
    jobs = {t["job_name"]: t for t in yaml.safe_load(
        cluster.prometheus_config.read_text())["scrape_configs"]}
    assert jobs["siding-coordinator"]["static_configs"][0]["targets"] == [f"127.0.0.1:{p}"]
    assert jobs["siding-workers"]["static_configs"][0]["targets"] == \
        [f"127.0.0.1:{q}" for q in worker_ports(p, 2)]
    wait_for(lambda: len(query(prometheus, "up == 1")) == 4, 30,
             "three targets up and the HTTP API's")
    assert {labels["job"] for labels, _ in query(prometheus, "up")} == \
        {"siding-coordinator", "siding-workers", "vllm-api"}


def test_counters_count_the_workload(prometheus, workload):
    assert all(r.finish_reason == "length" for r in workload)
    assert value(prometheus, "siding_generation_tokens_total") == len(PROMPTS) * MAX_TOKENS
    assert value(prometheus, "siding_prompt_tokens_total") == sum(map(len, PROMPTS))
    assert value(prometheus, 'siding_requests_total{finish_reason="length"}') == len(PROMPTS)
    assert value(prometheus, 'sum(siding_requests_total{finish_reason!="length"})') == 0
    assert value(prometheus, "sum(siding_request_errors_total)") == 0
    assert value(prometheus, "siding_time_to_first_token_seconds_count") == len(PROMPTS)
    assert value(prometheus, "siding_e2e_request_latency_seconds_count") == len(PROMPTS)
    assert value(prometheus, "siding_inter_token_latency_seconds_count") == \
        len(PROMPTS) * (MAX_TOKENS - 1)
    steps = value(prometheus, "siding_step_seconds_count")
    assert steps >= MAX_TOKENS
    assert value(prometheus, "sum(siding_preemptions_total)") > 0
    forward = by_worker(prometheus, "siding_forward_seconds_count")
    assert set(forward) == {"0", "1"} and all(n >= MAX_TOKENS for n in forward.values())
    assert all(s > 0 for s in by_worker(prometheus, "siding_forward_seconds_sum").values())


def test_gauges_return_to_idle_once_drained(prometheus, workload):
    for gauge in ("siding_requests_running", "siding_requests_waiting",
                  "siding_requests_parked", "siding_kv_pages_used"):
        assert value(prometheus, gauge) == 0, gauge
    assert value(prometheus, "siding_kv_pages_total") == 12
    assert value(prometheus, "siding_workers_up") == 2


def test_worker_gauges_describe_the_configuration(prometheus, workload):
    assert by_worker(prometheus, "siding_exact_mode") == {"0": 0, "1": 0}
    assert by_worker(prometheus, "siding_pipeline_depth") == {"0": 1, "1": 1}
    # depth + 2 slots, capped at the 2 layers each worker holds
    assert by_worker(prometheus, "siding_ring_slots") == {"0": 2, "1": 2}


def test_host_kv_transfers_are_counted_per_worker(prometheus, workload):
    for path in ("ahead", "writeback"):
        moved = by_worker(prometheus, f'siding_transfer_bytes_total{{path="{path}"}}')
        copies = by_worker(prometheus, f'siding_transfer_copies_total{{path="{path}"}}')
        assert set(moved) == {"0", "1"} and all(b > 0 for b in moved.values()), path
        assert all(copies[w] > 0 for w in moved), path
    assert {labels["device"] for labels, _ in query(prometheus, "siding_exact_mode")} == {"cpu"}


def test_alert_rules_evaluate_cleanly_and_none_fires(prometheus, workload):
    def evaluated() -> list[dict]:
        groups = _get(f"{prometheus}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if all(r["lastEvaluation"] > "2000" for r in rules) else []

    wait_for(evaluated, 30, "the alert rules to be evaluated")
    rules = evaluated()
    assert len(rules) == 7
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    assert [r["name"] for r in rules if r["state"] == "firing"] == []


def test_every_dashboard_query_evaluates(prometheus, workload):
    dash = json.loads((OPS / "grafana" / "siding.json").read_text())
    exprs = [t["expr"].replace("$worker", ".*")
             for p in dash["panels"] for t in p.get("targets", [])]
    answered = [expr for expr in exprs if query(prometheus, expr)]
    assert len(exprs) > 30
    for expr in ("sum(rate(siding_generation_tokens_total[1m]))",
                 "sum by (le, worker) (rate(siding_forward_seconds_bucket{worker=~\".*\"}[5m]))"):
        assert any(expr in a for a in answered), expr


def test_status_shows_the_figures_prometheus_has(cluster, prometheus, workload):
    out = subprocess.run([sys.executable, "-m", "coordinator", "status", "--json",
                          "--endpoint", cluster.endpoint], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    s = json.loads(out)
    assert s["tokens"]["generated"] == value(prometheus, "siding_generation_tokens_total")
    assert s["tokens"]["prompt"] == value(prometheus, "siding_prompt_tokens_total")
    assert s["finished"]["length"] == len(PROMPTS)
    assert sum(s["preemptions"].values()) == value(prometheus, "sum(siding_preemptions_total)")
    assert s["workers_up"] == 2 and s["requests"]["running"] == 0
    assert s["workers"][1]["forward_seconds_mean"] > 0
    table = subprocess.run([sys.executable, "-m", "coordinator", "status",
                            "--endpoint", cluster.endpoint], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    assert f"generated {len(PROMPTS) * MAX_TOKENS}" in table
    assert f"finished   length {len(PROMPTS)}" in table
    assert "workers up 2 of 2" in table


def api(expr: str) -> str:
    """`expr`, a vLLM name, as scraped from the HTTP API's port."""
    return expr.replace("}", ',job="vllm-api"}') if "}" in expr else expr + '{job="vllm-api"}'


def test_the_http_ports_vllm_names_carry_sidings_figures(cluster, prometheus, workload):
    generated = len(PROMPTS) * MAX_TOKENS
    wait_for(lambda: value(prometheus, api("vllm:generation_tokens_total")) == generated
             and value(prometheus, api("vllm:e2e_request_latency_seconds_count")) == len(PROMPTS),
             30, "the HTTP port's figures to be scraped")
    # after len(PROMPTS) requests, siding's count and vLLM's are the same observations
    for siding, vllm in [
        ("siding_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("siding_time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
        ("siding_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
        ("siding_inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
        ("siding_e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
        ("siding_request_queue_seconds_count", "vllm:request_queue_time_seconds_count"),
        ("siding_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("siding_generation_tokens_total", "vllm:generation_tokens_total"),
        ("sum(siding_preemptions_total)", "vllm:num_preemptions_total"),
        ('siding_requests_total{finish_reason="length"}',
         'vllm:request_success_total{finished_reason="length"}'),
        ("siding_requests_running", "vllm:num_requests_running"),
        ("siding_requests_waiting + siding_requests_parked", "vllm:num_requests_waiting"),
        ("siding_kv_pages_used / siding_kv_pages_total", "vllm:kv_cache_usage_perc"),
    ]:
        assert value(prometheus, api(vllm)) == value(prometheus, siding), vllm
    assert value(prometheus, api("vllm:time_to_first_token_seconds_count")) == len(PROMPTS)
    assert value(prometheus, api('vllm:time_to_first_token_seconds_bucket{le="+Inf"}')) == \
        len(PROMPTS)
    assert value(prometheus, api("vllm:num_preemptions_total")) > 0
    model = json.loads(urllib.request.urlopen(urllib.request.Request(
        cluster.http + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}),
        timeout=10).read())["data"][0]["id"]
    labels = {(s["model_name"], s["engine"])
              for s, _ in query(prometheus, api("vllm:prompt_tokens_total"))}
    assert labels == {(model, "0")}


def test_kv_cache_usage_is_pages_used_over_total_at_every_scrape(prometheus, workload):
    """Both from each scrape of the coordinator's port, over the whole workload."""
    usage = 'vllm:kv_cache_usage_perc{job="siding-coordinator"}'
    pages = "siding_kv_pages_used / siding_kv_pages_total"
    assert value(prometheus, f"max_over_time(abs({usage} - on(instance) ({pages}))[10m:1s])") == 0
    assert value(prometheus, f"max_over_time({usage}[10m])") == \
        value(prometheus, "max_over_time(siding_kv_pages_used[10m])") / 12


def test_metrics_on_the_http_port_need_no_api_key(cluster):
    with urllib.request.urlopen(cluster.http + "/metrics", timeout=10) as r:
        content_type, text = r.headers["Content-Type"], r.read().decode()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
                 "siding_requests_running"):
        assert f"\n{name}{{" in text or f"\n{name} " in text, name
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(cluster.http + "/v1/models", timeout=10)
    assert refused.value.code == 401
