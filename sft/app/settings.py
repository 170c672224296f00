"""The run's derived settings: computed once after validation into a frozen :class:`RunSettings`, and written onto
transformers' ``TrainingArguments`` in one place (:func:`apply_run_shape`, :func:`apply_memory_plan`).

What is derived, and from what: the gradient accumulation a resume at another world size keeps the global batch with
(:func:`sft.train.world_size.plan_world_size_change`), the checkpoint the run resumes from
(:func:`sft.train.checkpoint.choose_resume`), DeepSpeed's config rebuilt for that accumulation or for a universal
checkpoint, the checkpoint rotation moved from the Trainer to sft's (:class:`sft.train.checkpoint.AtomicCheckpoints`),
and, once the model is loaded, the memory plan's token budget per micro batch and activation checkpointing
(:func:`sft.train.memory_plan.plan_run`). The wings get these values as arguments; ``TrainingArguments`` carries
them only because the Trainer reads its arguments itself. Nothing else writes ``training_args`` after validation
(while parsing, before validation, ``--bf16 auto`` is resolved for this process and the CPU/gloo choice made: see
:mod:`sft.config.precision` and :func:`sft.distributed.process_group.prepare_training_args`; every rank agrees on
the precision in :func:`derive`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What a run derives from its validated flags, its world and the checkpoint it resumes.

    Fields:
        world_size: processes of the job.
        micro_batch: samples per micro batch per process (``--per_device_train_batch_size``).
        configured_grad_accum: ``--gradient_accumulation_steps`` as given (recorded in every checkpoint's marker).
        grad_accum: the gradient accumulation this run uses: the configured one, or the one that keeps a resumed
            run's global batch at another world size.
        resume: the checkpoint folder the run resumes from, or None for a fresh start.
        save_total_limit: ``--save_total_limit``.
        sft_rotation: checkpoints are rotated by sft once complete (:func:`sft.train.checkpoint.install`, to
            ``save_total_limit``) and the Trainer's own rotation, which runs before the completion marker exists,
            is off; False (a Trainer built without sft's checkpoint callback, as tests and benchmarks do): the
            Trainer's.
        deepspeed_rebuild: None (DeepSpeed's config as transformers built it), ``"accumulation"`` (rebuilt for
            ``grad_accum``) or ``"universal"`` (also ``"checkpoint": {"load_universal": true}``).
        max_tokens_per_micro_batch: the token budget per micro batch (None: no token-budget sampler); set or
            lowered by the memory plan.
        activation_checkpointing: on (set, or turned on by the memory plan because the run does not fit otherwise).
        bf16: the resolved precision: ``--bf16`` True / False, or what ``--bf16 auto`` chose, agreed by every rank
            (:func:`sft.config.precision.agreed_bf16`: fp32 everywhere when one rank lacks fast bf16).
        bf16_reason: why ``--bf16 auto`` chose (None when ``--bf16`` was True or False).
    """

    world_size: int
    micro_batch: int
    configured_grad_accum: int
    grad_accum: int
    resume: Optional[str] = None
    save_total_limit: Optional[int] = None
    sft_rotation: bool = False
    deepspeed_rebuild: Optional[str] = None
    max_tokens_per_micro_batch: Optional[int] = None
    activation_checkpointing: bool = False
    bf16: bool = False
    bf16_reason: Optional[str] = None

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over the job: world size x micro batch x gradient accumulation."""
        return self.world_size * self.micro_batch * self.grad_accum



def derive(training_args, resume: Optional[str] = None, grad_accum: Optional[int] = None,
           deepspeed_rebuild: Optional[str] = None, sft_rotation: bool = False) -> RunSettings:
    """The settings known before the model is loaded, from validated ``training_args`` (read only), the checkpoint
    chosen (``resume``) and, on a resume at another world size, the recomputed ``grad_accum``. Under ``--bf16 auto``
    every rank agrees on the precision here (a collective under gloo: every rank calls this at the same point)."""
    from sft.config.precision import agreed_bf16

    bf16, reason = agreed_bf16(training_args)
    return RunSettings(world_size=training_args.world_size, micro_batch=training_args.per_device_train_batch_size,
                       configured_grad_accum=training_args.gradient_accumulation_steps,
                       grad_accum=grad_accum or training_args.gradient_accumulation_steps, resume=resume,
                       save_total_limit=training_args.save_total_limit, sft_rotation=sft_rotation,
                       deepspeed_rebuild=deepspeed_rebuild,
                       max_tokens_per_micro_batch=training_args.max_tokens_per_micro_batch,
                       activation_checkpointing=bool(training_args.activation_checkpointing),
                       bf16=bf16, bf16_reason=reason)


def with_memory_plan(settings: RunSettings, budget: Optional[int], turn_on_checkpointing: bool) -> RunSettings:
    """``settings`` completed by the memory plan (:func:`sft.train.memory_plan.plan_run`): the budget it lowered an
    unset one to (None: unchanged) and activation checkpointing it turned on. A new frozen object."""
    return dataclasses.replace(settings, max_tokens_per_micro_batch=settings.max_tokens_per_micro_batch
                               if budget is None else budget,
                               activation_checkpointing=settings.activation_checkpointing or turn_on_checkpointing)


def apply_run_shape(training_args, settings: RunSettings) -> None:
    """Write the run's shape onto ``training_args`` for the Trainer (with :func:`apply_memory_plan`, the one place
    that writes it after validation): gradient accumulation, the Trainer's rotation off under ``sft_rotation``,
    the agreed precision (with transformers' ``mixed_precision`` derived from it as its ``__post_init__`` does),
    DeepSpeed's rebuilt config. Call before the model is loaded."""
    from sft.train.world_size import deepspeed_config_objects

    training_args.gradient_accumulation_steps = settings.grad_accum
    if settings.sft_rotation:
        training_args.save_total_limit = None
    rebuild = settings.deepspeed_rebuild
    if settings.bf16 != bool(training_args.bf16):  # --bf16 auto: another rank chose fp32
        training_args.bf16, training_args.bf16_reason = settings.bf16, settings.bf16_reason
        training_args.mixed_precision = ("fp16" if training_args.fp16 else "bf16" if settings.bf16 else
                                         os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
        rebuild = rebuild or "accumulation"  # DeepSpeed's "auto" bf16.enabled follows
    if rebuild and training_args.deepspeed:
        training_args.hf_deepspeed_config, training_args.deepspeed_plugin = deepspeed_config_objects(
            training_args, load_universal=rebuild == "universal")


def apply_memory_plan(training_args, settings: RunSettings) -> None:
    """Write the memory plan's outcome onto ``training_args`` for the Trainer: the token budget per micro batch and
    activation checkpointing (non-reentrant when turned on here). Call before the Trainer is built."""
    training_args.max_tokens_per_micro_batch = settings.max_tokens_per_micro_batch
    if settings.activation_checkpointing and not training_args.activation_checkpointing:
        training_args.activation_checkpointing = training_args.gradient_checkpointing = True
        if training_args.activation_checkpointing_kwargs is None:
            training_args.activation_checkpointing_kwargs = training_args.gradient_checkpointing_kwargs = {
                "use_reentrant": False}
