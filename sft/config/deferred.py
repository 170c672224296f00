"""``TrainingArguments`` whose runtime starts after parsing, not during it.

transformers 5.24's ``TrainingArguments.__post_init__`` evaluates ``self.device`` (its step "8. Device Init"), which
starts the process group through accelerate 1.15's ``PartialState`` -- under torchrun, and on CPU without
``--ddp_timeout`` (torch's default: 30 minutes). :class:`DeferredRuntime` keeps parsing free of that: from the end
of sft's own ``__post_init__`` mapping (``runtime_started`` False) until
:func:`sft.distributed.process_group.start_runtime` (called by :func:`sft.app.train.train` after validation, or at
the first use of :attr:`DeferredRuntime.device` after parsing), ``device`` is None while ``__post_init__`` runs,
and ``world_size`` / ``process_index`` / ``local_process_index`` are torchrun's ``WORLD_SIZE`` / ``RANK`` /
``LOCAL_RANK`` (1 / 0 / 0 in a single process): what the process group will have. DeepSpeed's config, which
transformers fills from ``world_size`` while parsing, therefore gets the job's world size without a process group.
Arguments never marked pending (``runtime_started`` absent) behave as transformers' own.
"""
from __future__ import annotations

import os


class DeferredRuntime:
    """Mixin placed before ``transformers.TrainingArguments`` (see the module docstring)."""

    def _runtime_pending(self) -> bool:
        return self.__dict__.get("runtime_started", True) is False

    @property
    def device(self):
        """This process's device; its first use after parsing starts the runtime
        (:func:`sft.distributed.process_group.start_runtime`: the bounded process group under torchrun)."""
        if self._runtime_pending():
            if self.__dict__.get("parsing"):
                return None  # transformers' __post_init__ evaluates it: nothing starts while parsing
            from sft.distributed.process_group import start_runtime

            start_runtime(self)
        return super().device

    def _from_env_until_started(self, name: str, env_key: str, default: str) -> int:
        if self._runtime_pending():
            value = os.environ.get(env_key, default)
            try:
                return int(value)
            except ValueError:
                from sft.errors import ConfigError

                raise ConfigError([f"environment variable {env_key}={value!r}: not an integer; torchrun sets it for "
                                   "each process (unset it to run one process)"]) from None
        return getattr(super(DeferredRuntime, self), name)  # transformers' property

    @property
    def world_size(self):
        return self._from_env_until_started("world_size", "WORLD_SIZE", "1")

    @property
    def process_index(self):
        return self._from_env_until_started("process_index", "RANK", "0")

    @property
    def local_process_index(self):
        return self._from_env_until_started("local_process_index", "LOCAL_RANK", "0")
