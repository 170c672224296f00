"""User-facing errors and the exit codes (stdlib only).

Every error a user can fix (bad flags, bad data, a missing file) is raised as a subclass of
:class:`SFTError`. :mod:`sft.policy` prints its message to stderr without a traceback and exits
with :attr:`SFTError.exit_code`; set ``SFT_DEBUG=1`` to see the traceback as well.
"""
from __future__ import annotations

import os


class SFTError(Exception):
    """An error the user can fix. ``str(err)`` is the complete message shown to the user."""

    exit_code = 2


class ConfigError(SFTError):
    """One or more command-line / YAML settings are invalid. The message lists every problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        head = "invalid configuration" if len(problems) == 1 else f"invalid configuration ({len(problems)} problems)"
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in problems))


class DataError(SFTError):
    """The data file(s) cannot be used as given. The message names file, record, id, turn and fix."""


class ContractError(SFTError):
    """The node/process environment (NNODES, NODE_RANK, MASTER_ADDR, ...) is invalid. Lists every problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n  ".join(problems) if len(problems) == 1 else
                         f"invalid launch environment ({len(problems)} problems):\n"
                         + "\n".join(f"  - {p}" for p in problems))


class PreflightError(SFTError):
    """A multi-node preflight check failed (unreachable master, missing node, duplicate rank, different inputs)."""


class TemplateError(SFTError):
    """The tokenizer's chat template cannot be used to build supervised labels."""


def explain_load_errors(what: str, path: str, fix: str):
    """Context manager: turn a library's loading failure (missing/corrupt files, unknown architecture) into an
    :class:`SFTError` naming ``path``, the library's own one-line reason, and ``fix``."""
    import contextlib
    import json

    @contextlib.contextmanager
    def _cm():
        try:
            yield
        except SFTError:
            raise
        except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError, json.JSONDecodeError) as e:
            text = str(e).strip()
            first = text.splitlines()[0][:300] if text else ""
            raise SFTError(f"{path}: cannot load the {what} ({type(e).__name__}: {first}); {fix}") from e

    return _cm()


# Exit code of a run stopped by SIGTERM/SIGINT after saving a checkpoint: sysexits.h EX_TEMPFAIL
# ("temporary failure; retry"). Job scripts requeue on it; the same command then resumes.
PREEMPTED_EXIT_CODE = 75
# Exit code when another process of the job went away or a collective timed out (torchrun's own code for a
# failed worker, so schedulers treat it as an ordinary failure).
PEER_LOST_EXIT_CODE = 1


def report_exit_code(code: int, who: str = "") -> None:
    """Append ``[who ]code`` as a line to the file named by ``SFT_EXIT_CODE_FILE`` (set by finetune/launch.sh),
    so that the launcher knows each process's code even when torchrun replaces the workers' codes with its own
    or bash's ``wait`` loses one (a signal arriving as the child exits). Nothing when the variable is unset;
    a file that cannot be written is ignored (the exit code itself is unchanged)."""
    path = os.environ.get("SFT_EXIT_CODE_FILE")
    if path:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{who + ' ' if who else ''}{code}\n")
        except OSError:
            pass
