#!/usr/bin/env python
"""Supervised fine-tuning of chat LLMs: full or LoRA, one process or many under torchrun (Qwen's entry name).

    python finetune.py --model_name_or_path MODEL_DIR --data_path data.jsonl --output_dir out --use_lora True
    torchrun --nproc_per_node 2 finetune.py ...      (one process per device; gloo on CPU)

The same as ``sft-train`` (:func:`sft.cli.train_main`): flags with ``-h``; exit 0 done, 2 a problem you can fix
(one-paragraph message; ``SFT_DEBUG=1`` shows the traceback), 75 preempted (checkpoint saved; the same command
resumes), 1 a lost node. ``sft-check`` (``python -m sft check``) takes the same flags and checks the
configuration and every data record without training.
"""
from sft.cli import train_command

if __name__ == "__main__":
    train_command()
