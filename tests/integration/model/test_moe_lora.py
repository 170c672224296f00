"""The default LoRA command on a tiny Qwen3-MoE (8 experts, top-2) from transformers' own config, through
finetune/finetune_lora_ds.sh (LoRA, ZeRO-2) on 2 CPU processes: it trains with every routed expert adapted and the
router frozen (it exited 2 before: peft refuses dropout on expert parameters), and sft-merge of the adapter gives its
logits."""
import os
import subprocess

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from sft.compat.peft import without_v4_moe_conversion
from sft.model.export import merge_adapter
from tests.helpers.families import tiny_family_dir
from tests.helpers.launchers import without_check
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port


def test_lora_ds_preset_trains_experts_router_frozen_and_merges(toy_data, tmp_path):
    model = tiny_family_dir("qwen3_moe")
    out = tmp_path / "out"
    env = pythonpath_env({**os.environ, "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
                          "PYTHON": without_check(tmp_path)})  # what is proven comes after the launcher's check
    env.pop("GPUS_PER_NODE", None)
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "finetune_lora_ds.sh"), "-m", model, "-d", toy_data,
                        "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "2",
                        "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2", "--save_strategy", "no",
                        "--model_max_length", "64", "--report_to", "none", "--disable_tqdm", "True"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    line = next(x for x in r.stderr.splitlines() if "LoRA r=64 alpha=16 dropout=0.05" in x)
    # r·E·(in + out) per expert tensor: 64·8·(32 + 32) + 64·8·(16 + 32), two layers
    assert f"experts down_proj,gate_up_proj {2 * (64 * 8 * 64 + 64 * 8 * 48):,}" in line, line
    assert "router frozen (gate)" in line
    keys = set(load_file(out / "adapter_model.safetensors"))
    assert sum(k.endswith("mlp.experts.lora_A.weight") or k.endswith("mlp.experts.base_layer.lora_A.weight")
               for k in keys) == 4  # 2 layers x (gate_up_proj, down_proj)
    assert not any(".gate." in k for k in keys)
    # sft-merge writes the experts' update into their 3-D weights: the merged model gives the adapter's logits
    merged = AutoModelForCausalLM.from_pretrained(merge_adapter(str(out), str(tmp_path / "merged")))
    with without_v4_moe_conversion():
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(out))
    ids = torch.tensor([[151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapter(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(model).state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert not torch.equal(merged.state_dict()["model.layers.0.mlp.experts.gate_up_proj"], base)
