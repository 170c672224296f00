#!/usr/bin/env python
"""LoRA adapter weights kept in fp32 or stored in bf16: the updates bf16 storage loses, and the loss, side by side
(a benchmark, not a test).

    .venv/bin/python bench/lora_precision.py                   # the example's model and data, 40 steps per arm
    .venv/bin/python bench/lora_precision.py --max_steps 100 --learning_rate 1e-4

Two arms train the same LoRA (r 16, alpha 32, dropout 0.05, every linear layer) on the same micro batches from the
same seed, in fp32 on this machine (bf16 matmuls are emulated on CPUs without avx512_bf16, ~1 GFLOP/s), through
``sft.app.train.trainer_for`` with AdamW:

* ``fp32``  -- adapters and AdamW's moments in fp32: what ``--bf16 True`` keeps outside DeepSpeed (peft's
  ``autocast_adapter_dtype``; the optimizer's master weights) and DeepSpeed's bf16 optimizer keeps as master copies;
* ``bf16 storage`` -- after every optimizer step the adapters and both AdamW moments are rounded to bf16, as they
  would be stored if the adapters were kept in the base model's bf16 with no fp32 master copy.

Per arm: the training loss of every step (mean of the last ``--window`` steps), the loss on ``--eval_conversations``
held-out conversations at the end, and (bf16 arm) the share of adapter elements whose update was lost to rounding
(moved in fp32 arithmetic, equal after rounding to bf16), per step, for A and B matrices separately.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, ".cache", "example")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(EXAMPLE, "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--learning_rate", type=float, default=3e-4, help="Qwen's LoRA presets use 3e-4")
    p.add_argument("--batch", type=int, default=4, help="micro batch (conversations); no gradient accumulation")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--eval_conversations", type=int, default=64)
    p.add_argument("--window", type=int, default=10, help="training loss: the mean of the last N steps")
    a = p.parse_args(argv)
    if a.max_steps < 1 or a.window < 1 or a.eval_conversations < 8:
        p.error("--max_steps and --window must be at least 1, --eval_conversations at least 8")
    return a


def round_to_bf16(trainer, lost: dict) -> None:
    """Round every trainable parameter and its AdamW moments to bf16 (in place, kept fp32 tensors), counting in
    ``lost`` the elements an update moved that rounding put back."""
    import torch

    for name, p in trainer.model.named_parameters():
        if not p.requires_grad:
            continue
        before = trainer._before[name]
        moved = p.data != before
        rounded = p.data.to(torch.bfloat16).float()
        back = moved & (rounded == before)
        kind = "A" if "lora_A" in name else "B" if "lora_B" in name else "other"
        lost[kind][0] += int(back.sum())
        lost[kind][1] += int(moved.sum())
        p.data.copy_(rounded)
        for v in trainer.optimizer.state.get(p, {}).values():
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                v.copy_(v.to(torch.bfloat16).float())


def run_arm(a, bf16_storage: bool, train_path: str, eval_path: str) -> dict:
    import torch
    from transformers import TrainerCallback

    from sft.app.train import trainer_for
    from sft.config.arguments import parse_args

    out = tempfile.mkdtemp(prefix="sft-lora-precision-")
    args = parse_args(["--model_name_or_path", a.model, "--data_path", train_path, "--eval_data_path", eval_path,
                       "--output_dir", out, "--use_lora", "True", "--lora_r", "16", "--lora_alpha", "32",
                       "--lora_dropout", "0.05", "--per_device_train_batch_size", str(a.batch),
                       "--per_device_eval_batch_size", str(a.batch), "--gradient_accumulation_steps", "1",
                       "--model_max_length", str(a.max_length), "--max_steps", str(a.max_steps),
                       "--learning_rate", str(a.learning_rate), "--lr_scheduler_type", "constant", "--weight_decay",
                       "0.0", "--optim", "adamw_torch", "--seed", "0", "--logging_steps", "1", "--save_strategy", "no",
                       "--eval_strategy", "no", "--report_to", "none", "--disable_tqdm", "True", "--bf16", "False",
                       "--train_embeddings", "false", "--gradient_checkpointing", "False",
                       "--data_cache_dir", os.path.join(tempfile.gettempdir(), "sft-lora-precision-cache")])
    trainer, _, _ = trainer_for(*args)
    lost = {"A": [0, 0], "B": [0, 0], "other": [0, 0]}

    class Storage(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            trainer._before = {n: p.data.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

        def on_step_end(self, args, state, control, **kw):
            round_to_bf16(trainer, lost)

    if bf16_storage:
        with torch.no_grad():  # start from the bf16-rounded initial adapters too
            for p in trainer.model.parameters():
                if p.requires_grad:
                    p.copy_(p.to(torch.bfloat16).float())
        trainer.add_callback(Storage())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "eval_loss": trainer.evaluate()["eval_loss"], "lost": lost}


def main(argv=None) -> int:
    a = parse(argv)
    if not os.path.exists(a.data):
        print(f"error: {a.data} not found; run: .venv/bin/python scripts/prepare_example.py", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="sft-lora-precision-data-")
    lines = open(a.data, encoding="utf-8").read().splitlines()
    n_train = a.max_steps * a.batch
    if len(lines) < n_train + a.eval_conversations:
        print(f"error: {a.data} has {len(lines)} conversations; {n_train + a.eval_conversations} needed",
              file=sys.stderr)
        return 2
    train_path, eval_path = os.path.join(work, "train.jsonl"), os.path.join(work, "eval.jsonl")
    with open(train_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines[:n_train]) + "\n")
    with open(eval_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines[-a.eval_conversations:]) + "\n")
    results = {name: run_arm(a, name == "bf16 storage", train_path, eval_path) for name in ("fp32", "bf16 storage")}
    print(f"\nLoRA r 16 / alpha 32 on {a.model}, lr {a.learning_rate:g} constant, micro batch {a.batch}, "
          f"{a.max_steps} steps, fp32 compute")
    print(f"{'arm':<14}{'first loss':>11}{f'last {a.window} steps':>15}{'eval loss':>11}"
          "   updates lost to bf16 rounding")
    for name, r in results.items():
        lost = "; ".join(f"{k} {100 * v[0] / v[1]:.1f}% of {v[1]:,}" for k, v in r["lost"].items() if v[1])
        print(f"{name:<14}{r['losses'][0]:>11.4f}{statistics.mean(r['losses'][-a.window:]):>15.4f}"
              f"{r['eval_loss']:>11.4f}   {lost or '-'}")
    print("step losses:")
    for name, r in results.items():
        print(f"  {name:<14}" + " ".join(f"{x:.3f}" for x in r["losses"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
