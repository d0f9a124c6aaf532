"""`siding bench serve`: the load it generates, the window's accounting, the CPU it reads from
/proc, and one small run on a real cluster whose record holds what the report prints."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import client_procs, proc_cpu, serve, serve_ceiling, serve_load
from worker import build


def test_poisson_arrivals_repeat_with_the_seed_and_average_the_rate():
    times = serve_load.poisson_arrivals(50.0, 100.0, random.Random(7))
    assert times == serve_load.poisson_arrivals(50.0, 100.0, random.Random(7))
    assert times != serve_load.poisson_arrivals(50.0, 100.0, random.Random(8))
    assert times == sorted(times) and 0 < times[0] and times[-1] < 100.0
    assert abs(len(times) - 5000) < 300  # 4 standard deviations of a Poisson count of 5000


def test_requests_are_fixed_or_uniform_in_half_to_three_halves_with_ids_from_100():
    spec = {"prompt_len": 20, "output_len": 8, "len_dist": "fixed", "vocab_size": 130}
    ids, out = serve_load.draw_request(random.Random(0), spec)
    assert (len(ids), out) == (20, 8) and all(100 <= i < 130 for i in ids)
    rng = random.Random(0)
    drawn = [serve_load.draw_request(rng, spec | {"len_dist": "uniform"}) for _ in range(400)]
    assert {len(ids) for ids, _ in drawn} == set(range(10, 31))
    assert {out for _, out in drawn} == set(range(4, 13))


def test_proc_cpu_seconds_of_this_process_match_process_time_and_the_machine_counts_them():
    before, machine = proc_cpu.cpu_seconds(os.getpid()), proc_cpu.machine_busy()
    clock = time.process_time()
    while time.process_time() - clock < 0.3:
        pass
    used = proc_cpu.cpu_seconds(os.getpid()) - before
    assert used == pytest.approx(time.process_time() - clock, abs=0.05)
    assert proc_cpu.machine_busy() - machine > used - 0.05


def test_cluster_processes_name_workers_by_rank_and_frontends_below_the_core():
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    children = [subprocess.Popen([*sleep, "-m", "worker", "--rank", "3"]),
                subprocess.Popen([*sleep, "-m", "coordinator.frontend", "--index", "1"]),
                subprocess.Popen(sleep)]
    try:
        names = proc_cpu.cluster_processes(os.getpid())
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert names[os.getpid()] == "core"
    assert [names[c.pid] for c in children] == ["worker 3", "frontend 1",
                                                f"other {children[2].pid}"]
    assert proc_cpu.cpu_seconds(children[0].pid) is None  # gone


def test_cpu_per_token_counts_a_new_process_whole_and_a_gone_one_as_unknown():
    start = {1: ("core", 1.0), 2: ("worker 0", 5.0), 3: ("other 3", 2.0)}
    end = {1: ("core", 1.5), 2: ("worker 0", 7.0), 3: ("other 3", None),
           4: ("frontend 0", 0.25), 5: ("bench client 0", 0.75)}
    cpu = proc_cpu.cpu_use(start, end, tokens=1000, window=2.0)
    assert [(c["name"], c["cpu_s"], c["us_per_token"], c["cores"]) for c in cpu] == [
        ("core", 0.5, 500.0, 0.25), ("worker 0", 2.0, 2000.0, 1.0), ("other 3", None, None, None),
        ("frontend 0", 0.25, 250.0, 0.125), ("bench client 0", 0.75, 750.0, 0.375)]
    assert proc_cpu.cpu_by_kind(cpu, 1000) == {
        "core_us_per_token": 500.0, "frontend_us_per_token": 250.0,
        "worker_us_per_token": 2000.0, "other_us_per_token": None,
        "non_worker_us_per_token": None}
    assert proc_cpu.cpu_by_kind(cpu[:2], 1000)["non_worker_us_per_token"] == 500.0
    assert proc_cpu.cpu_by_kind(cpu[:2], 1000)["frontend_us_per_token"] is None


def test_window_counts_its_tokens_and_times_the_requests_sent_in_it():
    def rec(sent, chunks, end, error=None):
        return {"client": 0, "sent": sent, "chunks": chunks, "end": end, "error": error,
                "prompt_len": 4, "output_len": sum(n for _, n in chunks)}

    records = [
        rec(9.0, [[9.5, 1], [10.5, 1], [11.0, 2]], 11.0),  # sent in the warm-up
        rec(12.0, [[12.5, 1], [13.0, 1], [14.0, 1]], 14.0),
        rec(19.0, [[19.5, 1], [21.0, 1]], 21.0),  # its second token comes after the window
        rec(15.0, [], 15.125, error="overloaded"),
        rec(19.5, [[20.5, 1]], None),  # cut off
    ]
    p = serve.summarise(records, 10.0, 20.0)
    assert (p["output_tokens"], p["output_tps"]) == (7, 0.7)
    assert (p["requests_ended"], p["requests_per_s"]) == (2, 0.2)
    assert p["mean_in_flight"] == pytest.approx((1 + 2 + 1 + 0.125 + 0.5) / 10)
    assert p["ttft_s"]["p50"] == 0.5 and p["e2e_s"] == {"p50": 2.0, "p90": 2.0, "p99": 2.0}
    assert p["itl_s"] == {"p50": 1.0, "p90": 1.5, "p99": 1.5}  # gaps 0.5, 1.0, 1.5: nearest rank
    assert (p["errors"], p["cut_off"]) == (1, 1)
    assert [r["tokens"] for r in p["requests"]] == [3, 2, 0, 1]


@pytest.mark.parametrize("per_socket,sockets", [(1, 5), (2, 3), (8, 1)])
def test_streams_share_sockets_in_groups_spread_over_the_endpoints(per_socket, sockets):
    endpoints = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    clients = serve_load.load_clients("zmq", endpoints, [3, 5, 7, 9, 11], per_socket)
    try:
        distinct = list({id(c): c for c in clients.values()}.values())
        assert len(distinct) == sockets
        assert (clients[5] is clients[3]) == (per_socket > 1)
        assert [c.client.endpoint for c in distinct] == [endpoints[i % 2] for i in range(sockets)]
    finally:
        for c in clients.values():
            c.client._socket.close(linger=0)


@pytest.mark.parametrize("streams,cluster,cores,procs", [
    (1, 3, 16, 1), (8, 3, 16, 1), (9, 3, 16, 2), (32, 3, 16, 4), (128, 3, 16, 13),
    (128, 6, 128, 16), (32, 3, 2, 1), (64, 3, 4, 1), (32, 3, 6, 3)])
def test_auto_client_procs_take_8_streams_each_on_the_cores_the_cluster_leaves(
        streams, cluster, cores, procs):
    assert client_procs.auto_client_procs(streams, cluster, cores) == procs


def test_client_procs_are_auto_by_default_or_a_positive_count():
    assert serve.parse_args([]).client_procs == "auto"
    assert serve.parse_args(["--client-procs", "3"]).client_procs == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            serve.parse_args(["--client-procs", bad])


def clients_cpu(*cores: float | None) -> list[dict]:
    return [{"name": "core", "cores": 1.0}, {"name": "worker 0", "cores": 1.0},
            *({"name": f"bench client {k}", "cores": c} for k, c in enumerate(cores))]


def test_a_point_is_client_limited_when_a_client_process_passes_nine_tenths_of_a_core():
    assert client_procs.client_limit(clients_cpu(0.5, 0.9), 2, 32) is None
    assert client_procs.client_limit(clients_cpu(None), 1, 32) is None  # gone: unknown
    why = client_procs.client_limit(clients_cpu(0.4, 0.97), 2, 32)
    assert why.startswith("a client process kept 0.97 cores busy (2 for 32 streams)")
    assert why.endswith("rerun with --client-procs 4")
    assert client_procs.client_limit(clients_cpu(0.95), 1, 3).endswith("--client-procs 2")
    assert "each stream has a process already" in client_procs.client_limit(
        clients_cpu(0.95, 0.2), 2, 2)


def test_a_closed_loop_run_streams_every_token_and_charges_the_core_cpu(tmp_path, capsys,
                                                                        monkeypatch):
    """Through both APIs on one cluster: siding's client and the OpenAI API. With any client
    CPU, none included, counted as saturation, every point carries the verdict and the output
    says what to do. Each client makes 3 requests after the warm-up, however long they take (a
    3-second window saw none finish on a machine busy with other work)."""
    monkeypatch.setattr(client_procs, "SATURATED", -1.0)
    serve.main(["--model", "synthetic:tiny", "--concurrency", "2", "--requests-per-client", "3",
                "--warmup", "1", "--output-len", "8", "--prompt-len", "16", "--api", "zmq,http",
                "--inprocess-steps", "4", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("serve-*.json")
    assert (tmp_path / path.name.replace(".json", ".png")).is_file()
    record = json.loads(path.read_text())
    assert record["command"].startswith("siding bench serve --model synthetic:tiny")
    assert record["machine"]["cpu_count"] >= 1 and record["config"]["concurrency"] == [2]
    assert [(p["arm"], p["api"]) for p in record["points"]] == [("siding zmq", "zmq"),
                                                                 ("siding http", "http")]
    for point in record["points"]:
        assert point["concurrency"] == 2 and point["output_tps"] > 0
        assert point["client_procs"] == 1 and point["client_limited"] is True
        assert point["client_limited_why"].endswith("rerun with --client-procs 2")
        assert point["requests"] and point["errors"] == point["cut_off"] == 0
        assert all(r["tokens"] == r["output_len"] == 8 for r in point["requests"])
        assert {r["client"] for r in point["requests"]} == {0, 1}
        assert point["core_us_per_token"] > 0 and point["worker_us_per_token"] > 0
        # the worker's step time over the window: a fraction, give or take a step the scrapes cut
        assert 0 < point["step_busy"] < 2
        assert point["ttft_s"]["p50"] <= point["e2e_s"]["p50"]
        assert point["inprocess"]["batch"] == 2 and point["inprocess"]["tps"] > 0
        assert point["of_inprocess"] == pytest.approx(
            point["output_tps"] / point["inprocess"]["tps"])
        work = point["inprocess_work"]  # 2 streams of 8 tokens: a prompt every fourth step
        assert work["batch"] == 2 and work["prompts_per_step"] == 0.25 and work["tps"] > 0
        assert point["of_inprocess_work"] == pytest.approx(point["output_tps"] / work["tps"])
    out = capsys.readouterr().out
    assert "non-worker us/tok" in out and "1 limited" in out
    assert "warning: siding http, concurrency 2: a client process kept" in out


def test_the_same_work_ceiling_mixes_the_loops_prompts_into_its_steps(monkeypatch):
    """3 streams of output 2: 1.5 prompts a step, each in a decode row's place and forgotten by
    the next step; every step samples one token a stream."""
    plans = []

    class Recording(serve_ceiling.ModelRunner):
        def apply(self, plan):
            plans.append(plan)
            return super().apply(plan)

    monkeypatch.setattr(build, "ModelRunner", Recording)
    stage = build.load_stage("synthetic:tiny", torch.float32, torch.device("cpu"))
    c = serve_ceiling.inprocess_steps(stage, 3, 20, 1.5, 2, torch.device("cpu"), False, "test")
    assert c["tps"] > 0 and len(plans) == serve_ceiling.INPROCESS_WARMUP + 3 * 2
    prompts = [[s for s in p.seqs if s.n > 1] for p in plans]
    assert [len(x) for x in prompts] == [1, 2, 1, 2, 1, 2, 1, 2, 1, 2]
    for k, plan in enumerate(plans):
        assert len(plan.seqs) == 3 and all(s.sample for s in plan.seqs)
        assert all(s.n == 20 and s.start == 0 for s in prompts[k])
        assert all(s.n == 1 and s.start == 20 + k for s in plan.seqs if s.n == 1)
        assert plan.free == ([s.id for s in prompts[k - 1]] if k else [])
        assert len(plan.token_ids) == sum(s.n for s in plan.seqs)


def test_the_arms_take_turns_going_first_point_by_point():
    runs = [("siding", "zmq"), ("siding", "http"), ("baseline", "zmq")]
    order = serve.run_order([32, 128, 256], runs)
    assert [x for x, _ in order] == [32] * 3 + [128] * 3 + [256] * 3
    assert [run for _, run in order] == runs + runs[::-1] + runs
    assert serve.run_order([16], runs[:1]) == [(16, runs[0])]
