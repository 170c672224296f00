"""Every shipped shell script parses; the launcher checks its environment and flags."""
import glob
import os
import shutil
import subprocess

import pytest

from tests.helpers.paths import ROOT

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "finetune", "*.sh")) + glob.glob(os.path.join(ROOT, "scripts", "*.sh"))
                 + glob.glob(os.path.join(ROOT, "scripts", "lib", "*.sh")) + [os.path.join(ROOT, ".ci", "run")])


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_bash_syntax(path):
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", "-S", "warning", path], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def launch(*args, **env):
    # MASTER_PORT: the worker's
    e = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    e.update(env)
    return subprocess.run(["bash", os.path.join(ROOT, "finetune", "launch.sh"), *args], capture_output=True, text=True,
                          env=e, timeout=60)


@pytest.mark.parametrize("env,fragment", [
    ({"NODE_RANK": "2", "NNODES": "2"}, "NODE_RANK=2: must be in [0, NNODES=2)"),
    ({"NNODES": "zero"}, "NNODES=zero"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: must be in 1-65535"),
    ({"NPROC_PER_NODE": "0"}, "must be a whole number >= 1"),
])
def test_launcher_env_errors(env, fragment):
    r = launch("-m", "m", "-d", "d", **env)
    assert r.returncode == 2 and fragment in r.stderr


def test_launcher_requires_model_and_data_and_has_help():
    r = launch("-d", "x")
    assert r.returncode == 2 and "-m/--model" in r.stderr
    r = launch("-h")
    assert r.returncode == 0 and "Usage:" in r.stdout


def test_launcher_runs_from_any_directory_and_passes_flags(tmp_path):
    # finetune.py's own validation answers, proving the flags got through from another working directory
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh"),
                        "-m", str(tmp_path / "nope"), "-d", str(tmp_path / "none.jsonl"), "--lora_r", "0"],
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=120)
    assert r.returncode == 2
    assert "--model_name_or_path" in r.stderr and "none.jsonl: no such file" in r.stderr and "--lora_r 0" in r.stderr


def test_relative_paths_are_relative_to_the_callers_directory(tiny_model_dir, toy_data, tmp_path):
    import shutil as sh

    sh.copy(toy_data, tmp_path / "mine.jsonl")
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh"), "-m", tiny_model_dir,
                        "-d", "mine.jsonl", "--output_dir", "out", "--lora_r", "0"], capture_output=True, text=True,
                       cwd=str(tmp_path), timeout=120)
    assert r.returncode == 2 and "--lora_r 0" in r.stderr
    assert "mine.jsonl" not in r.stderr  # found: relative to the caller's directory, not the repository


def test_preset_help_describes_the_preset():
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh"), "-h"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "LoRA on one node without DeepSpeed" in r.stdout and "NPROC_PER_NODE" in r.stdout \
        and "--use_lora True" in r.stdout


def test_launcher_check_refuses_a_sequence_parallel_size_the_ranks_would(tiny_model_dir, toy_data, tmp_path):
    """3 processes cannot form groups of 2: refused by the launcher's one check, before torchrun starts."""
    r = launch("-m", tiny_model_dir, "-d", toy_data, "--output_dir", str(tmp_path / "out"),
               "--sequence_parallel_size", "2", NPROC_PER_NODE="3")
    assert r.returncode == 2, r.stderr
    assert "--sequence_parallel_size 2: does not divide the world size 3" in r.stderr
    assert "configuration and data OK" not in r.stdout + r.stderr and "torchrun" not in r.stderr
