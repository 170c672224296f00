"""FSDP2 on CPU, through real processes: the fact behind the CPU limit (accelerate under torchrun with gloo keeps
FSDP off and would train with DDP) and the presets stopping on it with one line before anything loads. The
settings checks in process are in tests/unit/test_fsdp.py; what runs where is in docs/fsdp.md.
"""
import os
import subprocess
import sys

import pytest

from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port

FT = os.path.join(ROOT, "finetune")

ACCELERATE_PROBE = """
import os
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
print(f"rank {os.environ['RANK']} world {acc.num_processes} {acc.distributed_type} "
      f"fsdp_plugin={getattr(acc.state, 'fsdp_plugin', None) is not None}", flush=True)
"""


def test_accelerate_under_torchrun_on_cpu_keeps_fsdp_off(tmp_path):
    """accelerate 1.15 given an FSDP2 plugin in 2 CPU processes (gloo): MULTI_CPU, no FSDP plugin kept, so the
    Trainer would wrap the model in DDP. When this fails, accelerate has changed and the CPU rule in
    sft/validation.py (_check_fsdp) can be revisited."""
    prog = tmp_path / "probe.py"
    prog.write_text(ACCELERATE_PROBE)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", str(free_port()), str(prog)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} world 2 DistributedType.MULTI_CPU fsdp_plugin=False" in r.stdout, r.stdout


@pytest.mark.parametrize("script,extra", [
    ("finetune_fsdp.sh", []),
    ("finetune_lora_fsdp.sh", []),
    ("finetune_lora_fsdp.sh", ["--fsdp_config", os.path.join(FT, "fsdp_config_full_shard_offload.json")]),
], ids=["full", "lora", "lora-offload"])
def test_fsdp_presets_stop_on_cpu_with_one_line_before_loading(script, extra, tiny_model_dir, tmp_path):
    env = pythonpath_env({**os.environ, "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": str(free_port()), "PYTHON": sys.executable})
    env.pop("GPUS_PER_NODE", None)
    data = write_jsonl(tmp_path / "toy.jsonl", TOY)
    r = subprocess.run(["bash", os.path.join(FT, script), "-m", tiny_model_dir, "-d", data, "--output_dir",
                        str(tmp_path / "out"), *extra], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr[-3000:]
    problems = [line for line in r.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and "FSDP2 through transformers/accelerate needs GPUs" in problems[0], r.stderr
    assert "Traceback" not in r.stderr and "[rank" not in r.stderr  # stopped by the launcher's check, no torchrun
    assert not (tmp_path / "out").exists()


def test_fsdp_presets_print_their_flags():
    for script, flag in (("finetune_fsdp.sh", "--learning_rate 1e-5"), ("finetune_lora_fsdp.sh", "--use_lora True")):
        r = subprocess.run(["bash", os.path.join(FT, script), "-h"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "FSDP2" in r.stdout and flag in r.stdout, r.stdout
        assert "--fsdp --fsdp_config" in r.stdout and "fsdp_config_full_shard.json" in r.stdout
