"""bench/gpu_bench.py and scripts/gpu_bench.sh without a GPU: the refusal (exit 2) on a machine without CUDA,
the argument handling, the dry-run plan, the datasheet peaks. No training runs here."""
from __future__ import annotations

import subprocess

import pytest
import torch

from tests.helpers.paths import ROOT, load_bench_module


@pytest.fixture(scope="module")
def gpu_bench():
    return load_bench_module("gpu_bench")


def test_refuses_without_cuda_with_exit_2(gpu_bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_bench.main(["--rows", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--dry_run" in err


def test_dry_run_prints_every_row_and_runs_zero2_under_torchrun(gpu_bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the plan needs no GPU
    assert gpu_bench.main(["--dry_run", "--max_steps", "5", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    lines = {row: next(line for line in out.splitlines() if line.strip().startswith("$") and f"{row}.json" in line)
             for row in gpu_bench.ROWS}
    assert "--q_lora True" in lines["qlora-4bit"] and "torch.distributed.run" not in lines["qlora-4bit"]
    assert "torch.distributed.run --standalone --nproc_per_node 1" in lines["zero2"]
    assert "ds_config_zero2.json" in lines["zero2"] and "--padding_free False" in lines["bf16-padded-sdpa"]
    assert "torch.distributed.run" in lines["fsdp2"] and "--fsdp full_shard" in lines["fsdp2"]
    assert "--worker qwen-style" in lines["qwen-style"] and "--worker ours-packing" in lines["packing"]
    assert "--profile_step 2" in lines["profile"] and "--profile_step" not in lines["bf16"]
    assert "--compile_layers" in lines["compiled"] and "--compile_layers" not in lines["bf16"]
    assert "--train_flags=--lora_dropout 0" in lines["lora-dropout0"]
    assert all("--bf16" in line and "--max_steps 5" in line and "--batch 2" in line for line in lines.values())


@pytest.mark.parametrize("argv", [["--max_steps", "1"], ["--rows", "fp8"], ["--batch", "0"], ["--time_limit_s", "0"],
                                  ["--shape", "gpt-5"], ["--packing_batch", "0"]])
def test_bad_arguments_exit_2(gpu_bench, argv, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_bench.parse(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_datasheet_peaks_match_the_device_name(gpu_bench):
    assert gpu_bench.datasheet_peak("NVIDIA H100 PCIe") == 756.0
    assert gpu_bench.datasheet_peak("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_bench.datasheet_peak("NVIDIA H200") == 989.4
    assert gpu_bench.datasheet_peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_bench.datasheet_peak("Tesla T4") is None  # no bf16 tensor cores: no entry


def test_wrapper_prints_usage_without_setting_anything_up():
    p = subprocess.run(["bash", f"{ROOT}/scripts/gpu_bench.sh", "-h"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "Usage: bash scripts/gpu_bench.sh" in p.stdout and "exit 2" in p.stdout


def test_each_target_gets_a_verdict(gpu_bench):
    assert gpu_bench.verdicts({"bf16": 3000.0, "bf16-padded-sdpa": 1000.0}) == [
        "target ours default >= 1.5x --padding_free False (SmolLM2-135M): 3.00x, met"]
    assert gpu_bench.verdicts({"bf16": 9000.0, "qwen-style": 2500.0}, "qwen2.5-7b", {"bf16": 0.35}) == [
        "target ours default >= 3x Qwen-style real tokens/s (Qwen2.5-7B shape): 3.60x, met",
        "target ours default >= 40% MFU of the measured bf16 peak (Qwen2.5-7B shape): 35.0%, MISSED"]
    assert gpu_bench.verdicts({"bf16": 1000.0, "bf16-padded-sdpa": 1000.0})[0].endswith("1.00x, MISSED")
    assert "not measured" in gpu_bench.verdicts({"bf16": 1000.0})[0]
    assert all("not judged (--tiny" in v for v in gpu_bench.verdicts({"bf16": 9.0, "qwen-style": 1.0}, "qwen2.5-7b",
                                                                     {"bf16": 0.9}, tiny=True))
    from sft.model.attention import flash_varlen_available

    # torch 2.13 has varlen_attn: a GPU without the flash-attn package takes it
    assert gpu_bench.attention_path() == ("one flash-attn varlen call per layer" if flash_varlen_available()
                                          else "one torch varlen_attn call per layer")


def test_hybrid_shape_is_qwen35_at_real_width_with_both_layer_kinds(gpu_bench, capsys):
    """--shape qwen3.5-hybrid (issue 51, item 7): transformers' Qwen3.5 config at width 4096, linear and full
    attention, built on the meta device; its default rows are padding-free against padded; --tiny keeps both kinds."""
    import transformers

    kind, values = gpu_bench.SHAPES["qwen3.5-hybrid"]
    config = getattr(transformers, kind)(**values)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen3_5_text", 4096, 8)
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    kinds = {type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn).__name__
             for layer in model.model.layers}
    assert kinds == {"Qwen3_5GatedDeltaNet", "Qwen3_5Attention"}
    tiny = getattr(transformers, kind)(**{**values, **gpu_bench.TINY, **gpu_bench.TINY_SHAPE["qwen3.5-hybrid"]})
    assert tiny.layer_types == ["linear_attention", "full_attention"] and tiny.hidden_size == 64
    assert gpu_bench.parse(["--shape", "qwen3.5-hybrid"]).rows == ["bf16", "bf16-padded-sdpa"]
    assert gpu_bench.main(["--shape", "qwen3-30b-a3b-layer", "--dry_run"]) == 0
    plan = capsys.readouterr().out
    assert "--hidden 2048 --expert_dim 768 --tokens 4096" in plan and "--experts 128 --top_k 8 --r 16" in plan
    assert "--dtype bf16 --arms grouped peft ours" in plan
