"""The face: the user-facing commands, each run under the one error policy (:mod:`sft.policy`).

Commands: ``train`` (``finetune.py``, ``sft-train``), ``check`` (``sft-check``: the configuration and every data
record, exit 0 when all is well; the launcher runs it once before starting several processes), ``merge``
(``sft-merge``), ``export`` (``sft-export``: a checkpoint to a model folder), ``generate`` (``sft-generate``),
``show-sample`` (``sft-show-sample``); the Ray launcher is :func:`sft.ray.driver.main` (``sft-ray``).
Each command parses its arguments and calls one function of :mod:`sft.app` or :mod:`sft.model.export`; nothing here
knows how a job is done.

This module imports only the standard library and :mod:`sft.policy` at import time.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence

from sft.errors import SFTError
from sft.policy import debug_enabled, rank_prefix, report, run_cli  # noqa: F401  (re-exported: the policy's names)


def train(argv: Optional[Sequence[str]] = None, extra: tuple = (), step_checks: Sequence[Callable] = ()) -> str:
    """:func:`sft.app.train.train` (parse -> validate -> runtime setup -> run). Returns the output folder."""
    from sft.compat.python import collector_paused

    with collector_paused():  # torch, transformers, peft: ~4% less CPU for these imports
        from sft.app.train import train as run_training

    return run_training(argv, extra, step_checks)


def check(argv: Optional[Sequence[str]] = None, extra: tuple = ()) -> list[str]:
    """:func:`sft.app.check.check`. Returns the summary lines."""
    from sft.compat.python import collector_paused

    with collector_paused():
        from sft.app.check import check as check_argv

    return check_argv(argv, extra)


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    """``finetune.py`` / ``sft-train``: see :func:`train`, then the process group's end
    (:func:`sft.distributed.process_group.finish_process_group`). Returns the exit code."""
    def body():
        from sft.distributed.process_group import finish_process_group

        train(sys.argv[1:] if argv is None else argv)
        finish_process_group()
    return run_cli(body)


def train_command():
    """The ``sft-train`` command (and ``finetune.py``): :func:`train_main` with ``sys.argv``, then
    :func:`exit_process`. bitsandbytes is kept out of the process first when the flags need none of it
    (:func:`sft.compat.bitsandbytes.keep_out_unless_needed`: ~1 s of CPU at start-up). Never returns."""
    from sft.compat.bitsandbytes import keep_out_unless_needed

    keep_out_unless_needed(sys.argv[1:])
    exit_process(train_main())


def exit_process(code: int):
    """End this process with exit code ``code``. After a distributed run whose process group
    :func:`~sft.distributed.process_group.finish_process_group` destroyed, the process leaves without the
    interpreter's teardown (:func:`sft.compat.python.exit_skipping_teardown`: non-daemon threads joined, ``atexit``
    handlers run, stdout and stderr flushed first, as ``sys.exit`` does): under gloo, torch's communication threads
    can race that teardown and abort an otherwise finished rank ("terminate called without an active exception",
    SIGABRT, exit 134; the mechanism is described in pytorch/pytorch#179291), and torchrun then reports the whole job
    failed. Otherwise ``sys.exit(code)``. Never returns."""
    from sft.distributed.process_group import finished_cleanly

    if finished_cleanly():
        from sft.compat.python import exit_skipping_teardown

        exit_skipping_teardown(code)
    sys.exit(code)


def check_main(argv: Optional[Sequence[str]] = None) -> int:
    """``sft-check`` / ``python -m sft check``: the flags of ``train``; prints ``check: ...`` lines, exit 0 when OK."""
    def body():
        for line in check(sys.argv[1:] if argv is None else argv):
            print(f"check: {line}", file=sys.stderr, flush=True)
    return run_cli(body)


def merge_main(argv: Optional[Sequence[str]] = None) -> int:
    """``sft-merge ADAPTER_DIR OUT_DIR [--base BASE_DIR] [--overwrite]``: merge a LoRA adapter into its base model;
    the result loads offline with plain ``from_pretrained``."""
    ap = argparse.ArgumentParser(prog="sft-merge", description=merge_main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("adapter_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--base", default=None, help="base model folder (default: from adapter_config.json)")
    ap.add_argument("--overwrite", action="store_true", help="allow a non-empty OUT_DIR (a model folder only)")
    a = ap.parse_args(argv)

    def body():
        from sft.model.folders import check_merge_inputs

        check_merge_inputs(a.adapter_dir, a.out_dir, a.base, a.overwrite)  # before torch, transformers and peft load
        from sft.model.export import merge_adapter

        print(f"merged model written to {merge_adapter(a.adapter_dir, a.out_dir, a.base, a.overwrite)}")
    return run_cli(body)


def export_main(argv: Optional[Sequence[str]] = None) -> int:
    """``sft-export CHECKPOINT OUT_DIR [--merge [--base BASE_DIR] | --for vllm [--base BASE_DIR]] [--dtype auto]
    [--max_shard_size 5GB] [--overwrite]``: turn a checkpoint-N folder (DeepSpeed ZeRO-2/3 shards, FSDP2 sharded or
    full, a full model, a LoRA adapter) into a model folder that loads with plain ``from_pretrained``, verified by
    reloading it and comparing logits (or a LoRA adapter laid out for a server); an incomplete or damaged checkpoint is
    refused."""
    ap = argparse.ArgumentParser(prog="sft-export", description=export_main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--merge", action="store_true", help="a LoRA checkpoint: merge the adapter into its base model "
                    "(default: copy the adapter folder)")
    ap.add_argument("--base", default=None, help="with --merge or --for: the base model folder (default: from "
                    "adapter_config.json)")
    ap.add_argument("--for", dest="server", default=None, metavar="SERVER", help="a LoRA checkpoint: write the "
                    "adapter in that server's layout (vllm: routed experts in vLLM's 3-D expert layout; docs/moe.md)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype of the written weights (auto: the checkpoint config's dtype)")
    ap.add_argument("--max_shard_size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    ap.add_argument("--overwrite", action="store_true", help="allow a non-empty OUT_DIR (a model folder only)")
    a = ap.parse_args(argv)

    def body():
        from sft.app.export import KINDS, export_checkpoint

        done = export_checkpoint(a.checkpoint, a.out_dir, a.merge, a.base, a.overwrite, a.dtype, a.max_shard_size,
                                 a.server)
        print(f"exported {a.checkpoint} ({KINDS[done.kind]}: {done.source}) to {done.out_dir}: "
              f"{', '.join(done.files)}")
        if a.server:
            print(f"checked: every expert factor has the shape the base model's experts give in {a.server}'s layout")
        elif done.tokens:
            print(f"verified: reloaded with AutoModelForCausalLM.from_pretrained, logits on {done.tokens} tokens "
                  f"differ from the checkpoint's by at most {done.max_abs_diff:.3g} (tolerance {done.tolerance:g})")
        else:
            print("verified: every copied file has the checksum the checkpoint's completion marker recorded")
    return run_cli(body)


def generate_main(argv: Optional[Sequence[str]] = None) -> int:
    """``sft-generate MODEL_DIR "message" [--max_new_tokens 48]``: a model folder's greedy reply to one user
    message, rendered with its chat template."""
    ap = argparse.ArgumentParser(prog="sft-generate", description=generate_main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("model_dir")
    ap.add_argument("prompt")
    ap.add_argument("--max_new_tokens", type=int, default=48)
    a = ap.parse_args(argv)

    def body():
        if a.max_new_tokens < 1:
            raise SFTError(f"--max_new_tokens {a.max_new_tokens}: must be at least 1")
        if not os.path.isdir(a.model_dir):
            raise SFTError(f"{a.model_dir}: no such folder; give a model folder")
        from sft.model.export import generate_reply

        print(generate_reply(a.model_dir, a.prompt, a.max_new_tokens))
    return run_cli(body)


def show_sample_main(argv: Optional[Sequence[str]] = None) -> int:
    """``sft-show-sample MODEL_DIR DATA_FILE [--index 0] [--model_max_length N] [--system_message S]
    [--long_conversations split|truncate|refuse] [--mask_history] [--allow_dropped_content]
    [--chat_template FILE]``: print the rendered training sample(s) of one record with the supervised tokens marked
    «like this» (several when a long conversation is split or the chat template renders earlier turns differently once
    later turns exist)."""
    ap = argparse.ArgumentParser(prog="sft-show-sample", description=show_sample_main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("model_dir")
    ap.add_argument("data_file")
    ap.add_argument("--index", type=int, default=0, help="0-based index among the valid records")
    ap.add_argument("--model_max_length", type=int, default=8192)
    ap.add_argument("--system_message", default=None)
    ap.add_argument("--long_conversations", choices=["split", "truncate", "refuse"], default="split")
    ap.add_argument("--mask_history", nargs="?", const=True, default=False, type=_boolean,
                    help="train only the last reply (as sft-train's flag; a bare flag means True)")
    ap.add_argument("--allow_dropped_content", nargs="?", const=True, default=False, type=_boolean,
                    help="show a record whose text the chat template partly drops (as sft-train's flag)")
    ap.add_argument("--chat_template", default=None, help="a Jinja chat template file used instead of the "
                    "tokenizer's own (as sft-train's flag)")
    ap.add_argument("--chat_template_kwargs", default=None, help="a JSON object of extra variables for the chat "
                    "template, e.g. '{\"enable_thinking\": true}' (as sft-train's flag)")
    a = ap.parse_args(argv)

    def body():
        from sft.app.show import show_sample
        from sft.data.spec import PreparationSpec

        spec = PreparationSpec(max_len=a.model_max_length, system_message=a.system_message,
                               long_conversations=a.long_conversations, last_reply_only=a.mask_history,
                               allow_dropped_content=a.allow_dropped_content)
        for line in show_sample(a.model_dir, a.data_file, a.index, spec, color=sys.stdout.isatty(),
                                chat_template=a.chat_template, chat_template_kwargs=a.chat_template_kwargs):
            print(line)
    return run_cli(body)


def _boolean(text: str) -> bool:
    """``True`` / ``False`` as ``sft-train``'s boolean flags take them (also yes/no, 1/0)."""
    value = text.strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def ray_main(argv: Optional[Sequence[str]] = None) -> int:
    """``sft-ray``: the Ray launcher (:func:`sft.ray.driver.main`; its import needs torch, so it runs under the
    policy)."""
    def body():
        from sft.ray.driver import main

        return main(argv)
    return run_cli(body)


COMMANDS = {"train": train_main, "check": check_main, "merge": merge_main, "export": export_main,
            "generate": generate_main, "show-sample": show_sample_main, "ray": ray_main}


def command():
    """``python -m sft COMMAND [ARGS...]`` as a process: :func:`main` with ``sys.argv``, then :func:`exit_process`;
    for ``train`` and ``check``, bitsandbytes kept out first when the flags need none of it
    (:func:`sft.compat.bitsandbytes.keep_out_unless_needed`). Never returns."""
    if sys.argv[1:2] in (["train"], ["check"]):
        from sft.compat.bitsandbytes import keep_out_unless_needed

        keep_out_unless_needed(sys.argv[2:])
    exit_process(main())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m sft COMMAND [ARGS...]`` with COMMAND one of :data:`COMMANDS`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        names = " | ".join(COMMANDS)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command {argv[0]!r}; give one of: {', '.join(COMMANDS)}", file=sys.stderr)
        print(f"usage: python -m sft {{{names}}} [ARGS...]\n  train: the flags of finetune.py (-h lists them); "
              "check: the same flags, checks the configuration and every record without training",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])
