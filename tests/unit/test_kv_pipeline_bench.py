"""`siding bench kv-pipeline` on the CPU: every arm decodes the same tokens, the ring's steps come
primed across a new page, and the record holds what the report prints."""

from __future__ import annotations

import json

from benchmarks import kv_pipeline


def test_the_bench_runs_every_arm_to_the_same_tokens_and_records_single_steps(tmp_path, capsys):
    """Overlapped arms (`--ahead`) included: their tokens come back a step late; and arms whose
    slots hold up to two layers (`--slot-layers 2`; the default slots of 4 layers leave
    synthetic:tiny's 4 layers a layer a slot)."""
    # 4 warm-up steps, then per round one untimed step and 3 timed ones: positions 44-55, the
    # sequence takes its fourth page (16 positions each) on the fifth step
    kv_pipeline.main(["--model", "synthetic:tiny", "--device", "cpu", "--contexts", "44",
                      "--depths", "1,2", "--slot-layers", "2", "--rounds", "2", "--steps", "3",
                      "--ahead", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("kv-pipeline-*.json")
    (point,) = json.loads(path.read_text())["points"]
    assert point["identical_tokens"]
    arms = point["arms"]
    names = ["device", "ordered", "depth 1", "depth 1 x2", "depth 2", "depth 2 x2"]
    assert list(arms) == names + [f"ahead {name}" for name in names]
    assert point["ahead_ceiling_s"] > 0
    for prefix in ("", "ahead "):
        for name in ("depth 1", "depth 2", "depth 1 x2"):
            ring = arms[prefix + name]
            assert ring["ring_steps"] == 12 and ring["primed_steps"] == 11  # all but the first
        # 4 layers in slots of 2 are 2 groups, both delivered at the start of every step
        assert arms[prefix + "depth 2 x2"]["ring_slots"] == 2
        assert arms[prefix + "depth 2 x2"]["primed_steps"] == 0
        assert arms[prefix + "depth 1"]["slot_layers"] == 1
        assert arms[prefix + "depth 1 x2"]["slot_layers"] == 2
    for arm in arms.values():
        q = arm["step_quantiles_s"]
        assert 0 < q["p50"] <= q["p90"] <= q["p99"]
    out = capsys.readouterr().out
    assert "step p99 ms" in out and "identical tokens in every arm: 44: True" in out
