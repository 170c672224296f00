"""bench/startup_profile.py without a training run (its runs are in docs/testing.md, "Where a test's time goes"): a
wrapped step marks its phase with cumulative CPU and wall seconds and the heavy packages first imported in it, and
the report is one JSON file per rank."""
import json
import types

from tests.helpers.paths import load_bench_module


def test_a_wrapped_function_marks_its_phase_and_the_report_is_written(tmp_path, monkeypatch):
    profile = load_bench_module("startup_profile")
    monkeypatch.setattr(profile, "phases", [])
    profile.mark("imports")  # torch and transformers are loaded in this process (tests/conftest.py)
    module = types.SimpleNamespace(step=lambda x: x * 2)
    profile.timed(module, "step", "data")
    assert module.step(21) == 42
    first, data = profile.phases
    assert first["phase"] == "imports" and {"torch", "transformers"} <= set(first["imported"])
    assert data["phase"] == "data" and data["imported"] == []  # each package named once, where it first appeared
    assert data["cpu_s"] >= first["cpu_s"] > 0 and data["wall_s"] >= first["wall_s"] >= 0
    monkeypatch.setenv("SFT_STARTUP_REPORT", str(tmp_path / "report"))
    monkeypatch.setenv("RANK", "1")
    profile.write()
    assert [p["phase"] for p in json.load(open(tmp_path / "report" / "rank1.json"))] == ["imports", "data"]
