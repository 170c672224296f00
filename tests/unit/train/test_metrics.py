"""Throughput callback (tokens, padding, MFU, memory, ETA; console + TensorBoard) and the loss-curve PNG: the FLOP
convention, the matmul peak (and that measuring it leaves the training's RNG alone), the checks. The figures of a
training run are in tests/integration/train/test_metrics.py."""
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sft.app.validation import validate
from sft.config.arguments import parse_args
from sft.errors import ConfigError
from sft.train.metrics import (
    ThroughputCallback,
    format_eta,
    linear_weight_counts,
    measure_matmul_peak,
    model_flops_per_token,
    plot_loss_curve,
)

# tests/helpers/assets.py tiny Qwen2: hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads,
# vocab 151646, tied
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
    torch.manual_seed(3)
    before = torch.get_rng_state()
    peak = measure_matmul_peak(torch.float32, n=256, seconds=0.05)
    assert 1e8 < peak < 1e15  # FLOP/s of a CPU core or more, and not absurd
    measure_matmul_peak(torch.float32, seconds=0.05)  # sizes chosen by timing: a speed-dependent number of draws
    assert torch.equal(torch.get_rng_state(), before)  # LoRA dropout's masks do not depend on the machine's speed
    assert format_eta(3725.4) == "1:02:05" and format_eta(-3) == "0:00:00"


def global_rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def assert_same_rng(before, after):
    assert torch.equal(before[0], after[0]), "the global torch RNG was drawn from"
    assert before[1] == after[1] and np.array_equal(before[2], after[2])


@pytest.mark.parametrize("n,seconds", [(256, 0.01), (512, 0.01), (None, 0.02)], ids=["n256", "n512", "sized"])
def test_matmul_peak_leaves_the_global_rng_alone(n, seconds):
    """Issue 17: the peak was measured on operands from the global RNG, on rank 0 only and after the Trainer's
    seeding; the size the timing picks varies with the load, so rank 0's dropout masks (LoRA) differed between
    same-seed runs. Whatever size is used, the global RNG must be where it was."""
    torch.manual_seed(0)
    before = global_rng_states()
    measure_matmul_peak(torch.float32, n=n, seconds=seconds)
    assert_same_rng(before, global_rng_states())


def test_throughput_callback_train_begin_on_rank_0_leaves_the_global_rng_alone():
    """The seam where the draw happened: on_train_begin measures the peak on global rank 0 (no --peak_tflops)."""
    cb = ThroughputCallback(torch.nn.Linear(4, 4))
    torch.manual_seed(0)
    before = global_rng_states()
    cb.on_train_begin(SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(is_world_process_zero=True,
                      global_step=0), None)
    assert cb.peak_flops and cb.peak_flops > 0  # it did measure
    assert_same_rng(before, global_rng_states())


def test_loss_curve_needs_a_loss(tmp_path):
    assert plot_loss_curve([{"step": 1, "learning_rate": 0.1}], str(tmp_path)) is None
    assert plot_loss_curve([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "eval_loss": 1.7}],
                           str(tmp_path)) == str(tmp_path / "loss_curve.png")


def test_bad_peak_tflops_is_reported(tiny_model_dir, toy_data, tmp_path):
    with pytest.raises(ConfigError, match="--peak_tflops"):
        validate(*parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir",
                              str(tmp_path / "o"), "--peak_tflops", "-1"]))


def test_the_peak_comes_from_the_flag_then_the_environment(monkeypatch, tiny_model_dir, toy_data, tmp_path):
    from sft.train.metrics import given_peak_tflops

    monkeypatch.setenv("SFT_PEAK_TFLOPS", "312")
    assert given_peak_tflops(989.0) == (989.0, "--peak_tflops")
    assert given_peak_tflops(None) == (312.0, "SFT_PEAK_TFLOPS")
    monkeypatch.setenv("SFT_PEAK_TFLOPS", "fast")
    with pytest.raises(ConfigError, match="SFT_PEAK_TFLOPS='fast': must be a positive number"):
        validate(*parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir",
                              str(tmp_path / "o")]))
    monkeypatch.delenv("SFT_PEAK_TFLOPS")
    assert given_peak_tflops(None) == (None, None)  # measured at train start


def test_packed_rows_count_their_pad_document_as_padding():
    from sft.data.batches.packing import PackedCollator
    from sft.train.metrics import packed_padding

    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]},
            {"input_ids": [5, 0, 7], "labels": [5, 0, 7], "position_ids": [0, 1, 2]}]  # pad id 0 inside a document
    batch = PackedCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].shape == (2, 5)
    assert packed_padding(batch["input_ids"], batch["position_ids"], 0).item() == 2  # row 2's pad document only
    assert packed_padding(batch["input_ids"], batch["position_ids"], None).item() == 0
    full = PackedCollator(pad_token_id=0)(rows[:1])
    assert packed_padding(full["input_ids"], full["position_ids"], 0).item() == 0  # no padding


def test_the_peak_memory_restarts_after_loading():
    """The load peak is not carried into the step figures: after reset_peak_memory the peak RSS starts from what is
    in use now (Linux VmHWM), so 300 MiB touched and freed before the reset no longer counts."""
    from sft.train.metrics import peak_memory_bytes, reset_peak_memory

    block = b"x" * (300 * 2**20)  # touched pages
    del block
    kind, before = peak_memory_bytes()
    assert kind == "peak RSS" and reset_peak_memory()
    _, after = peak_memory_bytes()
    assert after < before - 200 * 2**20, (before, after)
