"""deploy/kubernetes/, rendered as `kubectl apply -k` would (without kubectl, a cluster or the
network), validated against the Kubernetes schemas and checked against siding's own flags.

The renderer knows the kustomization features the manifests use (resources, configMapGenerator
literals, images, replacements from a ConfigMap, namespace) and refuses any other, so a new
feature in kustomization.yaml needs a line here before the checks can pass."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
DOC = ROOT / "docs" / "kubernetes.md"
K8S_VERSION = "1.30"
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images",
                    "configMapGenerator", "replacements"}
POD_IP = "10.1.2.3"
# Secrets the operator creates (docs/kubernetes.md says how): name -> keys.
CURVE_SECRET, API_KEY_SECRET = "siding-curve-keys", "siding-api-key"
API_KEY_KEY = "api-key"
SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")


# ---- rendering ------------------------------------------------------------------------------

def render(literals: dict[str, str] | None = None) -> list[dict]:
    """The objects `kubectl kustomize deploy/kubernetes` gives; `literals` override the
    ConfigMap generator's values, as an edit of kustomization.yaml would."""
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZE_FIELDS
    assert not unknown, f"this test's renderer does not know kustomization fields {unknown}"
    objects = [o for f in k["resources"] for o in yaml.safe_load_all((DEPLOY / f).read_text())
               if o is not None]
    renamed = {}
    for gen in k.get("configMapGenerator", []):
        assert set(gen) == {"name", "literals"}, f"unsupported generator options in {gen}"
        data = dict(line.split("=", 1) for line in gen["literals"])
        data.update({key: v for key, v in (literals or {}).items() if key in data})
        # kustomize appends a hash of the data, so pods roll when it changes; any hash will do.
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]
        renamed[gen["name"]] = f"{gen['name']}-{digest}"
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": gen["name"]}, "data": data})
    for r in k.get("replacements", []):
        src = r["source"]
        assert src["kind"] == "ConfigMap", "the renderer takes replacements from ConfigMaps"
        value = find(objects, "ConfigMap", src["name"])["data"][src["fieldPath"].split(".")[1]]
        for target in r["targets"]:
            obj = find(objects, target["select"]["kind"], target["select"]["name"])
            for path in target["fieldPaths"]:
                *parents, leaf = path.split(".")
                node = obj
                for p in parents:
                    node = node[p]
                # kustomize keeps the target's type: a string "2" lands in replicas as 2.
                node[leaf] = type(node[leaf])(value)
    for o in objects:
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] in renamed:
            o["metadata"]["name"] = renamed[o["metadata"]["name"]]
        for ref in walk_refs(o):
            ref["name"] = renamed.get(ref["name"], ref["name"])
        for c in containers(o):
            for image in k.get("images", []):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
        if "namespace" in k:
            o["metadata"]["namespace"] = k["namespace"]
    return objects


def walk_refs(node):
    """Every ConfigMap reference: env valueFrom, envFrom, volumes."""
    if isinstance(node, dict):
        for key, v in node.items():
            if key in ("configMapKeyRef", "configMapRef", "configMap") and isinstance(v, dict):
                yield v
            yield from walk_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk_refs(v)


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(o: dict) -> dict | None:
    return o.get("spec", {}).get("template", {}).get("spec")


def containers(o: dict) -> list[dict]:
    spec = pod_spec(o)
    return [] if spec is None else spec.get("containers", []) + spec.get("initContainers", [])


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if pod_spec(o) is not None]


def is_crd(o: dict) -> bool:
    return (o["apiVersion"], o["kind"]) == SERVICE_MONITOR


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render()


# ---- what a container runs ------------------------------------------------------------------

FAKE_SIDING = "import json, sys\nprint(json.dumps(sys.argv[1:]))\n"


def run_command(objects: list[dict], container: dict, env: dict[str, str],
                tmp_path: Path) -> list[str]:
    """The argv `siding` gets when the container starts: Kubernetes' $(VAR) expansion, then the
    real shell, with a stand-in `siding` on PATH that prints its arguments."""
    values = dict(env)
    for e in container.get("env", []):
        ref = e.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            key_ref = ref["configMapKeyRef"]
            data = find(objects, "ConfigMap", key_ref["name"])["data"]
            assert key_ref["key"] in data, f"ConfigMap {key_ref['name']} has no {key_ref['key']}"
            values[e["name"]] = data[key_ref["key"]]
        elif "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "status.podIP", ref
            values[e["name"]] = POD_IP
        else:
            values[e["name"]] = e["value"]
    argv = [re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), a)
            for a in container.get("command", []) + container.get("args", [])]
    fake = tmp_path / "siding"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SIDING}")
    fake.chmod(0o755)
    values["PATH"] = f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"
    out = subprocess.run(argv, env=values, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{container['name']} exits {out.returncode}: {out.stderr}"
    return json.loads(out.stdout)


def parse(parser, argv: list[str]):
    """argparse's verdict as an assertion: a flag siding does not have fails the test."""
    try:
        return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{parser.prog} rejects {argv}") from None


def coordinator_args(objects: list[dict], tmp_path: Path):
    from coordinator.cli import build_parser

    c = containers(find(objects, "Deployment", "siding-coordinator"))[0]
    argv = run_command(objects, c, {"HOSTNAME": "siding-coordinator-abc12"}, tmp_path)
    assert argv[0] == "coordinator", argv
    return parse(build_parser(), argv)


def worker_args(objects: list[dict], rank: int, tmp_path: Path):
    from worker.process import build_parser

    c = containers(find(objects, "StatefulSet", "siding-worker"))[0]
    argv = run_command(objects, c, {"HOSTNAME": f"siding-worker-{rank}"}, tmp_path)
    assert argv[0] == "worker", argv
    return parse(build_parser(), argv[1:])


def port_of(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def container_port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"container {container['name']} has no port named {name}"
    return ports[name]


def mount_of(o: dict, container: dict, secret: str) -> tuple[str, dict[str, str]]:
    """Where `secret` is mounted in `container`, and its files there (path -> key)."""
    volumes = {v["name"]: v for v in pod_spec(o)["volumes"]}
    for m in container["volumeMounts"]:
        s = volumes[m["name"]].get("secret", {})
        if s.get("secretName") == secret:
            return m["mountPath"], {i["path"]: i["key"] for i in s["items"]}
    raise AssertionError(f"{container['name']} does not mount Secret {secret}")


def curve_key_files(tmp_path: Path) -> set[str]:
    from protocol.security import generate_keys

    return {p.name for p in generate_keys(tmp_path / "keys").iterdir()}


# ---- checks ---------------------------------------------------------------------------------

def check_schemas(objects: list[dict]) -> None:
    for o in objects:
        if not is_crd(o):
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def check_port_references(objects: list[dict]) -> None:
    """Named ports in probes and Services exist in the containers they point at."""
    for o in workloads(objects):
        for c in containers(o):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                for how in ("tcpSocket", "httpGet"):
                    port = c.get(probe, {}).get(how, {}).get("port")
                    if isinstance(port, str):
                        container_port(c, port)
    for svc in (o for o in objects if o["kind"] == "Service"):
        pods = [w for w in workloads(objects) if selects(svc["spec"]["selector"], w)]
        assert pods, f"Service {svc['metadata']['name']} selects no pods"
        for p in svc["spec"]["ports"]:
            if isinstance(p["targetPort"], str):
                for w in pods:
                    container_port(containers(w)[0], p["targetPort"])


def selects(selector: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


# ---- the tests ------------------------------------------------------------------------------

def test_every_object_is_valid_for_kubernetes(objects):
    check_schemas(objects)
    assert {(o["kind"], o["metadata"]["name"]) for o in objects if not is_crd(o)} >= {
        ("Deployment", "siding-coordinator"), ("StatefulSet", "siding-worker"),
        ("Service", "siding-coordinator"), ("Service", "siding-coordinator-internal"),
        ("Service", "siding-worker")}


def test_schema_validation_needs_no_network(objects, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("kubernetes-validate tried to reach the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    check_schemas(objects)


def test_schema_validation_rejects_a_misspelled_field(objects):
    bad = copy.deepcopy(find(objects, "StatefulSet", "siding-worker"))
    bad["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_services_select_pods_and_name_real_ports(objects):
    check_port_references(objects)
    for o in workloads(objects):
        assert selects(o["spec"]["selector"]["matchLabels"], o), o["metadata"]["name"]


def test_a_misspelled_port_name_fails_the_checks(objects):
    bad = copy.deepcopy(objects)
    containers(find(bad, "Deployment", "siding-coordinator"))[0]["readinessProbe"][
        "tcpSocket"]["port"] = "clinet"
    with pytest.raises(AssertionError, match="no port named clinet"):
        check_port_references(bad)


def test_configmap_keys_referenced_exist(objects, tmp_path):
    for o in workloads(objects):
        for c in containers(o):
            run_command(objects, c, {"HOSTNAME": "siding-worker-0"}, tmp_path)  # asserts keys


def test_secrets_hold_what_siding_keys_writes_and_the_doc_creates_them(objects, tmp_path):
    written = curve_key_files(tmp_path)
    assert written == {"server.key", "server.key_secret", "client.key", "client.key_secret"}
    doc = DOC.read_text()
    assert f"create secret generic {CURVE_SECRET}" in doc
    assert f"create secret generic {API_KEY_SECRET} --from-file={API_KEY_KEY}=" in doc
    known = {CURVE_SECRET: written, API_KEY_SECRET: {API_KEY_KEY}}
    for o in workloads(objects):
        for s in (v["secret"] for v in pod_spec(o)["volumes"] if "secret" in v):
            assert s["secretName"] in known, f"Secret {s['secretName']} is not documented"
            missing = {i["key"] for i in s["items"]} - known[s["secretName"]]
            assert not missing, f"Secret {s['secretName']} has no keys {missing}"


def test_each_side_mounts_the_keys_it_needs(objects, tmp_path):
    coordinator = find(objects, "Deployment", "siding-coordinator")
    _, files = mount_of(coordinator, containers(coordinator)[0], CURVE_SECRET)
    # A CURVE server: its keypair and the client public keys; never the client's secret.
    assert set(files) == {"server.key", "server.key_secret", "client.key"}
    workers = find(objects, "StatefulSet", "siding-worker")
    _, files = mount_of(workers, containers(workers)[0], CURVE_SECRET)
    assert set(files) == curve_key_files(tmp_path)


@pytest.mark.parametrize("exact", ["true", "false"])
@pytest.mark.parametrize("http", ["true", "false"])
def test_coordinator_command_is_a_valid_siding_coordinator(exact, http, tmp_path):
    from coordinator.cli import config_from_args

    objects = render({"SIDING_EXACT": exact, "SIDING_HTTP": http})
    a = coordinator_args(objects, tmp_path)
    deployment = find(objects, "Deployment", "siding-coordinator")
    c = containers(deployment)[0]
    data = find(objects, "ConfigMap", next(walk_refs(c))["name"])["data"]
    assert (a.model, a.kv, a.exact) == (data["SIDING_MODEL"], data["SIDING_KV"], exact == "true")
    assert a.workers == find(objects, "StatefulSet", "siding-worker")["spec"]["replicas"]
    assert port_of(a.listen) == container_port(c, "client")
    assert port_of(a.worker_listen) == container_port(c, "worker")
    assert a.metrics_port == container_port(c, "metrics")
    assert deployment["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"] == str(a.metrics_port)
    assert a.curve_keys == mount_of(deployment, c, CURVE_SECRET)[0]
    if http == "true":
        assert port_of(a.http) == container_port(c, "http")
        where, files = mount_of(deployment, c, API_KEY_SECRET)
        assert a.api_key_file == f"{where}/{next(iter(files))}"
        key = tmp_path / "api-key"
        key.write_text("k8s-test-key\n")
        a.api_key_file = str(key)
    else:
        assert a.http is None and a.api_key_file is None
    config_from_args(a)  # siding's own start-up checks: binds beyond loopback, the HTTP key


def test_coordinator_refuses_a_toggle_that_is_not_true_or_false(tmp_path):
    with pytest.raises(AssertionError, match="SIDING_EXACT must be true or false"):
        coordinator_args(render({"SIDING_EXACT": "yes"}), tmp_path)


def test_extra_args_reach_the_coordinator(tmp_path):
    a = coordinator_args(render({"SIDING_EXTRA_ARGS": "--kv-pages 8192 --dtype float16"}),
                         tmp_path)
    assert (a.kv_pages, a.dtype) == (8192, "float16")


def test_a_misspelled_flag_fails_the_checks(objects, tmp_path):
    bad = copy.deepcopy(objects)
    c = containers(find(bad, "Deployment", "siding-coordinator"))[0]
    c["args"] = [c["args"][0].replace("--worker-listen", "--worker-lisen")]
    with pytest.raises(AssertionError, match="rejects"):
        coordinator_args(bad, tmp_path)


def test_one_edit_sets_the_workers_and_the_replicas(tmp_path):
    objects = render({"SIDING_WORKERS": "3"})
    assert find(objects, "StatefulSet", "siding-worker")["spec"]["replicas"] == 3
    assert coordinator_args(objects, tmp_path).workers == 3


def test_worker_rank_is_the_pod_ordinal_and_it_reaches_the_coordinator(objects, tmp_path):
    workers = find(objects, "StatefulSet", "siding-worker")
    c = containers(workers)[0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    keys_dir = mount_of(workers, c, CURVE_SECRET)[0]
    replicas = workers["spec"]["replicas"]
    coordinator_argv = coordinator_args(objects, tmp_path)
    for rank in range(replicas):
        a = worker_args(objects, rank, tmp_path)
        assert (a.rank, a.device, a.advertise, a.curve_keys) == (
            rank, "cuda:0", POD_IP, keys_dir)
        host, port = a.coordinator.removeprefix("tcp://").rsplit(":", 1)
        svc = find(objects, "Service", host)
        # Workers register before the coordinator is ready, so readiness must not gate them.
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert selects(svc["spec"]["selector"], find(objects, "Deployment",
                                                     "siding-coordinator"))
        target = {p["port"]: p["targetPort"] for p in svc["spec"]["ports"]}[int(port)]
        assert target == "worker" and int(port) == port_of(coordinator_argv.worker_listen)


def test_service_monitor_scrapes_the_coordinator_and_each_worker_on_its_port(objects, tmp_path):
    [sm] = [o for o in objects if is_crd(o)]
    spec = sm["spec"]
    services = [o for o in objects if o["kind"] == "Service"
                and all(o["metadata"]["labels"].get(k) == v
                        for k, v in spec["selector"]["matchLabels"].items())
                and all(e["operator"] == "Exists" and e["key"] in o["metadata"]["labels"]
                        for e in spec["selector"].get("matchExpressions", []))]
    jobs = {s["metadata"]["labels"][spec["jobLabel"]]: s for s in services}
    alert_jobs = set(re.findall(r'job="([^"]+)"', (ROOT / "ops" / "alerts.yml").read_text()))
    assert set(jobs) == alert_jobs == {"siding-coordinator", "siding-workers"}
    ports = {p["name"]: (s, p) for s in services for p in s["spec"]["ports"]}
    for e in spec["endpoints"]:
        assert e["port"] in ports, f"ServiceMonitor endpoint port {e['port']} is in no Service"
    metrics_port = coordinator_args(objects, tmp_path).metrics_port
    coordinator_port = [ports[e["port"]] for e in spec["endpoints"] if "relabelings" not in e]
    assert [(s["metadata"]["name"], p["port"]) for s, p in coordinator_port] == [
        (jobs["siding-coordinator"]["metadata"]["name"], metrics_port)]
    replicas = find(objects, "StatefulSet", "siding-worker")["spec"]["replicas"]
    scraped = {}
    for rank in range(replicas + 8):
        pod = f"siding-worker-{rank}"
        for e in spec["endpoints"]:
            keep = [r for r in e.get("relabelings", []) if r["action"] == "keep"]
            if keep and all(re.fullmatch(r["regex"], pod) for r in keep):
                scraped.setdefault(rank, []).append(ports[e["port"]][1]["targetPort"])
    # Worker i serves on the coordinator's port + 1 + i (what ASSIGN tells it).
    assert {r: scraped.get(r) for r in range(replicas)} == {
        r: [metrics_port + 1 + r] for r in range(replicas)}
    assert all(len(v) == 1 for v in scraped.values())


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_renderer_agrees_with_kubectl_kustomize(objects):
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr

    def normal(objs: list[dict]) -> list[dict]:
        text = json.dumps(objs, sort_keys=True)
        text = re.sub(r'"siding-[0-9a-z]{10}"', '"siding-HASH"', text)  # the ConfigMap's hash
        return sorted(json.loads(text), key=lambda o: (o["kind"], o["metadata"]["name"]))

    assert normal(list(yaml.safe_load_all(out.stdout))) == normal(objects)
