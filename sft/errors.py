"""User-facing errors.

Every error a user can fix (bad flags, bad data, a missing file) is raised as a subclass of
:class:`SFTError`. ``finetune.py`` prints its message to stderr without a traceback and exits
with :attr:`SFTError.exit_code`; set ``SFT_DEBUG=1`` to see the traceback as well.
"""
from __future__ import annotations


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


class TemplateError(SFTError):
    """The tokenizer's chat template cannot be used to build supervised labels."""
