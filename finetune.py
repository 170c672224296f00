#!/usr/bin/env python
"""Supervised fine-tuning of chat LLMs: full or LoRA, one process or many under torchrun.

    python finetune.py --model_name_or_path MODEL_DIR --data_path data.jsonl --output_dir out --use_lora True
    torchrun --nproc_per_node 2 finetune.py ...      (one process per device; gloo on CPU)

Flags: ``python finetune.py -h``. Errors the user can fix exit with code 2 and a one-paragraph
message; set SFT_DEBUG=1 to also see the Python traceback. With SFT_CHECK_ONLY=1 the run stops
after checking the configuration and every data record (exit 0 when all is well); the launcher
does this once before starting several processes. On SIGTERM/SIGINT the run finishes its optimizer
step, saves a checkpoint and exits with 75 (sft.errors.PREEMPTED_EXIT_CODE); the same command resumes.
"""
import os
import sys


def _user_message(err: Exception) -> str:
    """The message of an SFTError; for one re-raised by a DataLoader worker, the worker's original message."""
    text = str(err)
    marker = f"{type(err).__name__}: "
    if "\nOriginal Traceback" in text and marker in text:
        return text[text.rindex(marker) + len(marker):].strip()
    return text


def main(argv=None, extra=()) -> int:
    """Run finetune.py with ``argv`` (default ``sys.argv[1:]``); returns the exit code. ``extra``: a launcher's own
    flag dataclasses (parsed and ignored here, so one command line / YAML serves both; see scripts/ray_train.py)."""
    from sft.arguments import parse_args, validate
    from sft.errors import SFTError

    training_args = None
    try:
        model_args, data_args, training_args, lora_args = parse_args(argv, extra)[:4]
        validate(model_args, data_args, training_args, lora_args)
        if os.environ.get("SFT_CHECK_ONLY"):
            from sft.training import load_data

            train, evaluation, *_ = load_data(model_args, data_args, training_args)  # records + tokenizer checks
            for path, convs in ((data_args.data_path, train), (data_args.eval_data_path, evaluation)):
                if convs is not None:
                    print(f"check: {path}: {len(convs)} valid conversations", file=sys.stderr)
            print("check: configuration and data OK", file=sys.stderr)
            return 0
        from sft.training import run

        run(model_args, data_args, training_args, lora_args)
        return 0
    except SFTError as e:
        if os.environ.get("SFT_DEBUG"):
            raise
        from sft.errors import PREEMPTED_EXIT_CODE

        if e.exit_code == PREEMPTED_EXIT_CODE:
            from sft.preemption import report_exit_code

            report_exit_code(e.exit_code)
        label = "preempted" if e.exit_code == PREEMPTED_EXIT_CODE else "error"
        print(f"{_rank_prefix()}{label}: {_user_message(e)}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # a lost node or a timed-out collective: say which node, not a 100-line traceback
        from sft.distributed import PEER_LOST_EXIT_CODE, explain_collective_failure

        message = explain_collective_failure(e, getattr(training_args, "ddp_timeout", None))
        if message is None or os.environ.get("SFT_DEBUG"):
            raise
        print(f"{_rank_prefix()}error: {message}", file=sys.stderr)
        return PEER_LOST_EXIT_CODE


def _rank_prefix() -> str:
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank not in (None, "0") else ""


if __name__ == "__main__":
    sys.exit(main())
