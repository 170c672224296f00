"""bench/gpu_bench.py --shape qwen2.5-7b --tiny on a CPU (issue 30, item 5): the Qwen2.5-7B shape's family built
offline with the Qwen vocabulary, two rows (our defaults, and the profile row) run end to end through
bench/compare.py's worker, the table and results.json written. The GPU figures themselves need a GPU."""
import json
import subprocess
import sys

from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT, load_bench_module


def test_tiny_7b_shape_rows_run_on_cpu_and_write_table_and_json(tmp_path):
    data = write_jsonl(tmp_path / "toy.jsonl", TOY)
    out, models = tmp_path / "out", tmp_path / "models"
    p = subprocess.run([sys.executable, "bench/gpu_bench.py", "--shape", "qwen2.5-7b", "--tiny", "--rows", "bf16",
                        "profile", "--max_steps", "2", "--batch", "1", "--max_length", "256", "--data", str(data),
                        "--models", str(models), "--out", str(out), "--time_limit_s", "400"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    config = json.loads((models / "qwen2.5-7b-tiny" / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == \
        ("qwen2", 152064, 64, 2)
    result = json.loads((out / "results.json").read_text())
    assert result["shape"] == "qwen2.5-7b" and result["tiny"] and result["device"] == "CPU"
    assert len(result["verdicts"]) == 2 and all("not judged (--tiny" in v for v in result["verdicts"])
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "profile"} and all(r["real_tokens_per_s"] > 0 for r in rows.values())
    profile = rows["profile"]["profile"]
    assert profile["step"] == 2 and profile["wall_s"] > 0 and profile["aten_ops"] > 50 and profile["launches"] == 0
    table = (out / "table.txt").read_text()
    assert "profile of step 2:" in table and table in p.stdout + "\n"
    assert "target ours default >= 40% MFU of the measured bf16 peak (Qwen2.5-7B shape): not judged (--tiny" in table


def test_tiny_moe_layer_shape_runs_its_three_arms_on_cpu(tmp_path):
    """Issue 52 item 11's row at --tiny (bench/moe.py's layer arms; the hybrid shape's config and plan are checked in
    tests/unit/bench/test_gpu_bench.py, its padding-free training in tests/integration/app/test_hybrid.py)."""
    out = tmp_path / "moe"  # gpu_bench in this process (one interpreter start less), bench/moe.py in its own
    rc = load_bench_module("gpu_bench").main(["--shape", "qwen3-30b-a3b-layer", "--tiny", "--out", str(out),
                                              "--time_limit_s", "400"])
    assert rc == 0, (out / "table.txt").read_text()[-3000:]
    layer = json.loads((out / "results.json").read_text())["moe_layer"]
    assert (layer["experts"], layer["top_k"], layer["r"], layer["dtype"]) == (128, 8, 16, "fp32")
    assert [r["arm"] for r in layer["arms"]] == ["grouped", "peft", "ours"]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in layer["arms"])
    assert "MoE layer: hidden 64, 128 experts of 32, top-8, 64 tokens, LoRA r 16" in (out / "table.txt").read_text()
