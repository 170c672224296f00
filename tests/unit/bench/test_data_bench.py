"""bench/data.py's argument handling for the side-by-side run (the run itself is a benchmark, not a test)."""
from __future__ import annotations

import sys

from tests.helpers.paths import load_bench_module


def test_side_without_a_fast_model_exits_2_naming_the_flag(monkeypatch, capsys, tmp_path):
    data_bench = load_bench_module("data")
    monkeypatch.setattr(sys, "argv", ["data.py", "--runs", "side", "--work", str(tmp_path)])
    assert data_bench.main() == 2
    assert "--runs side compares --fast_model with --model: pass --fast_model" in capsys.readouterr().err
    missing = str(tmp_path / "no-model")
    monkeypatch.setattr(sys, "argv", ["data.py", "--runs", "side", "--fast_model", missing, "--model", str(tmp_path),
                                      "--data", str(tmp_path)])
    assert data_bench.main() == 2
    assert f"--fast_model {missing}: not found" in capsys.readouterr().err
