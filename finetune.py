#!/usr/bin/env python
"""Supervised fine-tuning of chat LLMs: full or LoRA, one process or many under torchrun.

    python finetune.py --model_name_or_path MODEL_DIR --data_path data.jsonl --output_dir out --use_lora True
    torchrun --nproc_per_node 2 finetune.py ...      (one process per device; gloo on CPU)

Flags: ``python finetune.py -h``. Errors the user can fix exit with code 2 and a one-paragraph
message; set SFT_DEBUG=1 to also see the Python traceback.
"""
import os
import sys


def main(argv=None) -> int:
    from sft.arguments import parse_args, validate
    from sft.errors import SFTError

    try:
        model_args, data_args, training_args, lora_args = parse_args(argv)
        validate(model_args, data_args, training_args, lora_args)
        from sft.training import run

        run(model_args, data_args, training_args, lora_args)
        return 0
    except SFTError as e:
        if os.environ.get("SFT_DEBUG"):
            raise
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{prefix}error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
