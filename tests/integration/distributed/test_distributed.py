"""CPU is a real distributed run: torchrun --nproc_per_node 2 trains ONE model (gloo) on disjoint data."""
import json
import os
import subprocess
import sys

from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port


def test_two_processes_train_one_model_on_disjoint_samples(tiny_model_dir, toy_data, tmp_path):
    report = tmp_path / "report"
    report.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(ROOT, "tests", "helpers", "dist_worker.py"),
           "--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir", str(tmp_path / "out"),
           "--use_lora", "True", "--lora_r", "4", "--per_device_train_batch_size", "2", "--num_train_epochs", "1",
           "--learning_rate", "1e-2", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
           "--disable_tqdm", "True"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1", "SFT_TEST_REPORT_DIR": str(report)}))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.load(open(report / f"rank{i}.json")) for i in range(2)]
    assert [x["world_size"] for x in ranks] == [2, 2]
    a, b = set(ranks[0]["seen"]), set(ranks[1]["seen"])
    assert len(ranks[0]["seen"]) == 4 and len(ranks[1]["seen"]) == 4  # 8 samples, one epoch, 2 ranks
    assert not a & b, "ranks saw the same samples: two independent trainings"
    assert ranks[0]["digest"] == ranks[1]["digest"], "ranks ended with different weights"
    assert len(ranks[0]["losses"]) == 2  # 8 samples / global batch (2 x 2) = 2 optimizer steps
    assert "world size 2" in r.stderr and "global batch 4" in r.stderr
    assert os.path.isfile(tmp_path / "out" / "adapter_model.safetensors")

# The launcher and every preset under torchrun: tests/integration/distributed/test_deepspeed.py (the support matrix).
