"""Resume at another world size with the configured global batch: gradient accumulation recomputed.

A checkpoint's completion marker records the run shape that wrote it (:func:`sft.checkpoint.run_info`): world size,
micro batch (``per_device_train_batch_size``), gradient accumulation and the global batch = micro batch x gradient
accumulation x world size (samples per optimizer step; rows with ``--packing``). A run that resumes it with the same
micro batch at another world size ``W'`` trains with gradient accumulation ``global batch / (micro batch x W')`` so
that every optimizer step again consumes one global batch, and the data continues at the exact sample where the
checkpoint stopped: the data set is the same for any world size (:func:`sft.dataset.in_record_order`), the sampler's
order is a function of the seed and the epoch only (accelerate's ``SeedableRandomSampler``), accelerate deals the
micro batches of that order to the ranks in turn (``BatchSamplerShard``: micro batch ``i`` to rank ``i % W``), and
transformers' Trainer skips ``(global step mod steps per epoch) x gradient accumulation`` micro batches per rank on
resume, i.e. ``global step x global batch`` samples of the epoch's order, whatever the world size.

Refused (exit 2): a global batch that is not a multiple of micro batch x ``W'``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from .errors import ConfigError

MARKER = "sft_checkpoint_complete.json"  # sft.checkpoint.MARKER (not imported: this module stays import-light)


@dataclasses.dataclass
class WorldSizeChange:
    """A resume at another world size: ``old_world_size`` -> ``world_size`` processes, gradient accumulation
    ``old_grad_accum`` -> ``grad_accum``, with ``micro_batch`` and ``global_batch`` (samples) unchanged."""

    checkpoint: str
    old_world_size: int
    world_size: int
    micro_batch: int
    old_grad_accum: int
    grad_accum: int
    global_batch: int

    def line(self) -> str:
        """The one line logged on resume."""
        new_ranks = (f"; ranks {self.old_world_size}..{self.world_size - 1} have no RNG file in the checkpoint and "
                     "start from the RNG state --seed gives them" if self.world_size > self.old_world_size else "")
        return (f"resuming {self.checkpoint} (written at world size {self.old_world_size}) at world size "
                f"{self.world_size}: gradient accumulation {self.old_grad_accum} -> {self.grad_accum}, so micro batch "
                f"{self.micro_batch} x gradient accumulation {self.grad_accum} x world size {self.world_size} = global "
                f"batch {self.global_batch} samples as configured; optimizer, scheduler and data position carry "
                f"over{new_ranks}")


def saved_shape(checkpoint: str) -> Optional[dict]:
    """The run shape recorded in ``checkpoint``'s completion marker: ``{"world_size", "per_device_train_batch_size",
    "gradient_accumulation_steps", "global_batch"}`` (ints; ``global_batch`` computed for markers of older versions
    that lack it), or None when the marker is missing, unreadable or has no shape."""
    try:
        with open(os.path.join(checkpoint, MARKER), encoding="utf-8") as f:
            info = json.load(f)
        shape = {k: int(info[k]) for k in ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps")}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    shape["global_batch"] = int(info.get("global_batch") or shape["world_size"] * shape["per_device_train_batch_size"]
                                * shape["gradient_accumulation_steps"])
    return shape


def plan_world_size_change(checkpoint: Optional[str], world_size: int, micro_batch: int,
                           grad_accum: int) -> Optional[WorldSizeChange]:
    """What resuming ``checkpoint`` with ``world_size`` processes and ``micro_batch`` samples per rank changes.

    Returns None when nothing is recomputed: no checkpoint, no recorded shape, the same world size, or another micro
    batch than the checkpoint's (then the configured accumulation is kept and
    :func:`sft.checkpoint.warn_if_different` says the run shape changed). ``grad_accum``: the configured
    ``--gradient_accumulation_steps`` (replaced, not used, when the world size changed).

    Raises:
        ConfigError: the checkpoint's global batch is not a multiple of ``micro_batch x world_size`` (naming the
            numbers and the world sizes that keep it).
    """
    saved = saved_shape(checkpoint) if checkpoint else None
    if saved is None or saved["world_size"] == world_size or saved["per_device_train_batch_size"] != micro_batch:
        return None
    g, w0 = saved["global_batch"], saved["world_size"]
    per_step = micro_batch * world_size
    if g % per_step:
        fits = [w for w in range(1, g // micro_batch + 1) if (g // micro_batch) % w == 0] if g % micro_batch == 0 else []
        raise ConfigError([
            f"resuming checkpoint {checkpoint}: it was written at world size {w0} with micro batch {micro_batch} "
            f"x gradient accumulation {saved['gradient_accumulation_steps']} x world size {w0} = global batch {g}; "
            f"this run has world size {world_size}, and {g} is not a multiple of micro batch {micro_batch} x world "
            f"size {world_size} = {per_step}, so no gradient accumulation keeps the global batch; run with a world "
            f"size (nodes x processes per node) of {', '.join(map(str, fits)) or '(none with this micro batch)'}, or "
            "start afresh (--overwrite_output_dir True, or another --output_dir)"])
    return WorldSizeChange(checkpoint, w0, world_size, micro_batch, saved["gradient_accumulation_steps"],
                           g // per_step, g)
