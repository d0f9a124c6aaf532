"""`siding bench prefill` on the CPU: both arms prefill the same prompts to the same first tokens,
and the record holds what the report prints."""

from __future__ import annotations

import json

import pytest

from benchmarks import prefill
from worker.loaders.synthetic import SyntheticSource


def test_the_bench_times_both_arms_to_the_same_first_tokens(tmp_path, capsys):
    prefill.main(["--model", "synthetic:tiny", "--device", "cpu", "--shapes", "3x40,1x70",
                  "--repeats", "2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("prefill-*.json")
    record = json.loads(path.read_text())
    assert [(p["batch"], p["length"]) for p in record["points"]] == [(3, 40), (1, 70)]
    for p in record["points"]:
        assert p["first_tokens_agree"] == 1.0
        for arm in ("siding", "hf"):
            assert p[arm]["seconds"]["n"] == 2 and p[arm]["seconds"]["median"] > 0
            assert 0 < p[arm]["of_matmul_peak"]
    assert record["points"][0]["flops"] == prefill.prefill_flops(
        SyntheticSource("tiny").args, 3, 40)
    out = capsys.readouterr().out
    assert "same first tokens" in out and "3x40" in out


def test_shapes_are_batch_by_length():
    assert prefill.shapes("8x512,1x16384") == [(8, 512), (1, 16384)]
    for bad in ("8", "8x", "0x5", "8x512x2", "a"):
        with pytest.raises(Exception, match="BATCHxLENGTH"):
            prefill.shapes(bad)
