"""Throughput callback in a training run: tokens, padding, MFU, memory and ETA on the console and in TensorBoard
agree with an independent count, and the loss-curve PNG is written. The FLOP convention, the matmul peak and
the checks are in tests/unit/train/test_metrics.py."""
import glob

import pytest

from sft.app.train import save, trainer_for
from sft.config.arguments import parse_args
from sft.train.metrics import ThroughputCallback, head_flops_per_token, model_flops_per_token


def test_callback_figures_agree_with_independent_count(tiny_model_dir, toy_data, tmp_path, capsys, monkeypatch):
    out, logdir = tmp_path / "out", tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))  # transformers 5: where TensorBoard writes
    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir", str(out),
                       "--report_to", "tensorboard", "--save_strategy", "no",
                       "--logging_steps", "2", "--seed", "0", "--disable_tqdm", "True", "--use_lora", "True",
                       "--lora_r", "4", "--max_steps", "4", "--per_device_train_batch_size", "3",
                       "--peak_tflops", "0.002",
                       "--padding_free", "False"])  # padded batches: the padding count is checked against the mask
    trainer, tok, eot = trainer_for(*args)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ThroughputCallback))
    batches = []
    collate = trainer.data_collator

    def counting(features):  # independent count: what the collator hands the model
        b = collate(features)
        batches.append((int(b["attention_mask"].sum()), b["attention_mask"].numel(),
                        int((b["labels"][:, 1:] != -100).sum())))
        return b

    trainer.data_collator = counting
    trainer.train()
    save(trainer, tok, eot, str(out))  # writes the loss curve, after the last collective
    wins = cb.windows
    assert len(wins) == 2 and [w["steps"] for w in wins] == [2, 2]
    used = batches[:4]  # 4 steps of one micro batch; the data loader may have prefetched one more
    assert sum(w["real"] for w in wins) == sum(b[0] for b in used)
    assert sum(w["total"] for w in wins) == sum(b[1] for b in used)
    assert sum(w["supervised"] for w in wins) == sum(b[2] for b in used)  # targets: labels shifted by one
    assert sum(b[0] for b in used) < sum(b[1] for b in used)  # the toy batches are padded
    logged = [h for h in trainer.state.log_history if "loss" in h]
    # the LM head runs only at supervised targets (the default --lm_head_supervised_only): its FLOPs count there
    assert trainer.supervised_head
    head = head_flops_per_token(trainer.model)
    assert 0 < head < model_flops_per_token(trainer.model)
    for w, h in zip(wins, logged):
        assert h["real_tokens_per_s"] == pytest.approx(w["real"] / w["seconds"])
        assert h["padding_ratio"] == pytest.approx(1 - w["real"] / w["total"])
        flops = (model_flops_per_token(trainer.model) - head) * w["real"] + head * w["supervised"]
        assert h["mfu"] == pytest.approx(flops / w["seconds"] / 2e9)
        assert 0.01 < h["peak_mem_gib"] < 64
    assert logged[-1]["eta_s"] == 0 and logged[0]["eta_s"] > 0
    assert cb.load_peak > 0 and cb.step_peak_separate  # Linux: the load peak apart, the steps' peak from train start
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


def test_nothing_draws_from_the_global_rng_between_the_seeding_and_the_first_step(tiny_model_dir, toy_data, tmp_path):
    """Issue 17: rank 0's callbacks ran after the Trainer's seeding and drew from the global RNG (the matmul peak,
    a load-dependent amount), so its LoRA dropout masks differed between same-seed runs. With every callback's
    on_train_begin done (this one is added last), the RNG is where transformers.set_seed(seed) put it."""
    import torch
    import transformers

    args = parse_args(["--model_name_or_path", tiny_model_dir, "--data_path", toy_data, "--output_dir",
                       str(tmp_path / "out"), "--save_strategy", "no", "--report_to", "none", "--seed", "3",
                       "--disable_tqdm", "True", "--use_lora", "True", "--lora_r", "4", "--max_steps", "1"])
    trainer, _, _ = trainer_for(*args)
    assert trainer.args.should_save  # global rank 0, where the peak is measured
    seen = {}

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["rng"] = torch.get_rng_state()

    trainer.add_callback(Probe())
    trainer.train()
    transformers.set_seed(3)
    assert torch.equal(seen["rng"], torch.get_rng_state())
