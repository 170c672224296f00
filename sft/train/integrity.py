"""Checksums of a checkpoint's files: who hashes what, what the completion marker records, how resume verifies
it, and the message for a save that ran out of disk space.

Hash: xxHash's XXH3 128-bit (``xxhash``, already installed as a dependency of ``datasets``): not
cryptographic (a checkpoint is protected against bit rot, truncation and torn copies, not against an
attacker), and an order of magnitude faster than SHA-256 on a CPU core, so a save is dominated by
writing, not hashing (bench/checkpoint_hash.py prints both for a SmolLM2-135M-sized checkpoint).

Who hashes a file (:func:`owner_rank`): the process that wrote it, right after the save, while the bytes
are still in its node's page cache and without reading another node's files over a shared filesystem:

* ``rng_state_R.pth`` (the Trainer, one per rank) and DeepSpeed's ``[bf16_]zero_pp_rank_R_mp_rank_M_
  {optim,model}_states.pt`` (one ZeRO shard per data-parallel rank R; pure data parallelism: R is the global
  rank) and torch.distributed.checkpoint's ``__R_K.distcp`` (FSDP2's sharded state) are hashed by rank R;
* every other file (weights or adapter, optimizer and scheduler of DDP, ``trainer_state.json``, DeepSpeed's
  ``mp_rank_00_model_states.pt`` and ``latest``) by the saving process(es) (``TrainingArguments.should_save``:
  global rank 0, or local rank 0 of every node with ``--save_on_each_node True``).

The saving process writes the marker with the entries of every file it can see (a shared output folder:
all of them; a node-local one: its node's), each with the checksum its writer computed. A rank verifies
the entries it owns (:func:`verify` with ``rank``), so checking a checkpoint costs one read of each file
in all, spread over the ranks like the writes were.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Optional

from sft.fsio import fsync_file, hash_file, read_json

MARKER = "sft_checkpoint_complete.json"  # a checkpoint's completion marker (sft.train.checkpoint writes it last)

HASH = "xxh3_128"
_CHUNK = 8 << 20  # bytes per read; large enough that the Python loop costs nothing next to the hashing
_RANK_FILE = re.compile(r"^(?:rng_state_(\d+)\.pth|(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt"
                        r"|__(\d+)_\d+\.distcp)$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "storagefull", "os error 28")
# torch.save's writer gives no errno on a full disk ("[enforce fail at inline_container.cc] unexpected pos ...",
# raised from "basic_ios::clear: iostream error"): such a write failure counts as a full disk when the filesystem
# is then (nearly) full.
_WRITE_FAILED_TEXT = ("inline_container", "iostream error", "file write failed")
_NEARLY_FULL = (64 * 2 ** 20, 0.01)  # free bytes below 64 MiB or below 1 % of the filesystem
MIB = 2 ** 20


def file_digest(path: str) -> str:
    """XXH3-128 of the file's bytes as 32 hex digits. Raises OSError when it cannot be read."""
    import xxhash

    return hash_file(path, xxhash.xxh3_128(), _CHUNK).hexdigest()


def owner_rank(rel: str) -> Optional[int]:
    """The global rank that writes the checkpoint file ``rel`` (a path relative to the checkpoint folder), or None
    for a file the saving process writes (see the module docstring)."""
    m = _RANK_FILE.match(os.path.basename(rel))
    return None if m is None else int(next(g for g in m.groups() if g is not None))


def checkpoint_files(path: str, skip: tuple[str, ...]) -> list[str]:
    """Every file under ``path`` as a relative path, sorted, except the names in ``skip`` and their temp files
    (``.NAME.tmp``; other hidden files such as torch.distributed.checkpoint's ``.metadata`` are listed)."""
    out = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel not in skip and not any(name.startswith(f".{n}") for n in skip):
                out.append(rel)
    return out


def hash_own_files(path: str, rank: int, saver: bool, skip: tuple[str, ...]) -> dict[str, dict]:
    """Flush to disk and hash the files of checkpoint ``path`` that ``rank`` wrote (its own rank files, and the
    shared ones when ``saver``). Returns ``{relative path: {"size": bytes, HASH: hex, "rank": owner or None}}``."""
    entries = {}
    for rel in checkpoint_files(path, skip):
        owner = owner_rank(rel)
        if owner == rank or (owner is None and saver):
            full = os.path.join(path, rel)
            fsync_file(full)
            entries[rel] = {"size": os.path.getsize(full), HASH: file_digest(full), "rank": owner}
    return entries


def verify_entries(path: str, files: dict, rank: Optional[int] = None, saver: bool = True) -> Optional[str]:
    """Check the marker's ``files`` against the folder ``path``: every entry when ``rank`` is None, else those
    ``rank`` owns (and the shared ones when ``saver``). An entry that is an int (markers of sft before checksums)
    is checked by size only. Returns None when all match, else one line naming the first bad file (and how many
    more), what differs and the owning rank."""
    problems = []
    for rel, entry in sorted(files.items()):
        entry = {"size": entry} if isinstance(entry, int) else entry
        owner = entry.get("rank")
        if rank is not None and not (owner == rank or (owner is None and saver)):
            continue
        full = os.path.join(path, rel)
        who = "" if owner is None else f" (written by rank {owner})"
        try:
            size = os.path.getsize(full)
        except OSError:
            problems.append(f"{rel}{who} is missing")
            continue
        if size != entry["size"]:
            problems.append(f"{rel}{who} has {size} bytes, the marker recorded {entry['size']} "
                            "(truncated or rewritten)")
        elif HASH in entry and file_digest(full) != entry[HASH]:
            problems.append(f"{rel}{who}: its {HASH} checksum differs from the one recorded when it was saved (the "
                            "bytes changed on disk)")
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else "")


def read_marker(path: str, marker: str) -> tuple[Optional[dict], Optional[str]]:
    """``(marker contents, None)``, or ``(None, why it cannot be used)``: a checkpoint's marker must be a JSON object
    with a ``files`` object (:mod:`sft.data.store.shards` reads its shard markers, of another format, with the same
    :func:`sft.fsio.read_json`)."""
    try:
        data = read_json(os.path.join(path, marker))
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            return None, f"{marker} has no file list"
        return data, None
    except FileNotFoundError:
        return None, f"no completion marker {marker} (its save did not finish)"
    except (OSError, ValueError) as e:
        return None, f"{marker} cannot be read ({type(e).__name__}: {e})"


# ------------------------------------------------------------------------------------------------ full disk

def is_out_of_space(err: BaseException, output_dir: str) -> bool:
    """True when ``err`` (or an exception it was raised from) says the disk or quota is full: an OSError with
    ENOSPC/EDQUOT or that text (safetensors: "No space left on device (os error 28)"), or torch.save's errno-less
    write failure while the filesystem of ``output_dir`` has under 64 MiB or 1 % free."""
    texts = []
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        texts.append(str(e).lower())
    if any(t in text for text in texts for t in _NO_SPACE_TEXT):
        return True
    if any(t in text for text in texts for t in _WRITE_FAILED_TEXT):
        try:
            usage = shutil.disk_usage(output_dir)
        except OSError:
            return False
        return usage.free < _NEARLY_FULL[0] or usage.free < _NEARLY_FULL[1] * usage.total
    return False


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, rel)) for rel in checkpoint_files(path, ()))


def out_of_space_message(err: BaseException, output_dir: str, previous: Optional[str]) -> str:
    """The one paragraph for a save that ran out of disk space in ``output_dir``: the file being written (the
    error's file name, else the newest file under ``output_dir``), free and total space, the size of ``previous``
    (the newest complete checkpoint, which is kept and resumed from) and the fix."""
    target = next((e.filename for e in _chain(err) if isinstance(e, OSError) and e.filename), None)
    if target is None:
        files = [os.path.join(output_dir, rel) for rel in checkpoint_files(output_dir, ())]
        target = max(files, key=lambda p: os.path.getmtime(p), default=output_dir)
    usage = shutil.disk_usage(output_dir)
    need = _size(previous) if previous else None
    kept = (f"the previous complete checkpoint {previous} is intact and the next start resumes from it"
            if previous else "no checkpoint had been completed yet, so the next start begins afresh")
    needs = f"; one checkpoint of this run takes {need / MIB:.1f} MiB" if need else ""
    return (f"out of disk space while writing {target}: {usage.free / MIB:.1f} MiB free of {usage.total / MIB:.1f} MiB "
            f"on the filesystem of --output_dir {output_dir}{needs}; the checkpoint being written has no completion "
            f"marker and is ignored; {kept}; free space there (or lower --save_total_limit, or give an --output_dir "
            f"on a larger disk), then run the same command again")


def _chain(err: BaseException):
    """``err``, the exceptions it was raised from, and, for torch.distributed.checkpoint's ``CheckpointException``
    (which wraps each rank's failure: a RuntimeError raised while handling the OSError ENOSPC), each failure's."""
    seen, todo = set(), [err]
    while todo:
        err = todo.pop(0)
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            yield err
            failures = getattr(err, "failures", None) if is_checkpoint_failure(err) else None
            todo += [pair[0] for pair in (failures or {}).values()]
            err = err.__cause__ or err.__context__


def is_checkpoint_failure(err: BaseException) -> bool:
    """Whether ``err`` is torch.distributed.checkpoint's ``CheckpointException`` (a failed sharded save or load on
    some rank; a BaseException, not an Exception)."""
    try:
        from torch.distributed.checkpoint import CheckpointException
    except ImportError:  # a torch without torch.distributed
        return False
    return isinstance(err, CheckpointException)
