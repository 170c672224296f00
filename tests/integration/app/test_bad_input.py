"""Bad input found by an adversarial run, through real processes: merge/generate scripts, the launcher and its
environment, torchrun, finetune.py without write permission, and merges of a trained adapter. Each case exits 2
with a message naming what, where and the fix, with no traceback, and leaves the user's files alone. The
in-process cases (sft.cli.train_main, the data/config corpus tables) are in
tests/integration/app/test_bad_input_corpus.py."""
import os
import subprocess
import sys

import pytest

from tests.helpers.data import write_jsonl
from tests.helpers.paths import ROOT


def script(name, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_merge_and_generate_bad_folders(tmp_path):
    bad = tmp_path / "bad_adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{bad")
    (bad / "adapter_model.safetensors").write_text("")
    r = script("merge_adapter.py", bad, tmp_path / "o")
    assert r.returncode == 2 and "cannot load the adapter config" in r.stderr and "Traceback" not in r.stderr
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text("{}")
    r = script("merge_adapter.py", no_weights, tmp_path / "o")
    assert r.returncode == 2 and "no adapter_model.safetensors" in r.stderr
    r = script("generate.py", tmp_path / "nope", "hi")
    assert r.returncode == 2 and "no such folder" in r.stderr
    (tmp_path / "empty").mkdir()
    r = script("generate.py", tmp_path / "empty", "hi")
    assert r.returncode == 2 and "cannot load the tokenizer" in r.stderr and "Traceback" not in r.stderr


def test_merge_never_touches_a_sibling_tmp_folder(tmp_path, tiny_model_dir, toy_data):
    from tests.integration.app.test_train import train

    train(tiny_model_dir, toy_data, tmp_path / "lora", "--use_lora", "True", "--lora_r", "4", "--max_steps", "1")
    keep = tmp_path / "merged.tmp"
    keep.mkdir()
    (keep / "keep.txt").write_text("mine")
    r = script("merge_adapter.py", tmp_path / "lora", tmp_path / "merged")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (keep / "keep.txt").read_text() == "mine"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".merge-")]
    r = script("merge_adapter.py", tmp_path / "lora", tmp_path / "lora", "--overwrite")  # its own input
    assert r.returncode == 2 and "inside the adapter folder" in r.stderr
    assert os.path.isfile(tmp_path / "lora" / "adapter_model.safetensors")
    (tmp_path / "afile").write_text("x")
    r = script("merge_adapter.py", tmp_path / "lora", tmp_path / "afile")
    assert r.returncode == 2 and "is a file" in r.stderr and (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("port", ["18446744073709557617", "0100000", "08"])
def test_launcher_rejects_overflowing_and_octal_ports(port):
    env = {**os.environ, "MASTER_PORT": port}
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "launch.sh"), "-m", "m", "-d", "d"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and f"MASTER_PORT={port}: must be in 1-65535" in r.stderr
    assert "value too great" not in r.stderr


def test_multi_process_launch_reports_data_errors_once(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"id": "x", "messages": [{"role": "robot", "content": "a"}]}])
    env = {**os.environ, "NPROC_PER_NODE": "2", "PYTHON": sys.executable}
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "launch.sh"), "-m", tiny_model_dir, "-d", data,
                        "--output_dir", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stderr.count("unknown role 'robot'") == 1
    assert "ChildFailedError" not in r.stderr and "Traceback" not in r.stderr


def test_merge_overwrite_only_replaces_model_folders(tmp_path, tiny_model_dir, toy_data, monkeypatch):
    from sft.errors import SFTError
    from sft.model.export import merge_adapter
    from tests.integration.app.test_train import train

    train(tiny_model_dir, toy_data, tmp_path / "lora", "--use_lora", "True", "--lora_r", "4", "--max_steps", "1")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "notes.txt").write_text("precious")
    monkeypatch.chdir(proj)
    with pytest.raises(SFTError, match="also holds notes.txt"):
        merge_adapter(str(tmp_path / "lora"), ".", overwrite=True)
    assert (proj / "notes.txt").read_text() == "precious"
    merged = tmp_path / "merged"
    merge_adapter(str(tmp_path / "lora"), str(merged))
    merge_adapter(str(tmp_path / "lora"), str(merged), overwrite=True)  # a model folder may be replaced
    assert (merged / "model.safetensors").is_file()


def test_output_dir_not_writable(tmp_path, tiny_model_dir, toy_data):
    """Root ignores directory permissions, so the check runs without CAP_DAC_OVERRIDE (setpriv)."""
    import shutil

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    cmd = [sys.executable, os.path.join(ROOT, "finetune.py"), "--model_name_or_path", tiny_model_dir, "--data_path",
           toy_data, "--output_dir", str(ro / "out")]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot make a folder unwritable")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"--output_dir {ro}/out: {ro} is not writable" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and os.listdir(ro) == []


# Launcher environment: (id, environment, arguments after the preset/launcher, exit code, message fragment).
ENV_CORPUS = [
    ("nnodes-0", {"NNODES": "0"}, [], 2, "NNODES=0: must be a whole number >= 1"),
    ("nnodes-word", {"NNODES": "two"}, [], 2, "NNODES=two: must be a whole number >= 1"),
    ("nnodes-negative", {"NNODES": "-1"}, [], 2, "NNODES=-1: must be a whole number >= 1"),
    ("node-rank-too-big", {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, [], 2,
     "NODE_RANK=2: must be in [0, NNODES=2)"),
    ("node-rank-word", {"NODE_RANK": "first"}, [], 2, "NODE_RANK=first: must be a whole number >= 0"),
    ("master-port-too-big", {"MASTER_PORT": "70000"}, [], 2, "MASTER_PORT=70000: must be in 1-65535"),
    ("master-port-empty", {"MASTER_PORT": "x1"}, [], 2, "MASTER_PORT=x1: must be in 1-65535"),
    ("nproc-0", {"NPROC_PER_NODE": "0"}, [], 2, "NPROC_PER_NODE=0: processes per node: must be a whole number >= 1"),
    ("multi-node-without-master-addr", {"NNODES": "2", "NODE_RANK": "1"}, [], 2,
     "MASTER_ADDR=localhost: a loopback address (it resolves to 127.0.0.1 here) with NNODES=2; other nodes cannot "
     "reach it. Give node rank 0's address"),
    ("preset-without-model", {}, ["-d", "data.jsonl"], 2, "-m/--model MODEL_DIR is required"),
    ("model-flag-without-value", {}, ["-m", "-d", "data.jsonl"], 2, "-m needs a value (the model folder)"),
    ("preset-without-data", {}, ["-m", "model"], 2, "-d/--data DATA_FILE is required"),
    ("preset-flag-without-value", {}, ["-m"], 2, "-m needs a value (the model folder)"),
]


@pytest.mark.parametrize("env,args,code,fragment", [c[1:] for c in ENV_CORPUS], ids=[c[0] for c in ENV_CORPUS])
def test_launcher_env_corpus(tmp_path, env, args, code, fragment):
    base = {k: v for k, v in os.environ.items()  # MASTER_PORT: the worker's
            if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "NPROC_PER_NODE", "GPUS_PER_NODE")}
    argv = args or ["-m", "model", "-d", "data.jsonl"]
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh"), *argv],
                       capture_output=True, text=True, env={**base, **env, "PYTHON": sys.executable}, timeout=60,
                       cwd=str(tmp_path))
    assert r.returncode == code and fragment in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and os.listdir(tmp_path) == []  # no output_lora folder was created
