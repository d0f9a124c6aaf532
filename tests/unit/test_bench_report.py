"""Benchmark results: spread statistics, the JSON record, the PNG plot, the printed table."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import decode, serve
from benchmarks.report import (
    Series,
    Spread,
    format_table,
    ratio,
    result_paths,
    write_json,
    write_plot,
)


def test_spread_is_median_min_max_of_samples():
    assert Spread.of([3.0, 1.0, 2.0]) == Spread(median=2.0, min=1.0, max=3.0, n=3)
    assert Spread.of([4.0, 1.0, 2.0, 10.0]) == Spread(median=3.0, min=1.0, max=10.0, n=4)


def test_spread_of_no_samples_is_an_error():
    with pytest.raises(ValueError):
        Spread.of([])


def test_spread_text_scales_every_value():
    assert Spread(0.0125, 0.01, 0.02, 3).text(1e3, 0) == "12 (10-20)"
    assert Spread(41.26, 40.0, 43.04, 3).text() == "41.3 (40.0-43.0)"


def test_ratio_is_of_medians_and_nan_over_zero():
    assert ratio(Spread(30.0, 1.0, 99.0, 3), Spread(10.0, 9.0, 11.0, 3)) == 3.0
    assert math.isnan(ratio(Spread(1.0, 1.0, 1.0, 1), Spread(0.0, 0.0, 0.0, 1)))


def test_json_record_round_trips_with_spreads_as_objects(tmp_path):
    json_path, png_path = result_paths(tmp_path / "out", "decode", "20250101-000000")
    assert (json_path.name, png_path.name) == ("decode-20250101-000000.json",
                                               "decode-20250101-000000.png")
    write_json(json_path, {"points": [{"batch": 8, "tps": Spread(2.0, 1.0, 3.0, 3)}]})
    assert json.loads(json_path.read_text()) == {
        "points": [{"batch": 8, "tps": {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}}]
    }


def test_plot_is_written_as_png(tmp_path):
    path = tmp_path / "plot.png"
    spreads = [Spread(10.0, 9.0, 12.0, 3), Spread(50.0, 40.0, 55.0, 3)]
    write_plot(path, [Series("a", [1, 8], spreads), Series("b", [1, 8], spreads[::-1])],
               title="t", xlabel="batch", ylabel="tokens/s")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_pads_columns_first_left_rest_right():
    assert format_table(["batch", "tok/s"], [[1, "9.5"], [16, "120.0"]]).splitlines() == [
        "batch  tok/s",
        "1        9.5",
        "16     120.0",
    ]


@pytest.mark.parametrize("bench,client", [(decode, "decode_load.py"), (serve, "serve_load.py")])
def test_a_baseline_without_the_bench_client_is_refused_before_any_cluster_starts(
        bench, client, tmp_path, capsys):
    # a baseline's clients run from its checkout (`check_baseline_client`)
    with pytest.raises(SystemExit):
        bench.parse_args(["--baseline", str(tmp_path)])
    assert f"no benchmarks/{client}" in capsys.readouterr().err
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / client).write_text("")
    assert bench.parse_args(["--baseline", str(tmp_path)]).baseline == str(tmp_path)
