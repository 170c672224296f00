"""bench/compare_report.py's verdict on which of our layouts is fastest: paired round by round, so that a gap
smaller than the noise between rounds is called level, not a ranking (cheap: no training)."""
from __future__ import annotations

import types

import pytest

from tests.helpers.paths import load_bench_module


@pytest.fixture(scope="module")
def report():
    return load_bench_module("compare_report")


def test_paired_verdict_needs_every_round_to_agree(report):
    # the measured 3-round run of docs/benchmarks.md, bf16 at 2048: packing led the best rounds by 1.03x, but
    # the default won round 3
    verdict, ratios = report.paired_verdict([272.3, 248.3, 251.4], [273.4, 279.8, 250.3])
    assert verdict == "level" and [round(x, 3) for x in ratios] == [0.996, 0.887, 1.004]
    assert report.paired_verdict([273.6, 252.6, 273.9], [263.7, 247.0, 269.5])[0] == "faster"
    assert report.paired_verdict([100.0, 90.0], [101.0, 95.0])[0] == "slower"
    assert report.paired_verdict([100.0], [50.0]) == ("one round", [2.0])
    # a failed round (rate 0) is left out of the pairs, not counted as a loss
    assert report.paired_verdict([100.0, 0.0, 120.0], [90.0, 95.0, 110.0])[0] == "faster"
    assert report.paired_verdict([100.0, 0.0], [90.0, 95.0])[0] == "one round"


def test_fastest_of_ours_keeps_every_layout_nothing_beats_in_every_round(report):
    unbeaten, lines = report.fastest_of_ours({"ours": [272.3, 248.3, 251.4], "ours-packing": [273.4, 279.8, 250.3],
                                              "ours-group": [113.9, 110.0, 101.0]})
    assert unbeaten == ["ours-packing", "ours"]  # best round first; ours-group lost every round to both
    assert any("ours-packing" in x and "level" in x for x in lines)
    assert any("ours-group" in x and "ours faster in every round" in x for x in lines)
    # beaten in every round: the default is not among the fastest
    unbeaten, lines = report.fastest_of_ours({"ours": [240.0, 250.0, 245.0], "ours-packing": [280.0, 279.8, 260.0]})
    assert unbeaten == ["ours-packing"] and "ours-packing faster in every round" in lines[0]
    # one round: the best rate decides, and the line says noise was not measured
    unbeaten, lines = report.fastest_of_ours({"ours": [247.9], "ours-packing": [287.1]})
    assert unbeaten == ["ours-packing"] and "noise not measured" in lines[0]


def _result(rate: float, batch: int = 2) -> list[dict]:
    return [{"real": int(rate * 10), "seconds": 10.0, "total": int(rate * 10), "median_step_s": 1.0,
             "peak_mem_gib": 3.0, "flops_per_token": 1e9, "supervised": 100, "batch": batch, "steps": 8,
             "attn": "sft_packed_sdpa"}]


def test_print_table_prints_the_paired_verdict(report, capsys):
    a = types.SimpleNamespace(cuda=False, max_lengths=[2048], systems=["ours", "ours-packing"], failures={})
    rounds = {("bf16", 2048, "ours"): [272.3, 248.3, 251.4], ("bf16", 2048, "ours-packing"): [273.4, 279.8, 250.3]}
    results = {("bf16", 2048, "ours"): _result(272.3), ("bf16", 2048, "ours-packing"): _result(279.8, 1)}
    report.print_table(a, "bf16", results, {"bf16": 7.4e11}, rounds)
    out = capsys.readouterr().out
    assert "ours / ours-packing round by round: 0.996x, 0.887x, 1.004x: level" in out
    assert "fastest of ours: ours-packing, level with ours; the default is the fastest or level with it" in out
    report.print_table(a, "bf16", results, {"bf16": 7.4e11})  # no rounds: the best rounds decide
    out = capsys.readouterr().out
    assert "fastest of ours: ours-packing; the default is NOT the fastest" in out
