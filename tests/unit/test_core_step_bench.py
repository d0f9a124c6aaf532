"""`siding bench core-step`: a small run, this tree beside a baseline checkout (here, this tree
again), whose record holds every round of both arms and whose cached requests ran only their
new rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import core_step


def test_a_small_run_records_both_arms_round_by_round(tmp_path, capsys):
    root = Path(core_step.__file__).resolve().parents[1]
    core_step.main(["--streams", "4,8", "--prompt-len", "20", "--steps", "5", "--prefix", "64",
                    "--question", "8", "--requests", "3", "--rounds", "2",
                    "--baseline", str(root), "--out", str(tmp_path)])
    (path,) = tmp_path.glob("core-step-*.json")
    record = json.loads(path.read_text())
    assert list(tmp_path.glob("core-step-*.png"))
    for arm in ("siding", "baseline"):
        rounds = record["rounds"][arm]
        assert len(rounds) == 2 and all(set(r["decode"]) == {"4", "8"} for r in rounds)
        assert all(r["cached"] > 0 and all(v > 0 for v in r["decode"].values()) for r in rounds)
        assert all(set(r["decode_cold"]) == {"4", "8"} and min(r["decode_cold"].values()) > 0
                   for r in rounds)
        spread = record["results"][arm]["decode_us_per_token"]["8"]
        assert spread["min"] <= spread["median"] <= spread["max"]
    assert "cached request us" in capsys.readouterr().out


def test_a_cached_request_that_runs_more_than_its_new_rows_fails_the_round(monkeypatch):
    monkeypatch.setattr("coordinator.prefix_cache.PrefixCache.take", lambda self, seq, limit: None)
    with pytest.raises(RuntimeError, match="ran 72 rows, not 8"):
        core_step.cached_round(64, 8, 2, 0)
