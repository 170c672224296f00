"""The run's derived settings (:class:`sft.config.settings.RunSettings`): computed once after the runtime has started
(:func:`derive`), completed by the memory plan (:func:`with_memory_plan`), and written onto transformers'
``TrainingArguments`` in one place, the bridge the Trainer needs because it reads its arguments itself
(:func:`apply_run_shape` before the model loads, :func:`apply_memory_plan` before the Trainer is built). Nothing
else writes ``training_args`` after validation (parsing itself resolves ``--bf16 auto`` for this process and makes
the CPU/gloo choice: :mod:`sft.config.precision`, :func:`sft.distributed.process_group.prepare_training_args`;
every rank agrees on the precision in :func:`derive`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from sft.config.precision import agreed_bf16
from sft.config.settings import DeepSpeedRebuild, RunSettings
from sft.distributed.process_group import Runtime
from sft.train.resume import ResumePlan
from sft.train.world_size import deepspeed_config_objects


def derive(training_args, runtime: Runtime, resume: ResumePlan = ResumePlan(),
           sft_rotation: bool = False) -> RunSettings:
    """The settings known before the model is loaded, from validated ``training_args`` (read only), this process's
    ``runtime`` and the :class:`~sft.train.resume.ResumePlan` (default: a fresh start). ``sft_rotation``: sft's
    checkpoint callback rotates checkpoints (:attr:`RunSettings.sft_rotation`). Under ``--bf16 auto`` every rank
    agrees on the precision here (a collective under gloo: every rank calls this at the same point)."""
    parsed = training_args.parsed
    bf16, reason = agreed_bf16(training_args.bf16, parsed.bf16, parsed.bf16_reason)
    configured = training_args.gradient_accumulation_steps
    return RunSettings(world_size=runtime.world_size, micro_batch=training_args.per_device_train_batch_size,
                       configured_grad_accum=configured,
                       grad_accum=resume.change.grad_accum if resume.change else configured,
                       resume=resume.checkpoint, save_total_limit=training_args.save_total_limit,
                       sft_rotation=sft_rotation, deepspeed_rebuild=resume.rebuild,
                       max_tokens_per_micro_batch=training_args.max_tokens_per_micro_batch,
                       activation_checkpointing=bool(training_args.activation_checkpointing),
                       bf16=bf16, bf16_reason=reason,
                       sequence_parallel=runtime.sequence_parallel.size)


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
    training_args.gradient_accumulation_steps = settings.grad_accum
    if settings.sft_rotation:
        training_args.save_total_limit = None
    rebuild = settings.deepspeed_rebuild
    if settings.bf16 != bool(training_args.bf16):  # --bf16 auto: another rank chose fp32
        training_args.bf16 = settings.bf16
        training_args.mixed_precision = ("fp16" if training_args.fp16 else "bf16" if settings.bf16 else
                                         os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
        if rebuild is DeepSpeedRebuild.NONE:
            rebuild = DeepSpeedRebuild.ACCUMULATION  # DeepSpeed's "auto" bf16.enabled follows
    if rebuild is not DeepSpeedRebuild.NONE and training_args.deepspeed:
        training_args.hf_deepspeed_config, training_args.deepspeed_plugin = deepspeed_config_objects(
            training_args, load_universal=rebuild is DeepSpeedRebuild.UNIVERSAL)


def apply_memory_plan(training_args, settings: RunSettings) -> None:
    """Write the memory plan's outcome onto ``training_args`` for the Trainer: the token budget per micro batch and
    activation checkpointing (non-reentrant when turned on here). Call before the Trainer is built."""
    training_args.max_tokens_per_micro_batch = settings.max_tokens_per_micro_batch
    if settings.activation_checkpointing and not training_args.activation_checkpointing:
        training_args.activation_checkpointing = training_args.gradient_checkpointing = True
        if training_args.activation_checkpointing_kwargs is None:
            training_args.activation_checkpointing_kwargs = training_args.gradient_checkpointing_kwargs = {
                "use_reentrant": False}
