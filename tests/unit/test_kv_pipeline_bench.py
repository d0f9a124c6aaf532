"""`siding bench kv-pipeline` on the CPU: every arm decodes the same tokens, alone or in a batch,
the ring's steps come primed across a new page, the record holds what the report prints, and a
point's memory is counted before it is allocated."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import kv_pipeline
from worker.kv.host_pool import HostKVPool
from worker.loaders import resolve


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
    assert "step p99 ms" in out and "identical tokens in every arm: 1 x 44: True" in out


def test_a_batch_decodes_every_sequence_on_pages_of_its_own_in_every_arm(tmp_path, capsys):
    kv_pipeline.main(["--model", "synthetic:tiny", "--device", "cpu", "--contexts", "44",
                      "--batch", "1,3", "--depths", "1", "--rounds", "1", "--steps", "3",
                      "--ahead", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("kv-pipeline-*.json")
    record = json.loads(path.read_text())
    one, three = record["points"]
    assert (one["batch"], three["batch"]) == (1, 3) and not record["skipped"]
    assert three["window_pages"] == 3 * one["window_pages"] == 9  # 45 positions in pages of 16
    assert three["kv_bytes_per_step"] == 3 * one["kv_bytes_per_step"]
    assert one["identical_tokens"] and three["identical_tokens"]
    ring = three["arms"]["depth 1"]
    assert ring["ring_steps"] == 4 + 1 + 3 and ring["primed_steps"] == 7
    for arm in three["arms"].values():  # a step's B tokens
        assert arm["tokens_per_s"] * arm["step_s"]["median"] == pytest.approx(3)
    assert "identical tokens in every arm: 1 x 44: True, 3 x 44: True" in capsys.readouterr().out


def test_the_memory_a_point_needs_is_what_its_host_pools_take():
    a = kv_pipeline.parse_args(["--model", "synthetic:tiny", "--device", "cpu", "--depths", "1,2",
                                "--ahead", "--steps", "2", "--rounds", "1", "--warmup", "1"])
    source = resolve(a.model)
    stage = source.load_stage(0, source.args.n_layers, torch.float32, "cpu")
    total = kv_pipeline.total_steps(40, a)
    arms = kv_pipeline.build_arms(stage, source.args, 40, total, torch.float32,
                                  torch.device("cpu"), a, batch=5)
    taken = sum(arm.pool.k.nbytes + arm.pool.v.nbytes for arm in arms
                if isinstance(arm.pool, HostKVPool))
    assert kv_pipeline.host_bytes(source.args, 5, 40, a, torch.float32) == taken > 0
    assert [arm.name for arm in arms] == kv_pipeline.arm_names(a)
    assert [len(arm.pages) for arm in arms] == [5] * len(arms)
