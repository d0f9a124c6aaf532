"""`benchmarks.driver_calls` on the CPU: its arguments, its table, and a clear refusal to run
without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import driver_calls


def ns(median: float, minimum: float) -> dict[str, float]:
    return {"median": median, "min": minimum}


def record() -> dict:
    per_op = {"siding": ns(5200.4, 5010.0), "cupy": None, "cuda-python": ns(4890.6, 4700.2),
              "torch": ns(9000.0, 8800.0)}
    return {
        "machine": "NVIDIA H200",
        "calls_per_round": 20000,
        "rounds": 5,
        "ns_per_call": {op: dict(per_op) for op in driver_calls.OPS},
        "correct": {"siding": True, "cupy": None, "cuda-python": False, "torch": True},
        "missing": {"cupy": "ModuleNotFoundError: No module named 'cupy'"},
        "errors": {},
    }


def test_table_has_a_row_an_op_and_says_missing_and_failed_backends():
    lines = driver_calls.format_results(record()).splitlines()
    assert lines[0] == ("host ns per call, median of 5 rounds of 20000 (min round); NVIDIA H200")
    assert lines[1].split() == ["op", "siding", "cupy", "cuda-python", "torch"]
    assert lines[2].split() == ["copy_h2d", "5200", "(5010)", "missing", "4891", "(4700)",
                                "9000", "(8800)"]
    assert [line.split()[0] for line in lines[2:7]] == list(driver_calls.OPS)
    assert lines[7].split() == ["correct", "yes", "-", "NO", "yes"]
    assert lines[8] == "cupy: ModuleNotFoundError: No module named 'cupy'"
    assert len(lines) == 9


def test_a_backend_that_failed_setup_shows_as_error_with_its_reason():
    r = record()
    r["missing"] = {}
    r["errors"] = {"cupy": "CUDARuntimeError: cudaErrorInvalidResourceHandle"}
    lines = driver_calls.format_results(r).splitlines()
    assert lines[2].split()[3] == "error"
    assert lines[-1] == "cupy: CUDARuntimeError: cudaErrorInvalidResourceHandle"


def test_arguments_default_to_the_issue_protocol_and_reject_zero():
    args = driver_calls.parse_args(["--out", "r.json"])
    assert (args.out, args.calls, args.rounds) == (Path("r.json"), 20000, 5)
    assert driver_calls.parse_args(["--out", "r.json", "--calls", "300"]).calls == 300
    with pytest.raises(SystemExit):
        driver_calls.parse_args(["--out", "r.json", "--rounds", "0"])
    with pytest.raises(SystemExit):
        driver_calls.parse_args([])  # --out is required


def test_without_cuda_it_exits_nonzero_with_a_clear_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_:
        driver_calls.main(["--out", str(out)])
    assert exit_.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not out.exists()


def test_timed_rounds_make_every_call_and_sync_after_each_chunk():
    calls, syncs = [], []
    n = 2 * driver_calls.CHUNK + 3
    per_pair = driver_calls.time_round((lambda: calls.append("f"), lambda: calls.append("g")),
                                       n, lambda: syncs.append(len(calls)))
    assert calls == ["f", "g"] * n
    chunk = 2 * driver_calls.CHUNK
    assert syncs == [chunk, 2 * chunk, 2 * n]
    assert per_pair > 0
