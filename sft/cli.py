"""The one CLI policy, and the user-facing commands built on it.

Policy (:func:`run_cli`), the same for every entry point (``finetune.py``, the ``sft-*`` console scripts,
``python -m sft COMMAND``, ``python -m sft.distributed``, the Ray launcher):

* an :class:`~sft.errors.SFTError` becomes one paragraph on stderr, ``error: <message>`` (``preempted: ...``
  for exit code 75), prefixed ``[rank N] `` on global ranks other than 0, and its exit code: 2 a problem the
  user can fix, 75 preempted (checkpoint saved; the same command resumes), 1 a lost peer
  (:class:`sft.distributed.failures.PeerLost`);
* SIGINT (Ctrl-C) and SIGTERM before a command has its own handling (training installs
  :class:`sft.train.preemption.PreemptionHandler`) stop it with one line ``interrupted by SIGINT ...`` and exit
  128 + the signal number (130, 143), after ``finally`` clauses ran (so no half-written folder is left);
* a Python that lacks a package sft needs (``ModuleNotFoundError`` outside ``sft``) is one paragraph naming the
  interpreter, the package and the fix (exit 2);
* ``SFT_DEBUG=1`` (any value but empty, 0, false, no, off) re-raises instead, so the full traceback shows;
* anything else is a bug or a library failure and keeps its traceback.

Commands: ``train`` (``finetune.py``, ``sft-train``), ``check`` (``sft-check``: the configuration and every data
record, exit 0 when all is well; the launcher runs it once before starting several processes), ``merge``
(``sft-merge``), ``generate`` (``sft-generate``), ``show-sample`` (``sft-show-sample``); the Ray launcher is
:func:`sft.ray.driver.main` (``sft-ray``).

This module imports only the standard library at import time (``python -m sft.distributed`` uses it).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Optional, Sequence

from sft.errors import PREEMPTED_EXIT_CODE, SFTError, report_exit_code


def debug_enabled() -> bool:
    """``SFT_DEBUG`` set to anything but empty, 0, false, no or off (the words ``SFT_PREFLIGHT`` takes for off too):
    show tracebacks instead of one-paragraph messages."""
    return os.environ.get("SFT_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def rank_prefix() -> str:
    """``"[rank N] "`` on global ranks other than 0 (``RANK`` from torchrun / Ray Train), else ``""``."""
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank not in (None, "0") else ""


def user_message(err: BaseException) -> str:
    """The message of an SFTError; for one re-raised by a DataLoader worker, the worker's original message."""
    text = str(err)
    marker = f"{type(err).__name__}: "
    if "\nOriginal Traceback" in text and marker in text:
        return text[text.rindex(marker) + len(marker):].strip()
    return text


def report(err: SFTError) -> int:
    """Print ``err`` the policy's way and return its exit code. The code is also appended to the file named by
    ``SFT_EXIT_CODE_FILE`` (set by finetune/launch.sh), which tells a preempted rank (75) from one that failed
    on its own (e.g. 1, a lost peer) when torchrun replaces the workers' codes with its own."""
    report_exit_code(err.exit_code)
    label = "preempted" if err.exit_code == PREEMPTED_EXIT_CODE else "error"
    print(f"{rank_prefix()}{label}: {user_message(err)}", file=sys.stderr, flush=True)
    return err.exit_code


class Interrupted(KeyboardInterrupt):
    """SIGTERM turned into an exception (as Python turns SIGINT into KeyboardInterrupt), so ``finally`` runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _sigterm_raises():
    """While the body runs: SIGTERM raises :class:`Interrupted` in this process (forked children, e.g. dataset
    workers, keep the default action). Only where SIGTERM still has its default action, on the main thread."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def missing_dependency(err: ModuleNotFoundError) -> Optional[SFTError]:
    """An SFTError for a package sft needs that this Python lacks; None for a missing module of sft itself (a bug)."""
    top = (err.name or "").split(".")[0]
    if not top or top == "sft":
        return None
    fix = ("run `bash scripts/setup_env.sh` in the sft repository once (it installs everything into its .venv) and use "
           ".venv/bin/python or the .venv/bin/sft-* commands, or install the requirements into this Python: "
           f"{sys.executable} -m pip install -r requirements.txt")
    return SFTError(f"this Python ({sys.executable}) has no package '{top}', which this command needs; {fix}")


def run_cli(body: Callable[[], Optional[int]]) -> int:
    """Run ``body()`` under the policy (module docstring). Returns the exit code: ``body``'s when it returns an int, else 0.

    Raises:
        Whatever ``body`` raises that is not an SFTError, a missing package or an interrupt, and those too when
        ``SFT_DEBUG`` is set.
    """
    try:
        with _sigterm_raises():
            code = body()
        return code if isinstance(code, int) else 0
    except SFTError as e:
        if debug_enabled():
            raise
        return report(e)
    except ModuleNotFoundError as e:
        err = missing_dependency(e)
        if err is None or debug_enabled():
            raise
        return report(err)
    except KeyboardInterrupt as e:
        if debug_enabled():
            raise
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{rank_prefix()}interrupted by {signal.Signals(signum).name}; stopped before finishing "
              f"(exit {128 + signum})", file=sys.stderr, flush=True)
        return 128 + signum


# ------------------------------------------------------------------------------------------------ commands

def train(argv: Optional[Sequence[str]] = None, extra: tuple = (), step_checks: Sequence[Callable] = ()) -> str:
    """Parse -> validate -> runtime setup -> :func:`sft.app.train.run`. Returns the output folder.

    ``extra``: a launcher's own flag dataclasses (parsed and ignored here, so one command line / YAML serves both).
    ``step_checks``: callables run on every rank at every optimizer step end (:class:`sft.train.preemption.PreemptionHandler`).

    Raises:
        SFTError: any problem the user can fix (exit code 2), ``Preempted`` (75), ``PeerLost`` (1).
    """
    from sft.config.arguments import parse_args, validate
    from sft.distributed.failures import raise_if_peer_lost
    from sft.distributed.process_group import setup_runtime
    from sft.app.train import run

    try:  # parsing starts the process group under torchrun, setup_runtime DeepSpeed's communication on it
        model_args, data_args, training_args, lora_args = parse_args(argv, extra)[:4]
        validate(model_args, data_args, training_args, lora_args)
        setup_runtime(training_args)
    except Exception as e:  # a peer lost before training: named like one lost during it (run() does that)
        raise_if_peer_lost(e, None, {})
        raise
    return run(model_args, data_args, training_args, lora_args, step_checks=step_checks)


def check_parsed(model_args, data_args, training_args, lora_args) -> list[str]:
    """Check parsed arguments and every data record without training (what ``sft-check``, the launcher and the Ray
    driver do once before starting several processes). Returns the summary lines.

    Raises:
        SFTError: the first kind of problem found (every problem of that kind is listed).
    """
    from sft.config.arguments import validate
    from sft.app.train import check_data

    validate(model_args, data_args, training_args, lora_args)
    return check_data(model_args, data_args, training_args) + ["configuration and data OK"]


def check(argv: Optional[Sequence[str]] = None, extra: tuple = ()) -> list[str]:
    """Parse ``argv`` and :func:`check_parsed` it. Returns the summary lines."""
    from sft.config.arguments import parse_args

    return check_parsed(*parse_args(argv, extra)[:4])


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    """``finetune.py`` / ``sft-train``: see :func:`train`, then the process group's end
    (:func:`sft.distributed.process_group.finish_process_group`). Returns the exit code."""
    def body():
        from sft.distributed.process_group import finish_process_group

        train(sys.argv[1:] if argv is None else argv)
        finish_process_group()
    return run_cli(body)


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
        from sft.model.export import merge_adapter

        print(f"merged model written to {merge_adapter(a.adapter_dir, a.out_dir, a.base, a.overwrite)}")
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
    [--long_conversations split|truncate]``: print the rendered training sample(s) of one record with the supervised
    tokens marked «like this» (several when a long conversation is split)."""
    ap = argparse.ArgumentParser(prog="sft-show-sample", description=show_sample_main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("model_dir")
    ap.add_argument("data_file")
    ap.add_argument("--index", type=int, default=0, help="0-based index among the valid records")
    ap.add_argument("--model_max_length", type=int, default=8192)
    ap.add_argument("--system_message", default=None)
    ap.add_argument("--long_conversations", choices=["split", "truncate"], default="split")
    a = ap.parse_args(argv)

    def body():
        from sft.data.chat import visualize
        import itertools

        from sft.data.records import RecordCheck, iter_conversations
        from sft.data.dataset import encode_samples
        from sft.model.loading import load_tokenizer

        if not os.path.isfile(os.path.join(a.model_dir, "config.json")) and not os.path.isfile(
                os.path.join(a.model_dir, "tokenizer.json")):
            raise SFTError(f"{a.model_dir}: not a model folder (no config.json or tokenizer.json)")
        if a.model_max_length < 8:
            raise SFTError(f"--model_max_length {a.model_max_length}: must be at least 8")
        if a.index < 0:
            raise SFTError(f"--index {a.index}: must be 0 or more (it counts valid records from 0)")
        check = RecordCheck(a.data_file)  # streamed up to the record asked for: a huge file is not loaded
        c = next(itertools.islice(iter_conversations(a.data_file, check), a.index, None), None)
        if c is None:
            raise SFTError(f"--index {a.index}: the file has {check.valid} valid records")
        tok, eot, _ = load_tokenizer(a.model_dir)
        samples = encode_samples(tok, [c.messages], eot, a.model_max_length, a.system_message, a.long_conversations)[0]
        for k, ex in enumerate(samples):
            part = f" sample {k + 1} of {len(samples)}:" if len(samples) > 1 else ""
            print(f"record {c.index} id={c.id}:{part} {len(ex['input_ids'])} tokens, {ex['n_supervised']} supervised"
                  + (f", truncated ({ex['n_lost']} supervised tokens lost)" if ex["truncated"] else ""))
            print(visualize(tok, ex["input_ids"], ex["labels"], color=sys.stdout.isatty()))
    return run_cli(body)


def ray_main(argv: Optional[Sequence[str]] = None) -> int:
    """``sft-ray``: the Ray launcher (:func:`sft.ray.driver.main`; its import needs torch, so it runs under the policy)."""
    def body():
        from sft.ray.driver import main

        return main(argv)
    return run_cli(body)


COMMANDS = {"train": train_main, "check": check_main, "merge": merge_main, "generate": generate_main,
            "show-sample": show_sample_main, "ray": ray_main}


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
