"""Throughput callback (tokens, padding, MFU, memory, ETA; console + TensorBoard) and the loss-curve PNG."""
import glob

import pytest
import torch
from transformers import AutoModelForCausalLM

from sft.arguments import parse_args, validate
from sft.callbacks import (ThroughputCallback, format_eta, linear_weight_counts, measure_matmul_peak,
                           model_flops_per_token, plot_loss_curve)
from sft.errors import ConfigError
from sft.training import build_trainer

# tests/helpers/assets.py tiny Qwen2: hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 151646, tied
PER_LAYER = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate/up/down
LINEAR = 2 * PER_LAYER + 64 * 151646  # + lm_head (a Linear, tied to the embeddings)


def test_flop_convention_full_and_lora(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert linear_weight_counts(model) == (0, LINEAR)
    assert model_flops_per_token(model) == 6 * LINEAR
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    # LoRA adds A (r x in) and B (out x r) per adapted linear: r * (in + out)
    adapters = 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + 3 * (64 + 128))
    assert linear_weight_counts(lora) == (LINEAR, adapters)
    assert model_flops_per_token(lora) == 4 * LINEAR + 6 * adapters


def test_matmul_peak_and_eta_format():
    peak = measure_matmul_peak(torch.float32, n=256, seconds=0.05)
    assert 1e8 < peak < 1e15  # FLOP/s of a CPU core or more, and not absurd
    assert format_eta(3725.4) == "1:02:05" and format_eta(-3) == "0:00:00"


def test_callback_figures_agree_with_independent_count(tiny_model_dir, toy_data, tmp_path, capsys, monkeypatch):
    out, logdir = tmp_path / "out", tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))  # transformers 5: where TensorBoard writes
    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir", str(out),
                       "--report_to", "tensorboard", "--save_strategy", "no",
                       "--logging_steps", "2", "--seed", "0", "--disable_tqdm", "True", "--use_lora", "True",
                       "--lora_r", "4", "--max_steps", "4", "--per_device_train_batch_size", "3",
                       "--peak_tflops", "0.002"])
    validate(*args)
    trainer, tok, _ = build_trainer(*args)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ThroughputCallback))
    batches = []
    collate = trainer.data_collator

    def counting(features):  # independent count: what the collator hands the model
        b = collate(features)
        batches.append((int(b["attention_mask"].sum()), b["attention_mask"].numel()))
        return b

    trainer.data_collator = counting
    trainer.train()
    wins = cb.windows
    assert len(wins) == 2 and [w["steps"] for w in wins] == [2, 2]
    used = batches[:4]  # 4 steps of one micro batch; the data loader may have prefetched one more
    assert sum(w["real"] for w in wins) == sum(r for r, _ in used)
    assert sum(w["total"] for w in wins) == sum(t for _, t in used)
    assert sum(r for r, _ in used) < sum(t for _, t in used)  # the toy batches are padded
    logged = [h for h in trainer.state.log_history if "loss" in h]
    for w, h in zip(wins, logged):
        assert h["real_tokens_per_s"] == pytest.approx(w["real"] / w["seconds"])
        assert h["padding_ratio"] == pytest.approx(1 - w["real"] / w["total"])
        assert h["mfu"] == pytest.approx(model_flops_per_token(trainer.model) * h["real_tokens_per_s"] / 2e9)
        assert 0.01 < h["peak_mem_gib"] < 64
    assert logged[-1]["eta_s"] == 0 and logged[0]["eta_s"] > 0
    assert "real_tokens_per_s" in capsys.readouterr().out  # the console log line carries the figures
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(logdir / "**" / "events.out.tfevents.*"), recursive=True)[0])
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/real_tokens_per_s", "train/padding_ratio", "train/mfu", "train/peak_mem_gib", "train/eta_s"} <= tags
    assert [round(e.value, 3) for e in acc.Scalars("train/padding_ratio")] == [
        round(h["padding_ratio"], 3) for h in logged]
    png = out / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[:2] == (400, 700)


def test_loss_curve_needs_a_loss(tmp_path):
    assert plot_loss_curve([{"step": 1, "learning_rate": 0.1}], str(tmp_path)) is None
    assert plot_loss_curve([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "eval_loss": 1.7}],
                           str(tmp_path)) == str(tmp_path / "loss_curve.png")


def test_bad_peak_tflops_is_reported(tiny_model_dir, toy_data, tmp_path):
    with pytest.raises(ConfigError, match="--peak_tflops"):
        validate(*parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir",
                              str(tmp_path / "o"), "--peak_tflops", "-1"]))
