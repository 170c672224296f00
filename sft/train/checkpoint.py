"""Checkpoints that are complete or ignored, resume that finds them, rotation that keeps them.

transformers 5.24's ``Trainer._save_checkpoint`` writes straight into ``OUTPUT_DIR/checkpoint-N``
(model or adapter, optimizer, scheduler, one RNG file per rank, ``trainer_state.json``) with no barrier
between the ranks' files and no mark of completion, and ``get_last_checkpoint`` takes the highest N
even when its writing was killed (transformers#35782). Its ``enable_jit_checkpoint`` sentinel file is
written only for its own SIGTERM checkpoints and not read by ``get_last_checkpoint``.

Our rule (a completion marker, chosen over write-to-temp-and-rename because the Trainer, DeepSpeed and
every rank write into the final folder name themselves):

* after every rank has returned from the Trainer's save (a barrier), every rank fsyncs and hashes the files
  it wrote (:mod:`sft.train.integrity`: who hashes what, XXH3-128), and the saving process atomically writes
  :data:`MARKER` (temp file + ``os.replace``) listing every file with its size and checksum;
* a checkpoint is *complete* iff its marker exists, parses, and every listed file has its size (cheap:
  :func:`is_complete`); it is *verified* when every file also has its checksum (:func:`verify`);
* ``auto`` resume takes the verified checkpoint with the highest step (:func:`choose_resume`, the ranks agree):
  incomplete ones are skipped, a complete one that fails verification is skipped with one log line saying
  why; a checkpoint named by ``--resume_from_checkpoint PATH`` that fails verification is refused;
* under ``--save_async`` a background thread does this once the files are written (:mod:`sft.train.async_save`);
* rotation (``--save_total_limit``) is ours (the Trainer's is switched off, because it runs before the
  marker exists and could delete the last complete checkpoint while the new one is still unmarked):
  it removes a checkpoint's marker first and then its files, never removes the newest complete
  checkpoint, the newest verified one or the best one (``state.best_model_checkpoint``), and clears
  incomplete leftovers.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Optional

from transformers import TrainerCallback

from sft.config.settings import RunSettings
from sft.distributed.collectives import barrier, gather_objects
from sft.distributed.process_group import NCCL_TRACE_DIR
from sft.errors import SFTError
from sft.fsio import atomic_write_json, fsync_dir, fsync_file, read_json
from sft.train.integrity import (
    HASH,
    MARKER,
    checkpoint_files,
    file_digest,
    hash_own_files,
    owner_rank,
    read_marker,
    verify_entries,
)

logger = logging.getLogger("sft")

_CKPT = re.compile(r"^checkpoint-(\d+)$")
AUTO_VALUES = ("auto", "true")  # "true": Qwen-era scripts pass --resume_from_checkpoint True


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of every ``checkpoint-N`` folder in ``output_dir``, by step (complete or not)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


class CheckpointError(SFTError):
    """A checkpoint cannot be resumed from (every complete one failed verification) or written (out of disk space)."""


def is_complete(path: str) -> bool:
    """True iff ``path`` holds a readable :data:`MARKER` and every file it lists exists with its recorded size
    (no file is read: see :func:`verify` for the checksums)."""
    data, _ = read_marker(path, MARKER)
    try:
        return data is not None and all(
            os.path.getsize(os.path.join(path, name)) == (e if isinstance(e, int) else e["size"])
            for name, e in data["files"].items())
    except (OSError, KeyError, TypeError):
        return False


def verify(path: str, rank: Optional[int] = None, saver: bool = True) -> Optional[str]:
    """None when checkpoint ``path`` is verified (marker readable, every file present with its size and XXH3-128
    checksum), else one line saying why not. ``rank``/``saver``: check only the files that rank wrote (and the
    shared ones when ``saver``), see :mod:`sft.train.integrity`; None checks every listed file. Reads each checked file
    once (about 1 s per few GB from the page cache; bench/checkpoint_hash.py)."""
    data, why = read_marker(path, MARKER)
    return why if data is None else verify_entries(path, data["files"], rank, saver)


def latest_complete(output_dir: str) -> Optional[str]:
    """The complete checkpoint with the highest step in ``output_dir``, or None."""
    for _, path in reversed(checkpoint_dirs(output_dir)):
        if is_complete(path):
            return path
    return None


def mark_complete(path: str, info: dict, entries: Optional[dict] = None) -> dict:
    """Write :data:`MARKER` atomically into ``path``, listing every file there with its size and checksum.

    ``entries``: ``{relative path: {"size", HASH, "rank"}}`` already flushed and hashed by the ranks that wrote
    the files (:func:`sft.train.integrity.hash_own_files`); any other file under ``path`` is flushed and hashed here.
    Entries of files this process cannot see (another node's disk) are left out. ``info`` (JSON-serializable) is
    stored next to the file list, e.g. world size and batch shape. Returns the file list written.
    """
    entries = entries or {}
    files = {}
    for rel in checkpoint_files(path, (MARKER,)):
        full = os.path.join(path, rel)
        if rel in entries:
            files[rel] = entries[rel]
        else:
            fsync_file(full, ignore_errors=True)  # as always here: a failing fsync does not stop the marker
            files[rel] = {"size": os.path.getsize(full), HASH: file_digest(full), "rank": owner_rank(rel)}
    for root, _, _ in os.walk(path):
        fsync_dir(root)
    atomic_write_json(os.path.join(path, MARKER), {**info, "hash": HASH, "files": files}, indent=1,
                      tmp=os.path.join(path, f".{MARKER}.tmp"), sync_dir=True)
    return files


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint so that no crash can leave it looking complete: marker first, then the files."""
    try:
        os.remove(os.path.join(path, MARKER))
        fsync_dir(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def rotate(output_dir: str, limit: Optional[int], best: Optional[str], verified: Optional[str] = None) -> list[str]:
    """Delete checkpoints beyond ``limit`` complete ones; return the deleted paths.

    Kept: the newest complete checkpoint, the newest verified one and ``best`` always (so up to ``limit`` or 3,
    whichever is larger), then the newest complete others up to ``limit``. ``verified``: a checkpoint known to be
    verified (the one just marked, whose files were hashed just now); without it the complete checkpoints are verified
    newest first (:func:`verify`, reading their files) until one passes. Incomplete folders are deleted whenever a
    complete one exists (they can only be leftovers of a killed write; call this only right after :func:`mark_complete`,
    while no other process writes checkpoints here). ``limit`` None or <= 0 deletes nothing.
    """
    if not limit or limit <= 0:
        return []
    entries = checkpoint_dirs(output_dir)
    complete = [p for _, p in entries if is_complete(p)]
    if not complete:
        return []
    best = os.path.realpath(best) if best else None
    if verified is None:
        verified = next((p for p in reversed(complete) if verify(p) is None), None)
    verified = os.path.realpath(verified) if verified else None
    keep = {complete[-1]} | {p for p in complete if os.path.realpath(p) in (best, verified)}
    for p in reversed(complete):
        if len(keep) >= limit:
            break
        keep.add(p)
    doomed = [p for _, p in entries if p not in keep]
    for p in doomed:
        logger.info("deleting %s (--save_total_limit %d%s)", p, limit,
                    "" if p in complete else "; it was incomplete")
        remove_checkpoint(p)
    return doomed


class AtomicCheckpoints(TrainerCallback):
    """Marks each checkpoint complete once every rank has saved it, then applies ``save_total_limit``.

    Construct with the user's ``--save_total_limit``; the Trainer's own rotation (it runs before the marker exists)
    must be off (:func:`sft.app.settings.apply_run_shape`). ``saves``: the run's
    :class:`sft.train.async_save.BackgroundSaves` under ``--save_async`` (its thread writes, hashes and marks)."""

    def __init__(self, save_total_limit: Optional[int], info: dict, saves=None):
        self.save_total_limit = save_total_limit
        self.info = info
        self.saves = saves

    def on_train_begin(self, args, state, control, **kwargs):
        # Checkpoints above the step we start from belong to an abandoned history (an explicit older
        # --resume_from_checkpoint, or a killed write); they will be rewritten, so they must not look complete.
        if args.should_save:
            for step, path in checkpoint_dirs(args.output_dir):
                if step > state.global_step and os.path.exists(os.path.join(path, MARKER)):
                    logger.warning("%s is newer than the step this run starts from (%d); marking it incomplete "
                                   "(it will be overwritten)", path, state.global_step)
                    os.remove(os.path.join(path, MARKER))
        barrier()

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        info, best = {**self.info, "global_step": state.global_step}, state.best_model_checkpoint
        if self.saves is not None:
            self.saves.start(path, lambda error: self.complete(args, path, info, best, error, self.saves.group))
            return
        barrier()  # every rank's files (RNG state, shards) are written
        self.complete(args, path, info, best)

    def on_train_end(self, args, state, control, **kwargs):
        if self.saves is not None:
            self.saves.wait("end of training")

    def complete(self, args, path: str, info: dict, best: Optional[str], error: Optional[BaseException] = None,
                 group=None) -> None:
        """Every rank: flush and hash the files of checkpoint ``path`` it wrote; then the saving process marks it
        complete and rotates. ``error``: this rank's failure to write its files (a background write), shared so that
        no rank marks the checkpoint: raised on its rank, a :class:`CheckpointError` naming it on the others.
        ``group``: the background write's process group (every rank then waits for the marking and rotation)."""
        mine = {}
        if error is None:
            try:  # each rank hashes what it wrote, where it wrote it (sft.train.integrity)
                mine = hash_own_files(path, args.process_index, args.should_save, (MARKER,)) \
                    if os.path.isdir(path) else {}
            except OSError as e:
                error = e
        parts = gather_objects((mine, None if error is None else f"{type(error).__name__}: {error}"), group)
        failed = [(r, why) for r, (_, why) in enumerate(parts) if why]
        if error is not None:
            raise error
        if failed:
            r, why = failed[0]
            raise CheckpointError(f"rank {r} could not write its files of checkpoint {path} ({why}); the checkpoint "
                                  "has no completion marker and is ignored; the previous complete checkpoint is kept")
        entries = {rel: e for part, _ in parts for rel, e in part.items()}
        if args.should_save:
            mark_complete(path, {**info}, entries)
            rotate(args.output_dir, self.save_total_limit, best, verified=path)
        if group is not None:  # a background write: no rank starts the next checkpoint (a folder rotation would
            barrier(group)     # take for a leftover) before the saving process has marked and rotated this one


def run_info(settings: RunSettings, seed: int, use_lora: bool) -> dict:
    """What a checkpoint records about the run that wrote it (compared on resume), from the run's
    :class:`~sft.config.settings.RunSettings`: world size, micro batch, gradient accumulation, the configured one
    (``--gradient_accumulation_steps`` as given, before a resume at another world size replaced it), global batch
    (samples per optimizer step; kept when resuming at another world size, :mod:`sft.train.world_size`), the
    sequence-parallel size, ``seed`` and whether the run trains a LoRA adapter."""
    return {"world_size": settings.world_size, "per_device_train_batch_size": settings.micro_batch,
            "gradient_accumulation_steps": settings.grad_accum,
            "configured_gradient_accumulation_steps": settings.configured_grad_accum,
            "global_batch": settings.global_batch, "sequence_parallel_size": settings.sequence_parallel, "seed": seed,
            "use_lora": bool(use_lora)}


def callback(settings: RunSettings, seed: int, use_lora: bool, saves=None) -> AtomicCheckpoints:
    """The checkpoint callback for ``transformers.Trainer(callbacks=[...])``: every checkpoint marked complete with
    the run's :func:`run_info`, rotated to ``settings.save_total_limit`` once complete (None: keep all). The
    Trainer's own rotation is turned off by :func:`sft.app.settings.apply_run_shape` (``settings.sft_rotation``).
    ``saves``: the run's :class:`sft.train.async_save.BackgroundSaves` under ``--save_async``, else None."""
    return AtomicCheckpoints(settings.save_total_limit, run_info(settings, seed, use_lora), saves)


def resolve_resume(output_dir: str, resume_from_checkpoint: Optional[str], overwrite_output_dir: bool) -> Optional[str]:
    """The checkpoint this run resumes from, or None for a fresh start.

    ``--resume_from_checkpoint PATH`` is used as given (checked by :func:`check_resume`). ``auto`` (also
    ``True``) takes :func:`latest_complete` of ``--output_dir`` (None when there is none). Unset means
    ``auto`` unless ``--overwrite_output_dir True``.
    """
    value = resume_from_checkpoint
    if value is None or str(value).strip().lower() in AUTO_VALUES:
        if value is None and overwrite_output_dir:
            return None
        return latest_complete(output_dir)
    return value


def choose_resume(output_dir: str, resume_from_checkpoint: Optional[str], overwrite_output_dir: bool,
                  rank: Optional[int] = None, saver: bool = True) -> Optional[str]:
    """The checkpoint this run resumes from, as :func:`resolve_resume`, except that ``auto`` takes the newest
    checkpoint that every rank verifies (:func:`verify` of the files ``rank`` wrote, and the shared ones when
    ``saver``; the ranks agree with one all-gather per candidate, so call it on every rank). A complete checkpoint
    that fails is skipped with one warning (on global rank 0) naming it, the reason and the checkpoint resumed
    instead. A named
    ``PATH`` is returned as given (validation refused it if it fails verification).

    Raises:
        CheckpointError: ``--output_dir`` has complete checkpoints but none verifies.
    """
    value = resume_from_checkpoint
    if value is not None and str(value).strip().lower() not in AUTO_VALUES:
        return value
    if value is None and overwrite_output_dir:
        return None
    rejected = []
    for _, path in reversed(checkpoint_dirs(output_dir)):
        has_marker = os.path.exists(os.path.join(path, MARKER))
        reasons = gather_objects(verify(path, rank, saver) if has_marker else "")
        if all(r is None for r in reasons):
            for bad, why in rejected if rank in (None, 0) else ():  # every rank knows; global rank 0 says it
                logger.warning("not resuming from %s: %s; resuming from the previous complete checkpoint %s instead",
                               bad, why, path)
            return path
        bad = [(r, why) for r, why in enumerate(reasons) if why]
        if bad:  # "" (no marker: a save that did not finish) on every rank: skipped silently, as always
            r, why = bad[0]
            rejected.append((path, why if len(reasons) == 1 else f"on rank {r}: {why}"))
    if rejected:
        raise CheckpointError(
            f"--output_dir {output_dir}: no checkpoint there passes verification ("
            + "; ".join(f"{p}: {why}" for p, why in rejected) + "); restore the damaged files, name a checkpoint "
            "copied from elsewhere with --resume_from_checkpoint PATH, or start afresh with --overwrite_output_dir "
            "True (or another --output_dir)")
    return None


def check_resume(output_dir: str, resume_from_checkpoint: Optional[str], overwrite_output_dir: bool,
                 use_lora: bool, rank: Optional[int] = None, saver: bool = True) -> tuple[list[str], bool]:
    """Problems with the resume setting (``--resume_from_checkpoint``: None, ``auto``/``true`` or a folder), and
    whether the run may write into a non-empty ``output_dir``. A named folder with a completion marker must pass
    :func:`verify` (``rank``/``saver``: the files this process checks; None: all); one without a marker (written
    by another tool) is resumed with a warning (:func:`warn_if_different`).

    Returns:
        ``(problems, output_dir_ok)``: ``output_dir_ok`` is True when the run resumes from a checkpoint
        inside ``--output_dir``, or when ``--output_dir`` holds nothing but checkpoint folders (incomplete
        leftovers of a killed first save: the run starts fresh and overwrites them).
    """
    out = output_dir
    value = resume_from_checkpoint
    explicit = value is not None and str(value).strip().lower() not in AUTO_VALUES
    problems = []
    if explicit:
        if not os.path.isfile(os.path.join(value, "trainer_state.json")):
            problems.append(f"--resume_from_checkpoint {value}: not a checkpoint folder (no trainer_state.json); "
                            "give a checkpoint-N folder written by an earlier run, or 'auto' for the newest "
                            "complete one in --output_dir")
            return problems, False
        if os.path.exists(os.path.join(value, MARKER)):
            why = verify(value, rank, saver)
            if why:
                problems.append(f"--resume_from_checkpoint {value}: fails verification: {why}; it would not resume "
                                "the run it saved; restore the file, name an earlier checkpoint-N, or pass 'auto' "
                                "(the newest checkpoint in --output_dir that verifies)")
        problems += _compare_with_checkpoint(value, use_lora)
    resume = resolve_resume(output_dir, resume_from_checkpoint, overwrite_output_dir)
    if not os.path.isdir(out):
        return problems, True
    inside = resume is not None and os.path.commonpath([os.path.realpath(resume), os.path.realpath(out)]) == \
        os.path.realpath(out)
    only_checkpoints = all(_CKPT.match(n) and os.path.isdir(os.path.join(out, n)) for n in os.listdir(out)
                           if n != NCCL_TRACE_DIR)
    return problems, inside or (only_checkpoints and not explicit)


# DeepSpeed's ZeRO optimizer shards, one per data-parallel rank R (and model-parallel rank M), in a checkpoint's
# global_stepN folder: [bf16_]zero_pp_rank_R_mp_rank_M_optim_states.pt (deepspeed 0.18 engine._get_zero_ckpt_name).
_ZERO_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def zero_world_size(path: str) -> Optional[int]:
    """The data-parallel world size a DeepSpeed ZeRO checkpoint was written at: the number of distinct ranks R
    among ``path/global_step*/*zero_pp_rank_R_mp_rank_M_optim_states.pt``; None when there are none (not a
    DeepSpeed checkpoint)."""
    ranks = set()
    for sub in os.listdir(path) if os.path.isdir(path) else []:
        if sub.startswith("global_step") and os.path.isdir(os.path.join(path, sub)):
            ranks |= {m.group(1) for m in map(_ZERO_SHARD.search, os.listdir(os.path.join(path, sub))) if m}
    return len(ranks) or None


# ZeRO stages resumed at another world size through a universal checkpoint (sft.train.world_size)
UNIVERSAL_STAGES = (2, 3)


def check_zero_world_size(output_dir: str, resume_from_checkpoint: Optional[str], overwrite_output_dir: bool,
                          world_size: int, zero_stage: int) -> list[str]:
    """A run under DeepSpeed ZeRO stage ``zero_stage`` not in :data:`UNIVERSAL_STAGES` cannot resume a ZeRO
    checkpoint written at another world size: DeepSpeed 0.19 does not re-partition the optimizer state by itself
    (``engine._load_zero_checkpoint`` raises ZeRORuntimeException after the model has loaded), and sft converts only
    those stages to a universal checkpoint. ``world_size``: this run's number of processes. The problem line, or
    none."""
    resume = resolve_resume(output_dir, resume_from_checkpoint, overwrite_output_dir)
    saved = zero_world_size(resume) if resume else None
    if saved is None or saved == world_size or zero_stage in UNIVERSAL_STAGES:
        return []
    explicit = resume_from_checkpoint is not None and str(resume_from_checkpoint).strip().lower() not in AUTO_VALUES
    which = f"--resume_from_checkpoint {resume}" if explicit else \
        f"--output_dir {output_dir}: its newest complete checkpoint {resume}"
    return [f"{which} was written by DeepSpeed ZeRO at world size {saved}, but this run has world size {world_size}: "
            f"ZeRO stage {zero_stage}'s partitioned optimizer state is not re-partitioned to another world size (ZeRO "
            f"stages {' and '.join(map(str, UNIVERSAL_STAGES))} and DDP, without --deepspeed, resume at another world "
            f"size); run again with {saved} "
            f"processes in all (nodes x processes per node, e.g. sbatch --nodes {saved} with 1 per node), or start "
            "afresh (--overwrite_output_dir True, or another --output_dir)"]


def _compare_with_checkpoint(path: str, use_lora: bool) -> list[str]:
    """A checkpoint of a LoRA run cannot be resumed as full fine-tuning and vice versa."""
    lora_files = any(os.path.exists(os.path.join(path, n)) for n in ("adapter_model.safetensors", "adapter_model.bin"))
    full_files = any(n.startswith(("model.safetensors", "model-0", "pytorch_model")) for n in os.listdir(path))
    if use_lora and full_files and not lora_files:
        return [f"--resume_from_checkpoint {path}: holds a full model, but this run has --use_lora True; resume "
                "with the flags of the run that wrote it (no --use_lora), or start a new --output_dir"]
    if not use_lora and lora_files:
        return [f"--resume_from_checkpoint {path}: holds a LoRA adapter, but this run trains the full model; add "
                "--use_lora True (and the LoRA flags of the run that wrote it)"]
    return []


def warn_if_different(path: str, now: dict) -> None:
    """Log why a resume from ``path`` will not reproduce the uninterrupted run (missing marker, other batch shape);
    ``now``: this run's :func:`run_info`."""
    if not is_complete(path):
        logger.warning("%s has no completion marker (%s): it may be incomplete, or written by another tool; "
                       "resuming from it anyway because it was named explicitly", path, MARKER)
        return
    saved = read_json(os.path.join(path, MARKER))
    same_global = saved.get("global_batch", now.get("global_batch")) == now.get("global_batch")
    diff = [f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if k in saved and saved[k] != v
            and not (same_global and k in ("world_size", "gradient_accumulation_steps",
                                           "configured_gradient_accumulation_steps"))]  # sft.train.world_size's change
    if diff:
        logger.warning("resuming from %s with a different run shape (%s): training continues, but the data order "
                       "and the result will differ from an uninterrupted run", path, "; ".join(diff))
