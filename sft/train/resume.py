"""Which checkpoint a run resumes and what resuming it changes, decided by one call (:func:`plan_resume`) into one
frozen value (:class:`ResumePlan`): the checkpoint (``auto``: the newest every rank verifies,
:func:`sft.train.checkpoint.choose_resume`), the gradient accumulation that keeps its global batch at another world
size (:func:`sft.train.world_size.plan_world_size_change`), and how DeepSpeed's config is rebuilt for it (ZeRO's
optimizer state written at another world size is re-partitioned through a universal checkpoint,
:func:`sft.train.world_size.ensure_universal`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from sft.compat.deepspeed import separate_zero3_universal_steps
from sft.config.settings import DeepSpeedRebuild
from sft.distributed.process_group import Runtime
from sft.train.checkpoint import choose_resume, zero_world_size
from sft.train.world_size import WorldSizeChange, ensure_universal, plan_world_size_change

logger = logging.getLogger("sft")


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a run resumes.

    Fields:
        checkpoint: the checkpoint folder, or None for a fresh start.
        change: the world-size change (None: the run keeps the configured gradient accumulation).
        rebuild: how DeepSpeed's config is rebuilt (:class:`sft.config.settings.DeepSpeedRebuild`).
        universal: the universal checkpoint ZeRO's state is read from (with ``rebuild`` UNIVERSAL), else None.
    """

    checkpoint: Optional[str] = None
    change: Optional[WorldSizeChange] = None
    rebuild: DeepSpeedRebuild = DeepSpeedRebuild.NONE
    universal: Optional[str] = None

    def line(self) -> Optional[str]:
        """The one line logged about the resume's changes, or None when nothing changes."""
        if self.change is not None:
            return self.change.line(self.universal)
        if self.universal:
            return (f"resuming {self.checkpoint}: ZeRO's optimizer state re-partitioned from the universal checkpoint "
                    f"{self.universal}")
        return None


def plan_resume(output_dir: str, resume_from_checkpoint: Optional[str], overwrite_output_dir: bool,
                runtime: Runtime, saver: bool, micro_batch: int, grad_accum: int, deepspeed: bool,
                timeout_s: float) -> ResumePlan:
    """The :class:`ResumePlan` of this run: the checkpoint :func:`sft.train.checkpoint.choose_resume` takes (a
    collective: call on every rank; ``saver``: this rank writes the shared files), the world-size change for the
    ``runtime``'s world size with ``micro_batch`` samples per rank and the configured ``grad_accum``, and under
    ``deepspeed`` a universal checkpoint made (by rank 0, within ``timeout_s`` seconds for the others) when ZeRO's
    state was written at another world size.

    Raises:
        CheckpointError: ``output_dir`` has complete checkpoints but none verifies.
        ConfigError: no gradient accumulation keeps the checkpoint's global batch at ``world_size``, or the checkpoint
            was written with another sequence-parallel size.
    """
    world_size, rank = runtime.world_size, runtime.rank
    checkpoint = choose_resume(output_dir, resume_from_checkpoint, overwrite_output_dir, rank, saver)
    change = plan_world_size_change(checkpoint, world_size, micro_batch, grad_accum, runtime.sequence_parallel.size)
    rebuild = DeepSpeedRebuild.ACCUMULATION if change and deepspeed else DeepSpeedRebuild.NONE
    universal = None
    if deepspeed and checkpoint and zero_world_size(checkpoint) not in (None, world_size):
        universal = ensure_universal(checkpoint, rank, timeout_s)
        separate_zero3_universal_steps()  # ZeRO-3 loads one Adam step counter shared by every parameter group
        rebuild = DeepSpeedRebuild.UNIVERSAL
    return ResumePlan(checkpoint=checkpoint, change=change, rebuild=rebuild, universal=universal)
