"""Inputs and faults found by breaking the CLI layer (sft.cli policy, sft.distributed, launch.sh, the wrappers):
each gives one paragraph naming what and the fix, a non-zero exit, no traceback, and leaves the user's files alone."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from sft.cli import debug_enabled, generate_main, main, run_cli, train_main
from sft.errors import ConfigError, ContractError, SFTError
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT

NO_HOST = ["..", "a" * 70 + ".com"]  # an empty label / one over 63 characters: socket raises UnicodeError


# ------------------------------------------------------------------------------------------ host names / contract

@pytest.mark.parametrize("name", NO_HOST)
def test_master_addr_that_is_no_host_name(name):
    from sft.distributed.contract import read_contract

    with pytest.raises(ContractError,
                       match=f"MASTER_ADDR={name}: does not resolve on this node \\(not a valid host name"):
        read_contract({"NNODES": "2", "MASTER_ADDR": name})


@pytest.mark.parametrize("name", NO_HOST)
def test_ray_address_that_is_no_host_name(name):
    from sft.ray.driver import _gcs_unreachable

    assert "not a valid host name" in _gcs_unreachable(f"{name}:6379")


def test_plan_cli_reports_no_host_name_without_traceback():
    env = {**os.environ, "NNODES": "2", "MASTER_ADDR": ".."}
    r = subprocess.run([sys.executable, "-m", "sft.distributed", "plan"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and "error: MASTER_ADDR=..: does not resolve" in r.stderr and "Traceback" not in r.stderr


def test_one_node_several_processes_need_master_addr_on_this_host():
    # torchrun's processes would retry MASTER_ADDR for RDZV_TIMEOUT (600 s) with C++ stack traces
    from sft.distributed.contract import read_contract

    with pytest.raises(ContractError, match="MASTER_ADDR=192.0.2.7: not an address of this host"):
        read_contract({"NPROC_PER_NODE": "2", "MASTER_ADDR": "192.0.2.7"})
    with pytest.raises(ContractError, match="MASTER_ADDR=..: does not resolve.*leave MASTER_ADDR unset"):
        read_contract({"NPROC_PER_NODE": "2", "MASTER_ADDR": ".."})
    assert read_contract({"NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1"}).world_size == 2
    assert read_contract({"NPROC_PER_NODE": "1", "MASTER_ADDR": "192.0.2.7"}).world_size == 1  # unused by one process


# ------------------------------------------------------------------------------------------ flags and files

def test_config_that_cannot_be_read(tmp_path):
    from sft.config.arguments import parse_args

    with pytest.raises(ConfigError, match=r"--config /proc/self/mem: cannot be read \(Input/output error\)"):
        parse_args(["--config", "/proc/self/mem"])  # a regular file whose read fails, also for root
    with pytest.raises(ConfigError, match="not a file"):
        parse_args(["--config", str(tmp_path)])


def test_unconvertible_value_is_one_paragraph_not_the_whole_usage(capsys):
    rc = train_main(["--max_steps", "abc"])
    err = capsys.readouterr().err
    assert rc == 2 and "--max_steps/--max-steps: invalid int value: 'abc'" in err
    assert "usage:" not in err and len(err.splitlines()) <= 3, err


def test_deepspeed_shipped_name_relative_to_another_directory(tmp_path, monkeypatch):
    from sft.config.deepspeed import SHIPPED, read_ds_config

    monkeypatch.chdir(tmp_path)
    _, problems = read_ds_config("finetune/ds_config_zero3.json", "cosine")
    assert len(problems) == 1 and f"the shipped ds_config_zero3.json is {SHIPPED}/ds_config_zero3.json" in problems[0]
    shutil.copy(os.path.join(ROOT, "finetune", "ds_config_zero3.json"), tmp_path / "real.json")
    os.symlink("../sft/config/shipped/ds_config_zero3.json", tmp_path / "copied_link.json")  # cp -P of the shipped link
    _, problems = read_ds_config("copied_link.json", "cosine")
    assert "a symlink to the missing ../sft/config/shipped/ds_config_zero3.json" in problems[0]
    assert read_ds_config("real.json", "cosine")[1] == []


def test_unknown_command_is_named(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_launcher_python_that_does_not_exist(tmp_path):
    env = {**os.environ, "PYTHON": str(tmp_path / "no-python")}
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "launch.sh"), "-m", "m", "-d", "d"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and "no-python: no such program" in r.stderr


@pytest.mark.parametrize("value,on", [("", False), ("0", False), ("false", False), ("Off", False), ("no", False),
                                      ("1", True), ("yes", True)])
def test_sft_debug_values(monkeypatch, value, on):
    monkeypatch.setenv("SFT_DEBUG", value)
    assert debug_enabled() is on


# ------------------------------------------------------------------------------------------ the policy

def test_sigint_and_sigterm_are_one_line_and_run_finally(capsys):
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("SIGTERM already has a handler in this test process")
    cleaned = []

    def body(sig):
        try:
            if sig == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), sig)
            time.sleep(5)
        finally:
            cleaned.append(sig)

    assert run_cli(lambda: body(signal.SIGINT)) == 130
    assert run_cli(lambda: body(signal.SIGTERM)) == 143
    err = capsys.readouterr().err
    assert "interrupted by SIGINT" in err and "interrupted by SIGTERM" in err and "Traceback" not in err
    assert cleaned == [signal.SIGINT, signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sft_debug_shows_the_interrupt(monkeypatch):
    monkeypatch.setenv("SFT_DEBUG", "1")
    with pytest.raises(KeyboardInterrupt):
        run_cli(lambda: (_ for _ in ()).throw(KeyboardInterrupt))


def test_missing_dependency_is_named_but_a_missing_sft_module_is_a_bug(capsys):
    def needs(name):
        raise ModuleNotFoundError(f"No module named '{name}'", name=name)

    assert run_cli(lambda: needs("transformers")) == 2
    err = capsys.readouterr().err
    assert f"this Python ({sys.executable}) has no package 'transformers'" in err and "requirements.txt" in err
    with pytest.raises(ModuleNotFoundError):
        run_cli(lambda: needs("sft.nope"))


def _python_without_transformers():
    for exe in ("/usr/bin/python3", shutil.which("python3")):
        if exe and os.path.realpath(exe) != os.path.realpath(sys.executable) and subprocess.run(
                [exe, "-c", "import sys; assert sys.version_info >= (3, 10); import transformers"],
                capture_output=True, timeout=60).returncode == 1:
            return exe
    return None


@pytest.mark.parametrize("script", ["finetune.py", "scripts/merge_adapter.py", "scripts/generate.py",
                                    "scripts/show_sample.py", "scripts/ray_train.py"])
def test_entry_points_with_a_python_without_the_requirements(script, tmp_path):
    exe = _python_without_transformers()
    if exe is None:
        pytest.skip("no Python >= 3.10 without transformers on this machine")
    r = subprocess.run([exe, os.path.join(ROOT, script), ".", "b"], capture_output=True, text=True, cwd=str(tmp_path),
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert "has no package '" in r.stderr and "setup_env.sh" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------ folders

def _model_without_tokenizer(src, dst):
    os.makedirs(dst)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(src, f), dst)
    return str(dst)


def test_model_folder_without_tokenizer_files(tiny_model_dir, tmp_path, capsys):
    # transformers 5 loads such a folder as a tokenizer of one special token, without an error
    from sft.model.loading import load_tokenizer

    bare = _model_without_tokenizer(tiny_model_dir, tmp_path / "bare")
    with pytest.raises(SFTError, match="cannot load the tokenizer: the folder has no tokenizer files"):
        load_tokenizer(bare)
    assert generate_main([bare, "hi", "--max_new_tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer files" in err and "no chat template" not in err


@pytest.fixture
def adapter(tiny_model_dir, tmp_path):
    import peft
    import transformers

    from sft.model.loading import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    out = str(tmp_path / "adapter")
    model.save_pretrained(out)
    load_tokenizer(tiny_model_dir)[0].save_pretrained(out)
    return out


def _files(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def test_merge_overwrite_interrupted_keeps_the_old_model(adapter, tiny_model_dir, tmp_path, monkeypatch):
    from sft.model import export

    out = str(tmp_path / "merged")
    shutil.copytree(tiny_model_dir, out)  # the user's previous model in OUT_DIR
    before = _files(out)
    real_replace = os.replace

    def interrupted(src, dst, *a, **k):  # a signal right before the new model is moved in
        if os.path.basename(str(src)).startswith(".merge-") and os.path.realpath(dst) == os.path.realpath(out):
            raise KeyboardInterrupt
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(export.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export.merge_adapter(adapter, out, overwrite=True)
    assert _files(out) == before
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".merge-")]
    monkeypatch.setattr(export.os, "replace", real_replace)
    export.merge_adapter(adapter, out, overwrite=True)
    assert _files(out) != before and "model.safetensors" in os.listdir(out)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".merge-")]


def test_sigterm_during_merge_leaves_no_partial_folder(adapter, tmp_path):
    # default SIGTERM would kill the process inside save_pretrained and leave .merge-XXXX behind
    out = tmp_path / "m"
    code = ("import os, signal, sys, transformers\n"
            "real = transformers.PreTrainedModel.save_pretrained\n"
            "def save(self, d, *a, **k):\n"
            "    real(self, d, *a, **k); os.kill(os.getpid(), signal.SIGTERM)\n"
            "transformers.PreTrainedModel.save_pretrained = save\n"
            "from sft.cli import merge_main\n"
            f"sys.exit(merge_main([{adapter!r}, {str(out)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 143 and "interrupted by SIGTERM" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if f.startswith(".merge-")]


def test_toy_data_still_checks(tiny_model_dir, tmp_path, capsys):
    # the policy's SIGTERM handler is installed and removed around a full check without changing its result
    from sft.cli import check_main

    data = write_jsonl(tmp_path / "d.jsonl", TOY)
    assert check_main(["--model_name_or_path", tiny_model_dir, "--data_path", data, "--output_dir",
                       str(tmp_path / "o"), "--report_to", "none"]) == 0
    assert "configuration and data OK" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
