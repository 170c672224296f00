"""Rank-aware logging and quieter third-party output."""
from __future__ import annotations

import logging
import os
import sys
import warnings


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
