"""What ``--expert_parallel_size N`` cannot run with, checked before anything loads (:func:`sft.app.validation.
validate` on every rank, and the launcher's check, :func:`sft.app.check.launch_shape`, for every world size the job
may run at). Each problem is one line naming the flag, the value and the fix."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from sft.distributed.expert_parallel import check_expert_parallel_size
from sft.errors import ConfigError
from sft.model.quantized import model_folder
from sft.train.checkpoint import resolve_resume


def routed_experts_in_folder(model_dir: Optional[str]) -> Optional[set[int]]:
    """The numbers of routed experts per layer of the model whose ``config.json`` is in ``model_dir`` (its module tree
    on the meta device; empty: none), or None when the config cannot be read or built (the loader reports that)."""
    if not model_dir:
        return None
    from transformers import AutoConfig

    from sft.model.expert_parallel import routed_expert_counts
    from sft.model.token_mixers import meta_model

    try:
        return routed_expert_counts(meta_model(AutoConfig.from_pretrained(model_dir)))
    except Exception:  # noqa: BLE001 - any failure here is reported by the loader, with its own fix
        return None


def expert_parallel_problems(model_args, training_args, lora_args,
                             world_sizes: Optional[Sequence[int]] = None) -> list[str]:
    """The problems of ``--expert_parallel_size`` with these arguments (empty at 1). ``world_sizes``: the world sizes
    the job may run at; None: ``WORLD_SIZE`` in a training process, unknown (not checked) in a lone check.
    Refused: a size below 1 or not dividing a world size or a layer's routed experts; a model without routed experts;
    DeepSpeed and FSDP (they reduce or shard every gradient over the whole world, mixing the ranks' different experts);
    Q-LoRA (4-bit experts are not cut); ``--save_async`` (it stages the rank's slices, not the
    gathered experts); resuming a checkpoint (its optimizer state holds rank 0's experts only)."""
    t, n = training_args, training_args.expert_parallel_size
    flag = f"--expert_parallel_size {n}"
    if n == 1:
        return []
    if world_sizes is None:
        world_sizes = [int(os.environ["WORLD_SIZE"])] if "WORLD_SIZE" in os.environ else []
    try:
        for world in world_sizes or [None]:
            check_expert_parallel_size(n, world)
    except ConfigError as e:
        return e.problems
    p = []
    engine = f"--deepspeed {t.deepspeed}" if t.deepspeed else "--fsdp" if t.fsdp else None
    if engine:
        p.append(f"{flag} with {engine}: the engine reduces or shards every gradient over the whole world, which "
                 "would mix the ranks' different experts; expert parallelism runs with DDP (drop the engine's flag) "
                 "or use --expert_parallel_size 1")
    if lora_args.q_lora:
        p.append(f"{flag} with --q_lora True: 4-bit experts are not cut across ranks; use --q_lora False or "
                 "--expert_parallel_size 1")
    if t.save_async:
        p.append(f"{flag} with --save_async True: checkpoints gather the experts while saving; drop --save_async")
    resume = resolve_resume(t.output_dir, t.resume_from_checkpoint, t.overwrite_output_dir) if t.output_dir else None
    if resume:
        p.append(f"{flag}: resuming {resume} is not supported (its optimizer state holds rank 0's experts only); "
                 "start afresh (--overwrite_output_dir True or another --output_dir) or use --expert_parallel_size 1")
    counts = routed_experts_in_folder(model_folder(model_args.model_name_or_path))
    if counts is not None and not counts:
        p.append(f"{flag}: the model {model_args.model_name_or_path} has no routed experts (3-D expert parameters) "
                 "to spread; use --expert_parallel_size 1")
    for e in sorted(counts or ()):
        try:
            check_expert_parallel_size(n, None, e)
        except ConfigError as err:
            p += err.problems
    return p
