"""``TrainingArguments`` whose runtime starts after parsing, not during it.

transformers 5.24's ``TrainingArguments.__post_init__`` evaluates ``self.device`` (its step "8. Device Init"), which
starts the process group through accelerate 1.15's ``PartialState`` -- under torchrun, and on CPU without
``--ddp_timeout`` (torch's default: 30 minutes). :class:`DeferredRuntime` keeps parsing free of that: until
:func:`sft.distributed.process_group.start_runtime` (called once, by :func:`sft.app.train.begin`, after
validation), ``device`` is None and ``world_size`` / ``process_index`` / ``local_process_index`` are torchrun's
``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` (1 / 0 / 0 in a single process): what the process group will have.
DeepSpeed's config, which transformers fills from ``world_size`` while parsing, therefore gets the job's world size
without a process group. Reading a property never starts anything. Once the runtime has started, ``device`` is
transformers' own and the world size and ranks are the :class:`~sft.distributed.process_group.Runtime`'s.
"""
from __future__ import annotations

import os

from sft.distributed.process_group import current_runtime, runtime_starting
from sft.errors import ConfigError


class DeferredRuntime:
    """Mixin placed before ``transformers.TrainingArguments`` (see the module docstring)."""

    @property
    def device(self):
        """This process's device once the runtime has started; None before (nothing starts here)."""
        if not runtime_starting():
            return None  # transformers' __post_init__ evaluates it while parsing
        return super().device

    @staticmethod
    def _from_env(env_key: str, default: str) -> int:
        value = os.environ.get(env_key, default)
        try:
            return int(value)
        except ValueError:
            raise ConfigError([f"environment variable {env_key}={value!r}: not an integer; torchrun sets it for "
                               "each process (unset it to run one process)"]) from None

    @property
    def world_size(self):
        runtime = current_runtime()
        return runtime.world_size if runtime else self._from_env("WORLD_SIZE", "1")

    @property
    def process_index(self):
        runtime = current_runtime()
        return runtime.rank if runtime else self._from_env("RANK", "0")

    @property
    def local_process_index(self):
        runtime = current_runtime()
        return runtime.local_rank if runtime else self._from_env("LOCAL_RANK", "0")
