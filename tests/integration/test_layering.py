"""Layering rules that need a fresh interpreter: importing the env contract (what finetune/launch.sh evaluates)
pulls in no torch, and parsing a command line in one process starts nothing (no process group, no DeepSpeed patch)."""
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=ROOT)


def test_contract_and_rendezvous_import_no_torch():
    p = _run("import sys, sft.distributed.contract, sft.distributed.rendezvous, sft.distributed.__main__, sft.cli, "
             "sft.ray, sft.ray.flags, sft.ray.placement\n"
             "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'ray', 'numpy') if m in sys.modules]\n"
             "print(heavy)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout


def test_launcher_cli_plan_without_torch():
    """python -m sft.distributed plan (what finetune/launch.sh evaluates) runs without importing torch."""
    p = _run("import runpy, sys; sys.argv = ['x', 'plan']\n"
             "try:\n    runpy.run_module('sft.distributed', run_name='__main__')\n"
             "except SystemExit as e:\n    assert e.code == 0, e.code\n"
             "print('torch' in sys.modules, file=sys.stderr)", NNODES="1")
    assert p.returncode == 0, p.stderr
    assert "NNODES=1" in p.stdout and "WORLD=1" in p.stdout
    assert p.stderr.strip().endswith("False"), p.stderr


def test_parse_has_no_side_effects_in_one_process(tmp_path):
    """parse_args with --deepspeed leaves DeepSpeed unpatched and starts no process group."""
    code = f"""
import importlib, sys
from sft.config.arguments import parse_args
args = parse_args(["--output_dir", {str(tmp_path / 'o')!r}, "--deepspeed", "finetune/ds_config_zero2.json",
                   "--report_to", "none"])
assert args[2].parsed.zero_stage == 2 and args[2].use_cpu
import torch.distributed as dist
assert not dist.is_initialized(), "a process group was started while parsing"
comm = importlib.import_module("deepspeed.comm.torch")
assert comm.build_shm_op.__module__ == "deepspeed.comm.torch", "DeepSpeed was patched while parsing"
print("ok")
"""
    p = _run(code, WORLD_SIZE="1")
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr


def test_parse_starts_nothing_under_torchrun_either(tmp_path):
    """Rank 0 of a two-process torchrun job whose peer never comes: parsing (with --deepspeed, whose config is filled
    with the job's world size) returns at once with no process group; validation reads the rank from the env; the
    runtime (sft.distributed.process_group.start_runtime) is what would join the group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
import time
t0 = time.monotonic()
from sft.config.arguments import parse_args
args = parse_args(["--output_dir", {str(tmp_path / 'o')!r}, "--deepspeed", "finetune/ds_config_zero2.json",
                   "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2", "--report_to", "none"])
t = args[2]
import torch.distributed as dist
assert not dist.is_initialized(), "a process group was started while parsing"
assert (t.world_size, t.process_index, t.local_process_index, t.should_save) == (2, 0, 0, True)
assert t.hf_deepspeed_config.config["train_batch_size"] == 2 * 3 * 2  # the job's world size, not 1
from sft.distributed.process_group import current_runtime
assert current_runtime() is None and t.device is None  # reading a property starts nothing
assert not dist.is_initialized() and time.monotonic() - t0 < 60
print("ok")
"""
    p = _run(code, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(port))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2"}, {"WORLD_SIZE": "1", "RANK": "abc"}],
                         ids=["no-master", "bad-rank"])
def test_incomplete_torchrun_env_is_one_message_and_exit_2(tmp_path, tiny_model_dir, toy_data, env):
    """torchrun's variables incomplete or garbled: the runtime step (no longer parsing) still ends in one
    paragraph and exit 2, with the library's own sentence or ours, and no traceback."""
    p = subprocess.run([sys.executable, "-m", "sft", "train", "--model_name_or_path", str(tiny_model_dir),
                        "--data_path", str(toy_data), "--output_dir", str(tmp_path / "o"), "--use_lora", "True",
                        "--model_max_length", "64", "--max_steps", "1", "--report_to", "none"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={k: v for k, v in {**os.environ, **env}.items()
                            if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or k in env})
    assert p.returncode == 2 and "error: invalid configuration" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and ("MASTER_ADDR" in p.stderr or "RANK='abc'" in p.stderr), p.stderr[-2000:]
