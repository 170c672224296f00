"""Resume at another world size with the configured global batch: gradient accumulation recomputed.

A checkpoint's completion marker records the run shape that wrote it (:func:`sft.train.checkpoint.run_info`): world
size, micro batch (``per_device_train_batch_size``), gradient accumulation and the global batch = micro batch x gradient
accumulation x world size (samples per optimizer step; rows with ``--packing``). A run that resumes it with the same
micro batch at another world size ``W'`` trains with gradient accumulation ``global batch / (micro batch x W')`` so that
every optimizer step again consumes one global batch, and the data continues at the exact sample where the checkpoint
stopped: the data set is the same for any world size (:func:`sft.data.store.dataset.in_record_order`), the sampler's
order is a function of the seed and the epoch only (accelerate's ``SeedableRandomSampler``, or for padding-free micro
batches :class:`sft.train.trainer.TokenBudgetBatchSampler`), the micro batches of that order go to the ranks in turn
(accelerate's ``BatchSamplerShard``, or that sampler itself: micro batch ``i`` to rank ``i % W``), and transformers'
Trainer skips ``(global step mod steps per epoch) x gradient accumulation`` micro batches per rank on resume, i.e.
``global step x global batch`` samples of the epoch's order, whatever the world size.

The same command resumed at the world size a checkpoint was written at keeps that checkpoint's accumulation when
an earlier resume at another world size had recomputed it (an elastic job's second round at 2 nodes, or a second
resume at the new world size): the marker records the accumulation the command configured next to the one it
trained with, so the configured value is not mistaken for a wish to change the global batch.

Refused (exit 2): a global batch that is not a multiple of micro batch x ``W'``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from sft.compat.deepspeed import convert_to_universal, trainer_deepspeed_config
from sft.errors import ConfigError
from sft.fsio import atomic_write
from sft.train.integrity import MARKER, read_marker


@dataclasses.dataclass(frozen=True)
class WorldSizeChange:
    """A resume at another world size: ``old_world_size`` -> ``world_size`` processes, gradient accumulation
    ``old_grad_accum`` (the checkpoint's) -> ``grad_accum``, with ``micro_batch`` and ``global_batch`` (samples)
    unchanged. At the same world size (``old_world_size == world_size``): ``old_grad_accum`` is the configured
    accumulation, replaced by the checkpoint's ``grad_accum``."""

    checkpoint: str
    old_world_size: int
    world_size: int
    micro_batch: int
    old_grad_accum: int
    grad_accum: int
    global_batch: int

    def line(self, universal: Optional[str] = None) -> str:
        """The one line logged on resume; ``universal``: the universal checkpoint DeepSpeed ZeRO's state is read
        from, if any."""
        via = (f" (ZeRO's optimizer state re-partitioned from the universal checkpoint {universal})"
               if universal else "")
        if self.old_world_size == self.world_size:
            return (f"resuming {self.checkpoint} at the world size {self.world_size} it was written at, with its "
                    f"gradient accumulation {self.grad_accum} (set by an earlier resume at another world size) instead "
                    f"of the configured {self.old_grad_accum}, so micro batch {self.micro_batch} x gradient "
                    f"accumulation {self.grad_accum} x world size {self.world_size} = global batch {self.global_batch} "
                    f"samples as configured; optimizer, scheduler and data position carry over")
        new_ranks = (f"; ranks {self.old_world_size}..{self.world_size - 1} have no RNG file in the checkpoint and "
                     "start from the RNG state --seed gives them" if self.world_size > self.old_world_size else "")
        return (f"resuming {self.checkpoint} (written at world size {self.old_world_size}) at world size "
                f"{self.world_size}: gradient accumulation {self.old_grad_accum} -> {self.grad_accum}, so micro batch "
                f"{self.micro_batch} x gradient accumulation {self.grad_accum} x world size {self.world_size} = global "
                f"batch {self.global_batch} samples as configured; optimizer, scheduler and data position carry "
                f"over{via}{new_ranks}")


def saved_shape(checkpoint: str) -> Optional[dict]:
    """The run shape recorded in ``checkpoint``'s completion marker: ``{"world_size", "per_device_train_batch_size",
    "gradient_accumulation_steps", "global_batch", "configured_gradient_accumulation_steps", "sequence_parallel_size"}``
    (ints; ``global_batch`` computed for markers of older versions that lack it; the configured accumulation None and
    the sequence-parallel size 1 for those), or None when
    the marker is missing, unreadable or has no shape."""
    info, _ = read_marker(checkpoint, MARKER)
    try:
        shape = {k: int(info[k]) for k in ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps")}
    except (ValueError, KeyError, TypeError):  # no marker (None), or one without a run shape
        return None
    shape["global_batch"] = int(info.get("global_batch") or shape["world_size"] * shape["per_device_train_batch_size"]
                                * shape["gradient_accumulation_steps"])
    configured = info.get("configured_gradient_accumulation_steps")
    shape["configured_gradient_accumulation_steps"] = int(configured) if isinstance(configured, int) else None
    sp = info.get("sequence_parallel_size")
    shape["sequence_parallel_size"] = int(sp) if isinstance(sp, int) and sp > 0 else 1
    return shape


def plan_world_size_change(checkpoint: Optional[str], world_size: int, micro_batch: int,
                           grad_accum: int, sequence_parallel: int = 1) -> Optional[WorldSizeChange]:
    """What resuming ``checkpoint`` with ``world_size`` processes and ``micro_batch`` samples per rank changes.

    Returns None when nothing is recomputed: no checkpoint, no recorded shape, another micro batch than the
    checkpoint's, or the same world size with the accumulation the checkpoint trained with or with another one than
    its run configured (then the configured accumulation is kept and :func:`sft.train.checkpoint.warn_if_different` says
    the run shape changed). ``grad_accum``: the configured ``--gradient_accumulation_steps`` (replaced, not used,
    when the world size changed, and at the same world size when it is the one the checkpoint's run configured but
    that run trained with another: the same command, after a resume at another world size recomputed it).

    Under sequence parallelism (``sequence_parallel`` N > 1, the checkpoint's own) the sizes compared and reported
    are the data-parallel ones (world size / N): the ranks of a group share a micro batch.

    Raises:
        ConfigError: the checkpoint's global batch is not a multiple of ``micro_batch x world_size`` (naming the
            numbers and the world sizes that keep it); the checkpoint was written with another
            ``--sequence_parallel_size``.
    """
    saved = saved_shape(checkpoint) if checkpoint else None
    if saved is None:
        return None
    if saved["sequence_parallel_size"] != sequence_parallel:
        raise ConfigError([f"resuming checkpoint {checkpoint}: it was written with --sequence_parallel_size "
                           f"{saved['sequence_parallel_size']}, this run has {sequence_parallel}; resume with "
                           f"--sequence_parallel_size {saved['sequence_parallel_size']} (the micro batches each group "
                           "reads depend on it), or start afresh (--overwrite_output_dir True, or another "
                           "--output_dir)"])
    if saved["per_device_train_batch_size"] != micro_batch:
        return None
    world_size //= sequence_parallel
    g, w0 = saved["global_batch"], saved["world_size"] // sequence_parallel
    if w0 == world_size:
        if saved["configured_gradient_accumulation_steps"] != grad_accum or saved["gradient_accumulation_steps"] == \
                grad_accum:
            return None
        return WorldSizeChange(checkpoint, w0, world_size, micro_batch, grad_accum,
                               saved["gradient_accumulation_steps"], g)
    per_step = micro_batch * world_size
    if g % per_step:
        fits = ([w for w in range(1, g // micro_batch + 1) if (g // micro_batch) % w == 0]
                if g % micro_batch == 0 else [])
        raise ConfigError([
            f"resuming checkpoint {checkpoint}: it was written at world size {w0} with micro batch {micro_batch} "
            f"x gradient accumulation {saved['gradient_accumulation_steps']} x world size {w0} = global batch {g}; "
            f"this run has world size {world_size}, and {g} is not a multiple of micro batch {micro_batch} x world "
            f"size {world_size} = {per_step}, so no gradient accumulation keeps the global batch; run with a world "
            f"size (nodes x processes per node) of {', '.join(map(str, fits)) or '(none with this micro batch)'}, or "
            "start afresh (--overwrite_output_dir True, or another --output_dir)"])
    return WorldSizeChange(checkpoint, w0, world_size, micro_batch, saved["gradient_accumulation_steps"],
                           g // per_step, g)


UNIVERSAL_LATEST = "latest_universal"  # deepspeed.checkpoint.ds_to_universal writes it next to the universal folder


def universal_tag(checkpoint: str) -> Optional[str]:
    """The universal checkpoint folder's name inside ``checkpoint`` (``global_stepN_universal``) when its
    ``latest_universal`` names an existing folder, else None."""
    try:
        with open(os.path.join(checkpoint, UNIVERSAL_LATEST), encoding="utf-8") as f:
            tag = f.read().strip()
    except OSError:
        return None
    return tag if tag and os.path.isdir(os.path.join(checkpoint, tag)) else None


def ensure_universal(checkpoint: str, rank: int, timeout_s: float, poll_s: float = 0.5) -> str:
    """Make ``checkpoint`` (a DeepSpeed ZeRO checkpoint: ``global_stepN/`` with one optimizer shard per data-parallel
    rank) loadable at any world size: global rank 0 converts it with ``deepspeed.checkpoint.ds_to_universal`` (every
    parameter's fp32 weights and Adam moments unpartitioned, under ``global_stepN_universal/``; a few seconds for a
    LoRA adapter, about the checkpoint's optimizer size in extra disk), writing into a temporary folder that is
    renamed into place before ``latest_universal`` is written (atomically), so a killed conversion leaves nothing that
    looks complete. The checkpoint's own files are not changed. Other ranks wait for ``latest_universal`` on the file
    system (not in a collective), up to ``timeout_s`` seconds. A checkpoint already converted is used as it is.
    Returns the universal folder's name.

    Raises:
        ConfigError: the conversion failed (DeepSpeed's reason) or did not finish within ``timeout_s`` seconds.
    """
    import time

    tag = universal_tag(checkpoint)
    if tag:
        return tag
    if rank == 0:
        _convert(checkpoint)
        return universal_tag(checkpoint)
    start = time.monotonic()
    while not universal_tag(checkpoint):
        if time.monotonic() - start > timeout_s:
            raise ConfigError([f"resuming {checkpoint} at another world size: rank 0's conversion to a DeepSpeed "
                               f"universal checkpoint did not finish within --ddp_timeout {timeout_s:g} s; look at "
                               "rank 0's log"])
        time.sleep(poll_s)
    return universal_tag(checkpoint)


def _convert(checkpoint: str) -> None:
    import contextlib
    import glob
    import io
    import shutil

    steps = sorted(p for p in glob.glob(os.path.join(checkpoint, "global_step*"))
                   if os.path.isdir(p) and not p.endswith("_universal"))
    if not steps:
        raise ConfigError([f"resuming {checkpoint} at another world size: it has no DeepSpeed global_step* folder"])
    step = os.path.basename(steps[-1])
    tmp = os.path.join(checkpoint, f".universal-tmp-{os.getpid()}")
    out = os.path.join(tmp, f"{step}_universal")

    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):  # its progress bars and prints
            convert_to_universal(steps[-1], out)
        os.replace(out, os.path.join(checkpoint, f"{step}_universal"))
        latest = os.path.join(checkpoint, UNIVERSAL_LATEST)
        atomic_write(latest, f"{step}_universal", tmp=latest + ".tmp")
    except Exception as e:  # noqa: BLE001 - DeepSpeed's reason, in one paragraph
        last = [x for x in said.getvalue().splitlines() if x.strip()][-3:]
        raise ConfigError([f"resuming {checkpoint} at another world size: converting it to a DeepSpeed universal "
                           f"checkpoint failed: {type(e).__name__}: {e} ({' | '.join(last)}); resume at its own world "
                           "size instead"]) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def deepspeed_config_objects(training_args, load_universal: bool = False):
    """transformers' DeepSpeed config and accelerate's plugin rebuilt from the user's config (file or dict, left
    unmodified) with ``training_args``' current gradient accumulation and global batch filled in (its ``"auto"``
    values), and ``"checkpoint": {"load_universal": true}`` when ``load_universal`` (a resume whose ZeRO state was
    partitioned at another world size: :func:`ensure_universal`; install
    :func:`sft.compat.deepspeed.separate_zero3_universal_steps` too, without which ZeRO-3 full fine-tuning resumed
    with Adam's bias correction of a later step). Returns ``(hf_deepspeed_config, deepspeed_plugin)``, which
    :func:`sft.app.settings.apply_run_shape` puts on ``training_args`` before the Trainer is built."""
    import copy

    value = training_args.deepspeed  # the user's file path or dict: left unmodified
    if isinstance(value, dict):
        config = copy.deepcopy(value)
    else:
        with open(value, encoding="utf-8") as f:
            config = json.load(f)
    if load_universal:
        config["checkpoint"] = {**(config.get("checkpoint") or {}), "load_universal": True}
    return trainer_deepspeed_config(config, training_args)
