"""The MoE aux loss weighs the same at world size 1 and 2 (sft/model/routing.py ``weighted_aux``): a tiny Qwen3-MoE
(tests/helpers/families.py), full fine-tuning, one SGD step on 2 identical conversations, with the aux loss at
coefficient 1 (so that it moves the routers visibly): one process with both in its micro batch (trained here, in this
process: the same Trainer without a process group, and without a second interpreter's imports), and two processes
with one each (DDP over gloo, torchrun), give the same weights. transformers' own ``coef x aux`` per micro batch would
count it twice at world size 2 (the in-process gradient-accumulation test in tests/unit/model/test_moe_routing.py
shows the same growth at 4 micro batches)."""
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.helpers.data import write_jsonl
from tests.helpers.families import tiny_family_dir
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port
from tests.integration.app.test_train import train

ATOL = 1e-5  # fp32; the two ranks' gradients averaged vs one micro batch's sum: another order of additions
LINE = "routing: aux loss coefficient 1 (--moe_aux_loss_coef"


def test_aux_loss_update_same_at_world_size_1_and_2(tmp_path, caplog):
    model = tiny_family_dir("qwen3_moe")
    turn = [{"role": "user", "content": "what comes after 41?"}, {"role": "assistant", "content": "42 comes after 41."}]
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "messages": turn} for i in range(2)])

    def flags(nproc):
        return ["--data_cache_dir", str(tmp_path / f"cache{nproc}"), "--per_device_train_batch_size", str(3 - nproc),
                "--max_steps", "1", "--optim", "sgd", "--learning_rate", "0.5", "--lr_scheduler_type", "constant",
                "--moe_aux_loss_coef", "1.0", "--save_strategy", "no", "--report_to", "none", "--seed", "7"]

    caplog.set_level("INFO")
    train(model, data, tmp_path / "w1", *flags(1))
    assert LINE in caplog.text
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", str(free_port()), os.path.join(ROOT, "finetune.py"),
                        "--model_name_or_path", model, "--data_path", data, "--output_dir", str(tmp_path / "w2"),
                        *flags(2)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert r.returncode == 0, r.stderr[-4000:]
    assert LINE in r.stderr
    weights = {n: load_file(str(tmp_path / f"w{n}" / "model.safetensors")) for n in (1, 2)}
    before = load_file(os.path.join(model, "model.safetensors"))
    gate = "model.layers.0.mlp.gate.weight"
    assert (weights[1][gate] - before[gate]).abs().max() > 100 * ATOL  # the step moved the router
    assert weights[1].keys() == weights[2].keys()
    for name, w in weights[1].items():
        torch.testing.assert_close(weights[2][name], w, rtol=0, atol=ATOL, msg=name)
