"""Pre-quantized bases (sft/model/quantized.py): every refusal is decided from config.json before anything heavy
loads, exits 2 with the reason and the way on, and never suggests a wrong fix. The folders here only claim a
quantization in their config.json (the weights are the tiny fp32 model's): nothing would load them anyway.
Training on real GPTQ / bitsandbytes 4-bit folders is in tests/integration/distributed/test_deepspeed.py."""
import json
import os

import pytest

from sft.cli import check_main, merge_main, train_main
from tests.helpers.assets import with_quantization_config
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
BNB8 = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}
COMPRESSED = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
QLORA = ["--use_lora", "True", "--q_lora", "True"]
WRONG_FIX = "the folder needs a valid config.json"  # the fix for a broken plain folder, wrong for these


@pytest.fixture
def folders(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "toy.jsonl", TOY)
    made = {name: with_quantization_config(tiny_model_dir, str(tmp_path / name), cfg) for name, cfg in
            (("gptq", GPTQ), ("awq", AWQ), ("bnb8", BNB8), ("compressed", COMPRESSED), ("fp8", FP8))}
    # AutoGPTQ's layout (Qwen-7B-Chat-Int4's generation): quantize_config.json beside a plain config.json
    made["legacy"] = with_quantization_config(tiny_model_dir, str(tmp_path / "legacy"),
                                              legacy_quantize_config={"bits": 4, "group_size": 128})
    return tmp_path, made


CASES = [
    # (id, folder, extra flags, expected fragment)
    ("gptq-full-fine-tuning", "gptq", [], "a pre-quantized GPTQ 4-bit model (config.json): full fine-tuning "
     "cannot update quantized integer weights; train a LoRA adapter on it with --use_lora True --q_lora True"),
    ("gptq-lora-without-q-lora", "gptq", ["--use_lora", "True"], "LoRA on quantized weights is Q-LoRA; add "
     "--q_lora True (the base is loaded as saved, not quantized again)"),
    ("gptq-zero3", "gptq", QLORA + ["--deepspeed", os.path.join(ROOT, "finetune", "ds_config_zero3.json")],
     "the base's packed GPTQ 4-bit weights cannot be partitioned or gathered by it; use ZeRO-2"),
    ("gptq-config-beside-16bit-weights", "gptq", QLORA, "but its safetensors weights hold no quantized tensors "
     "(no *.qweight): 16-bit weights beside a GPTQ config; remove quantization_config from config.json"),
    ("legacy-quantize-config-full", "legacy", [], "a pre-quantized GPTQ 4-bit model (quantize_config.json): full"),
    ("awq-q-lora", "awq", QLORA, "a pre-quantized AWQ 4-bit model (config.json): not supported for training: "
     "LoRA on AWQ weights needs gptqmodel's AWQ kernels"),
    ("bnb-8bit-q-lora", "bnb8", QLORA, "pre-quantized bitsandbytes 8-bit model (config.json): not supported for "
     "training: sft's Q-LoRA trains on 4-bit bitsandbytes bases only"),
    ("compressed-tensors", "compressed", QLORA, "a pre-quantized compressed-tensors model (config.json): not "
     "supported for training"),
    ("fp8-full", "fp8", [], "a pre-quantized FP8 model (config.json): not supported for training"),
]


@pytest.mark.parametrize("folder,flags,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_loading(folders, capsys, folder, flags, fragment):
    d, made = folders
    rc = train_main(["--model_name_or_path", made[folder], "--data_path", f"{d}/toy.jsonl", "--output_dir",
                     f"{d}/out", "--max_steps", "1", "--report_to", "none", *flags])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert f"--model_name_or_path {made[folder]}" in err or "--deepspeed" in err
    assert fragment in err, err[-2000:]
    assert "Traceback" not in err and WRONG_FIX not in err
    assert "LoRA r=" not in err and not os.path.exists(f"{d}/out")  # nothing loaded, nothing written
    if folder != "gptq" or "--deepspeed" not in flags:  # every refused format names the 16-bit way on
        assert "16-bit" in err


def test_the_seed_command_flags_pass_the_check_on_a_gptq_folder(folders, capsys):
    """Qwen's finetune_qlora_ds.sh flags (--use_lora --q_lora, ZeRO-2) on a real GPTQ folder: no problem found
    (optimum and gptqmodel are installed); bitsandbytes is not required for a GPTQ base."""
    from tests.helpers.assets import tiny_gptq_dir

    d, _ = folders
    rc = check_main(["--model_name_or_path", tiny_gptq_dir(), "--data_path", f"{d}/toy.jsonl", "--output_dir",
                     f"{d}/out", *QLORA, "--deepspeed", os.path.join(ROOT, "finetune", "ds_config_zero2.json"),
                     "--report_to", "none"])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]


def test_gptq_without_its_packages_is_refused_with_the_install_line(folders, capsys, monkeypatch):
    import sft.model.quantized

    monkeypatch.setattr(sft.model.quantized, "importable", lambda m: m != "gptqmodel")
    d, made = folders
    rc = train_main(["--model_name_or_path", made["gptq"], "--data_path", f"{d}/toy.jsonl", "--output_dir",
                     f"{d}/out", *QLORA, "--report_to", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and "loading GPTQ weights needs gptqmodel, not installed; pip install gptqmodel" in err, err
    assert "Traceback" not in err and WRONG_FIX not in err


def test_read_quantization_kinds(folders, tiny_model_dir, tmp_path):
    from sft.model.quantized import read_quantization

    _, made = folders
    assert read_quantization(tiny_model_dir) is None
    got = {k: (q.method, q.bits, q.trainable_here) for k, v in made.items() for q in [read_quantization(v)]}
    assert got == {"gptq": ("gptq", 4, True), "legacy": ("gptq", 4, True), "awq": ("awq", 4, False),
                   "bnb8": ("bitsandbytes", 8, False), "compressed": ("compressed-tensors", None, False),
                   "fp8": ("fp8", None, False)}
    bnb4 = with_quantization_config(tiny_model_dir, str(tmp_path / "bnb4"),
                                    {"quant_method": "bitsandbytes", "_load_in_4bit": True, "load_in_4bit": True})
    assert read_quantization(bnb4).bnb_4bit and read_quantization(bnb4).label == "bitsandbytes 4-bit"
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{bad")
    assert read_quantization(str(tmp_path / "broken")) is None  # the loader's own message covers it


def test_merge_into_a_quantized_base_is_refused(folders, tmp_path, capsys):
    """An adapter whose recorded base is a GPTQ folder, and a quantized --base: exit 2 with the reason and the
    16-bit way on; the output folder is not created (no silently broken merge)."""
    _, made = folders
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": made["gptq"],
                                                             "peft_type": "LORA"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    for argv, where in (([], "recorded in the adapter's adapter_config.json"),
                        (["--base", made["awq"]], "given with --base")):
        assert merge_main([str(adapter), str(tmp_path / "merged"), *argv]) == 2
        err = capsys.readouterr().err
        assert where in err and "is a pre-quantized " in err and "pass --base with the 16-bit model" in err, err
        assert "Traceback" not in err and not (tmp_path / "merged").exists()


def test_gptq_linears_count_as_the_matrices_they_stand_for(tiny_model_dir):
    """MFU's FLOP count (4 N_frozen + 6 N_trainable) on a GPTQ base: gptqmodel's quantized linears are not
    torch.nn.Linear, and count as the same frozen weights as the 16-bit model's projections."""
    import torch
    import transformers

    from sft.train.metrics import linear_weight_counts
    from tests.helpers.assets import tiny_gptq_dir

    plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = transformers.AutoConfig.from_pretrained(tiny_gptq_dir())
    cfg.quantization_config = {**cfg.quantization_config, "backend": "torch"}
    gptq = transformers.AutoModelForCausalLM.from_pretrained(tiny_gptq_dir(), config=cfg, device_map={"": "cpu"})
    for m in (plain, gptq):
        m.requires_grad_(False)
    assert linear_weight_counts(gptq) == linear_weight_counts(plain) and linear_weight_counts(plain)[0] > 0
