"""bench/compare_peers.py's peer configurations and bench/setup_llamafactory.sh's argument handling (cheap: no
training, no install)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import types

import pytest

from tests.helpers.paths import ROOT, load_bench_module


@pytest.fixture(scope="module")
def peers():
    return load_bench_module("compare_peers")


def test_llamafactory_runs_the_same_lora_length_steps_and_neat_packing(peers, tmp_path):
    a = types.SimpleNamespace(model="/m", lora_r=16, llamafactory_template="smollm2", max_length=2048,
                              packing_batch=3, max_steps=5, bf16=True, cuda=False)
    cfg = peers.llamafactory_config(a, str(tmp_path / "data"), str(tmp_path / "out"))
    assert (cfg["lora_rank"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["lora_target"]) == (16, 32, 0.05, "all")
    assert (cfg["cutoff_len"], cfg["per_device_train_batch_size"], cfg["max_steps"]) == (2048, 3, 5)
    assert "num_train_epochs" not in cfg  # --timing steps (a namespace without timing: the steps mode)
    assert cfg["neat_packing"] and cfg["packing"] and cfg["disable_gradient_checkpointing"]
    assert cfg["bf16"] and cfg["use_cpu"] and cfg["optim"] == "adamw_torch" and cfg["warmup_steps"] == 0


def test_trl_best_names_real_sftconfig_fields(peers):
    spec = importlib.util.find_spec("trl")  # read, not imported: importing TRL takes ~10 s
    if spec is None:
        pytest.skip("TRL is a benchmark-only package (requirements-bench.txt)")
    source = open(os.path.join(os.path.dirname(spec.origin), "trainer", "sft_config.py"), encoding="utf-8").read()
    fields = set(re.findall(r"^    (\w+): [^=]+= field\(", source, re.M))
    assert {"packing", "max_length", "assistant_only_loss"} <= fields  # the pattern finds SFTConfig's fields
    assert set(peers.TRL_BEST) <= fields
    assert peers.TRL_BEST["packing_strategy"] == "bfd"


def test_marked_template_rejects_a_template_it_does_not_know(peers):
    with pytest.raises(ValueError, match="generation"):
        peers.marked_chatml_template("{{ messages }}")


def test_setup_script_takes_no_arguments():
    script = f"{ROOT}/bench/setup_llamafactory.sh"
    bad = subprocess.run(["bash", script, "--torch", "2.14"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "takes no arguments" in bad.stderr
    usage = subprocess.run(["bash", script, "-h"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 0 and "bash bench/setup_llamafactory.sh" in usage.stdout


def test_epoch_timing_trains_two_epochs_in_every_system_and_times_the_second(peers, tmp_path, monkeypatch):
    """bench/compare.py --timing epoch: every system (ours, TRL, LLaMA-Factory) runs two epochs over the same
    conversations, and only the steps of the second are timed."""
    a = types.SimpleNamespace(model="/m", lora_r=16, llamafactory_template="smollm2", max_length=512,
                              packing_batch=1, max_steps=5, bf16=False, cuda=False, timing="epoch")
    cfg = peers.llamafactory_config(a, str(tmp_path / "data"), str(tmp_path / "out"))
    assert (cfg["num_train_epochs"], cfg["max_steps"]) == (2, -1)
    assert peers.run_length(a) == {"num_train_epochs": 2, "max_steps": -1}
    assert peers.run_length(types.SimpleNamespace(timing="steps", max_steps=5)) == {"max_steps": 5}
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))  # compare.py imports its sibling modules by name
    compare = load_bench_module("compare")
    flags = compare.common_flags(types.SimpleNamespace(**vars(a), data="/d.jsonl", batch=2, cache="/c",
                                                       peak_tflops=0.0, train_flags=""), "ours")
    assert "--max_steps -1" in " ".join(flags) and "--num_train_epochs 2" in " ".join(flags)
    assert compare.timed_steps([1, 1, 1, 2, 2, 2], "epoch") == [3, 4, 5]
    assert compare.timed_steps([1, 1, 1, 2, 2, 2], "steps") == [1, 2, 3, 4, 5]
    with pytest.raises(SystemExit, match="nothing to time"):
        compare.timed_steps([1, 1], "epoch")
    with pytest.raises(SystemExit, match="nothing to time"):
        compare.timed_steps([1], "steps")
