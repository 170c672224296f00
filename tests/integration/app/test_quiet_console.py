"""A run that uses neither bitsandbytes nor DeepSpeed shows neither library's import-time notices.

peft imports bitsandbytes whenever it is installed (bitsandbytes' CPU backend then warns that the
``kernels`` hub package is missing), and accelerate imports DeepSpeed whenever it is installed (whose
accelerator autodetection warns that it picked the CPU). sft/logs.py holds these notices back from
the import of ``sft`` on and lets them out only where the run uses the library (sft/model/loading.py,
sft/distributed/process_group.py).
"""
import os
import subprocess
import sys
import textwrap

from tests.helpers.paths import ROOT

NOISE = ("gemm_4bit_forward", "kernels-community", "Setting accelerator to CPU", "real_accelerator.py",
         # gptqmodel's import banner (peft's LoRA dispatch imports it when installed; sft.compat.peft keeps it out)
         "GPT-QModel", "Auto setting PYTORCH_ALLOC_CONF", "Python GIL is enabled")


def _env():
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)  # launch.sh's CPU default would hide DeepSpeed's notice without our help
    return env


def _python(code, timeout=300):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=timeout)


def test_lora_run_shows_no_bitsandbytes_or_deepspeed_notice(tiny_model_dir, toy_data, tmp_path):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "finetune.py"), "--model_name_or_path", tiny_model_dir,
         "--data_path", toy_data, "--output_dir", str(tmp_path / "out"), "--use_lora", "True", "--lora_r", "4",
         "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none", "--save_strategy", "no",
         "--disable_tqdm", "True"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "saved adapter" in out
    noisy = [line for line in out.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, noisy


def test_help_shows_no_bitsandbytes_notice():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "-h"], capture_output=True, text=True,
                       env=_env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "--q_lora" in r.stdout
    assert not any(n in r.stdout + r.stderr for n in NOISE), r.stderr[-2000:]


def test_the_libraries_notices_reach_runs_that_use_them():
    """Q-LoRA (quantization_kwargs) and DeepSpeed (process_group.init_deepspeed_comm) let their library's notices out,
    the ones held since the import. Whether a library emits its notice at all depends on the machine
    (bitsandbytes' only on CPUs with AVX512-BF16, DeepSpeed's only without an accelerator), so the child
    says which it expects; on this project's CPU machines both are expected."""
    r = _python("""
        import sys
        from types import SimpleNamespace
        import sft  # from here on the notices are held
        import torch
        import bitsandbytes
        from bitsandbytes.functional import has_avx512bf16
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        print("EXPECT:", "bnb" * has_avx512bf16(), "ds" * (get_accelerator().device_name() == "cpu"), file=sys.stderr)
        print("HELD-UNTIL-HERE", flush=True)
        print("HELD-UNTIL-HERE", file=sys.stderr, flush=True)
        from sft.distributed.process_group import init_deepspeed_comm
        from sft.model.loading import quantization_kwargs
        quantization_kwargs(torch.float32, torch.device("cpu"))
        init_deepspeed_comm(SimpleNamespace(deepspeed="ds.json", device=torch.device("cpu"), ddp_timeout=60))
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    out_before, out_after = r.stdout.split("HELD-UNTIL-HERE")
    err_before, err_after = r.stderr.split("HELD-UNTIL-HERE")
    assert not any(n in out_before + err_before for n in NOISE), r.stdout + r.stderr
    expect = err_before.split("EXPECT:")[1].split()
    if "bnb" in expect:
        assert "gemm_4bit_forward" in err_after, r.stderr[-3000:]
    if "ds" in expect:
        assert "Setting accelerator to CPU" in out_after, r.stdout[-3000:]
