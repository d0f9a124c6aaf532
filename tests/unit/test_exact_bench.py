"""`siding bench exact`: a default and an `--exact` cluster timed round by round, each arm's rate
its new tokens over the time to its batch's last result, and request 0's tokens checked against
its solo run."""

from __future__ import annotations

import json

from benchmarks import exact


def test_both_arms_are_timed_every_round_and_exact_mode_keeps_request_0s_tokens(tmp_path,
                                                                                 capsys):
    exact.main(["--model", "synthetic:tiny", "--device", "cpu", "--concurrency", "1,3",
                "--context", "8", "--tokens", "4", "--rounds", "2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("exact-*.json")
    record = json.loads(path.read_text())
    timed = sorted((s["arm"], s["batch"], s["repeat"]) for s in record["samples"])
    assert timed == sorted((arm, c, r) for arm in exact.ARMS for c in (1, 3) for r in (0, 1))
    for s in record["samples"]:
        assert s["tokens"] == 4 * s["batch"] and s["tps"] == s["tokens"] / s["seconds"] > 0
    for p in record["points"]:
        assert p["exact_over_default"] == p["exact_tps"]["median"] / p["default_tps"]["median"]
        assert p["exact_identical"] is True
    assert len(record["solo_tokens"]["exact"]) == 4
    assert "exact/default" in capsys.readouterr().out
