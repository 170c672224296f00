"""The one error policy of every entry point: error -> one-paragraph message -> exit code.

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


Foundation: imports only the standard library and :mod:`sft.errors` (``python -m sft.distributed`` uses it).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Optional

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
    """Run ``body()`` under the policy (module docstring). Returns the exit code: ``body``'s when it returns an int, \
else 0.

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
