"""Rank-aware logging and quieter third-party output.

Also the one place that keeps optional libraries' import-time notices out of runs that do not use the
library (:func:`hold_import_notices`, :func:`release_import_notices`).
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Optional

# Notices that an optional library logs when it is merely imported, although they concern only a run
# that uses it: library -> (logger name, start of the message). Imported regardless of the run because
# peft imports bitsandbytes whenever it is installed (peft/helpers.py, reached from transformers'
# TrainingArguments via trainer_utils) and accelerate imports DeepSpeed whenever it is installed
# (accelerate.utils.other.extract_model_from_parallel, called by Trainer() and save_pretrained).
# The logger names and texts are no API: checked against bitsandbytes 0.50.2 and deepspeed 0.19.8;
# tests/integration/app/test_quiet_console.py fails when a changed one shows again.
IMPORT_NOTICES = {
    # bitsandbytes/backends/cpu/ops.py, at import on CPUs with AVX512-BF16 without the `kernels` package
    "bitsandbytes": ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
    # deepspeed/accelerator/real_accelerator.py get_accelerator(), at import when it detects no accelerator
    "deepspeed": ("DeepSpeed", "Setting accelerator to CPU"),
}


class _HeldNotice(logging.Filter):
    """On one library logger: keep records of one notice back until the run is known to use the library."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.held, self.released = prefix, [], False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.released or not str(record.msg).startswith(self.prefix):
            return True
        self.held.append(record)
        return False


def _held(library: str) -> Optional[_HeldNotice]:
    return next((f for f in logging.getLogger(IMPORT_NOTICES[library][0]).filters if isinstance(f, _HeldNotice)),
                None)


def hold_import_notices() -> None:
    """Hold back the :data:`IMPORT_NOTICES` (called when ``sft`` is imported, before anything imports the
    libraries); a run that does not use a library never shows them. Idempotent."""
    for library, (name, prefix) in IMPORT_NOTICES.items():
        if _held(library) is None:
            logging.getLogger(name).addFilter(_HeldNotice(prefix))


def release_import_notices(library: str) -> None:
    """The run uses ``library`` (a key of :data:`IMPORT_NOTICES`): show its notices held so far, and later ones."""
    notice = _held(library)
    if notice is None or notice.released:
        return
    notice.released = True
    held, notice.held = notice.held, []
    for record in held:
        logging.getLogger(record.name).handle(record)


def quiet_libraries(rank: int = 0) -> None:
    """Library noise down to what a user acts on: no weight-loading/dataset progress bars, and no
    deprecation warnings that transformers/peft raise about their own internal calls."""
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity(logging.WARNING if rank == 0 else logging.ERROR)
    transformers.utils.logging.disable_progress_bar()  # the Trainer's own bar is --disable_tqdm
    datasets.utils.logging.set_verbosity(logging.WARNING)
    datasets.disable_progress_bars()  # our own log lines say what was prepared
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # DeepSpeed 0.19's ZeRO collectives call torch names that torch 2.13 deprecates, once per call
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            "is deprecated", category=FutureWarning)


def setup_logging() -> None:
    """Logging keyed on the global rank (``RANK``): INFO on rank 0, WARNING elsewhere, prefixed with the rank."""
    rank = int(os.environ.get("RANK", "0"))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[sft rank{rank}] %(levelname)s %(message)s"))
    root = logging.getLogger("sft")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
    quiet_libraries(rank)
