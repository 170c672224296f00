"""The run's derived settings, one frozen value (:class:`RunSettings`): what a run computes once from its validated
flags, its world and the checkpoint it resumes, before and after the memory plan. :func:`sft.app.settings.derive`
builds it, :func:`sft.app.settings.with_memory_plan` completes it, and the wings read it (the checkpoint marker's run
shape, the start-up log line); ``TrainingArguments`` carries its values only because the Trainer reads its arguments
itself (:func:`sft.app.settings.apply_run_shape`, :func:`sft.app.settings.apply_memory_plan`).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional


class DeepSpeedRebuild(enum.Enum):
    """How DeepSpeed's config is rebuilt before the model loads: ``NONE`` (as transformers built it while parsing),
    ``ACCUMULATION`` (for another gradient accumulation or precision than parsing saw), ``UNIVERSAL`` (also
    ``"checkpoint": {"load_universal": true}``: ZeRO's state re-partitioned from a universal checkpoint)."""

    NONE = "none"
    ACCUMULATION = "accumulation"
    UNIVERSAL = "universal"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What a run derives from its validated flags, its world and the checkpoint it resumes.

    Fields:
        world_size: processes of the job.
        micro_batch: samples per micro batch per process (``--per_device_train_batch_size``; rows with
            ``--packing``).
        configured_grad_accum: ``--gradient_accumulation_steps`` as given (recorded in every checkpoint's marker).
        grad_accum: the gradient accumulation this run uses: the configured one, or the one that keeps a resumed
            run's global batch at another world size (:mod:`sft.train.world_size`).
        resume: the checkpoint folder the run resumes from, or None for a fresh start.
        save_total_limit: ``--save_total_limit`` (None: keep every checkpoint).
        sft_rotation: checkpoints are rotated by sft once complete (:func:`sft.train.checkpoint.callback`, to
            ``save_total_limit``) and the Trainer's own rotation, which runs before the completion marker exists,
            is off; False (a Trainer built without sft's checkpoint callback): the Trainer's.
        deepspeed_rebuild: how DeepSpeed's config is rebuilt (:class:`DeepSpeedRebuild`).
        max_tokens_per_micro_batch: the token budget per micro batch (None: no token-budget sampler); set or
            lowered by the memory plan.
        activation_checkpointing: on (set, or turned on by the memory plan because the run does not fit otherwise).
        bf16: the resolved precision: ``--bf16`` True / False, or what ``--bf16 auto`` chose, agreed by every rank
            (:func:`sft.config.precision.agreed_bf16`: fp32 everywhere when one rank lacks fast bf16).
        bf16_reason: why ``--bf16 auto`` chose (None when ``--bf16`` was True or False).
        sequence_parallel: N, ranks that share one micro batch's tokens (``--sequence_parallel_size``; 1: off).
    """

    world_size: int
    micro_batch: int
    configured_grad_accum: int
    grad_accum: int
    resume: Optional[str] = None
    save_total_limit: Optional[int] = None
    sft_rotation: bool = False
    deepspeed_rebuild: DeepSpeedRebuild = DeepSpeedRebuild.NONE
    max_tokens_per_micro_batch: Optional[int] = None
    activation_checkpointing: bool = False
    bf16: bool = False
    bf16_reason: Optional[str] = None
    sequence_parallel: int = 1

    @property
    def data_parallel_size(self) -> int:
        """Groups of ranks that read different micro batches: world size / ``sequence_parallel``."""
        return self.world_size // max(1, self.sequence_parallel)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over the job (rows with ``--packing``; at most that many under a token budget):
        data-parallel size (world size / sequence-parallel size) x micro batch x gradient accumulation. The one place
        it is computed."""
        return self.data_parallel_size * self.micro_batch * self.grad_accum
