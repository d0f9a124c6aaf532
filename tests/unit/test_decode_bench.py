"""`siding bench decode --baseline`: a second cluster from another checkout, timed batch by
batch beside this tree's, with the ratio in the record and the table; `--temperature`: every
request drawn, each with a seed of its own; `--client-procs`: a batch's streams dealt over client
processes, every token of every request timed; each cluster's log kept beside the record."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import decode, decode_load, report

ROOT = Path(__file__).resolve().parents[2]


def test_a_baseline_cluster_is_timed_beside_this_trees(tmp_path, capsys, monkeypatch):
    clients = []  # where each client process ran from
    popen = report.subprocess.Popen

    def spy(cmd, *args, **kwargs):
        if "benchmarks.decode_load" in cmd:
            clients.append(kwargs["cwd"])
        return popen(cmd, *args, **kwargs)

    monkeypatch.setattr(report.subprocess, "Popen", spy)
    decode.main(["--model", "synthetic:tiny", "--device", "cpu", "--batch-sizes", "1,2",
                 "--context", "8", "--tokens", "4", "--repeats", "2", "--no-hf",
                 "--baseline", str(ROOT), "--out", str(tmp_path), "--client-procs", "1"])
    # this tree's streams in the bench's process; the baseline's from its checkout (a client
    # speaks its own tree's protocol), one process a batch, warm-up and repeats
    assert clients == [str(ROOT)] * 6
    (path,) = tmp_path.glob("decode-*.json")
    record = json.loads(path.read_text())
    timed = sorted((s["arm"], s["batch"], s["repeat"]) for s in record["samples"])
    assert timed == sorted((arm, b, r) for arm in ("siding", "baseline") for b in (1, 2)
                           for r in (0, 1))
    for p in record["points"]:
        ratio = p["siding"]["decode_tps"]["median"] / p["baseline"]["decode_tps"]["median"]
        assert p["siding_over_baseline"] == ratio > 0 and p["hf"] is None
    out = capsys.readouterr().out
    assert "baseline tok/s" in out and "siding/baseline" in out
    # each cluster's log beside the record: its processes' stderr, the worker's among them
    for arm in ("siding", "baseline"):
        log = path.with_name(f"{path.stem}-{arm}.log").read_text()
        assert "worker 0: cpu pid" in log, log


def test_drawn_decode_sends_each_request_its_sampling_and_a_seed(tmp_path, monkeypatch):
    sent = []
    stream = decode_load.AsyncClient.stream

    def spy(self, prompt=None, **options):
        sent.append(options)
        return stream(self, prompt, **options)

    monkeypatch.setattr(decode_load.AsyncClient, "stream", spy)
    decode.main(["--model", "synthetic:tiny", "--device", "cpu", "--batch-sizes", "2",
                 "--context", "8", "--tokens", "4", "--repeats", "1", "--no-hf",
                 "--temperature", "0.8", "--top-p", "0.9", "--out", str(tmp_path)])
    drawn = {(o["temperature"], o["top_p"], o["seed"]) for o in sent}
    assert drawn == {(0.8, 0.9, 0), (0.8, 0.9, 1)}
    (path,) = tmp_path.glob("decode-*.json")
    assert json.loads(path.read_text())["config"]["temperature"] == 0.8


def test_a_batch_dealt_over_client_processes_times_every_token(tmp_path, monkeypatch):
    started = []
    popen = report.subprocess.Popen

    def spy(cmd, *args, **kwargs):
        if "benchmarks.decode_load" in cmd:
            started.append(cmd)
        return popen(cmd, *args, **kwargs)

    monkeypatch.setattr(report.subprocess, "Popen", spy)
    decode.main(["--model", "synthetic:tiny", "--device", "cpu", "--batch-sizes", "1,3",
                 "--context", "8", "--tokens", "5", "--repeats", "1", "--no-hf",
                 "--client-procs", "2", "--out", str(tmp_path)])
    # batch 3 in two processes (warm-up and the repeat); batch 1 in this one
    assert started == [[decode_load.sys.executable, "-m", "benchmarks.decode_load"]] * 4
    (path,) = tmp_path.glob("decode-*.json")
    samples = {s["batch"]: s for s in json.loads(path.read_text())["samples"]}
    assert samples[3]["total_tokens"] == 15 and samples[1]["total_tokens"] == 5
    for s in samples.values():
        assert 0 < s["ttft"] < s["total_seconds"] and s["decode_tokens"] > 0
