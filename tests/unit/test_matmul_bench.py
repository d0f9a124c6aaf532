"""`siding bench matmul` on the CPU: a real run on a small shape writes its record, and exact
mode's row identity holds there."""

from __future__ import annotations

import json

import pytest

from benchmarks import matmul
from worker.loaders import resolve


def test_step_shapes_are_each_layers_four_products_then_the_head():
    a = resolve("synthetic:tiny").args
    shapes = matmul.step_shapes(a, 2)
    assert [name for name, _, _ in shapes] == ["wqkv", "wo", "w13", "w2"] * 2 + ["head"]
    assert shapes[0] == ("wqkv", a.q_dim + 2 * a.kv_dim, a.dim)
    assert shapes[3] == ("w2", a.dim, a.ffn_dim)
    assert shapes[-1] == ("head", a.vocab_size, a.dim)


def test_a_cpu_run_records_both_arms_at_every_row_count_and_exact_rows_keep_their_bits(
        tmp_path, capsys):
    matmul.main(["--model", "synthetic:tiny", "--rows", "1,5", "--layers", "2", "--repeats", "2",
                 "--out", str(tmp_path)])
    (path,) = tmp_path.glob("matmul-*.json")
    record = json.loads(path.read_text())
    assert [p["rows"] for p in record["points"]] == [1, 5]
    for p in record["points"]:
        assert len(p["default_samples_s"]) == len(p["exact_samples_s"]) == 2
        assert p["exact_s"]["median"] > 0 and p["default_s"]["median"] > 0
    assert record["config"]["layers"] == 2
    assert set(record["row_identity"]["exact"]) == {
        f"{name} {n}x{k}" for name, n, k in record["config"]["shapes"]}
    assert all(record["row_identity"]["exact"].values())
    assert list(tmp_path.glob("matmul-*.png"))
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["rows", "default", "ms", "exact", "ms", "exact", "/",
                                           "default"]


def test_arguments_refuse_negative_counts_and_empty_rows():
    assert matmul.parse_args([]).rows == [1, 4, 32, 128, 512]
    for bad in (["--layers", "-1"], ["--repeats", "-2"], ["--rows", "0"]):
        with pytest.raises(SystemExit):
            matmul.parse_args(bad)
