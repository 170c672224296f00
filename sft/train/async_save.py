"""Checkpoints written in the background (``--save_async True``): training is blocked only while the state is copied
to host memory; the files are written, flushed and hashed by a thread, and the completion marker follows once every
rank's files are durable.

A save under ``--save_async`` (no ``--deepspeed``; :func:`sft.app.validation` refuses it there):

1. **Wait** for the save in flight, if any (at most one: its files, marker and rotation finish first); the wait is
   logged with its length.
2. **Stage** (training blocked): the tensors that the checkpoint's large files hold are copied to host memory
   (:func:`stage`; pinned on CUDA, so the copy is a DMA): the weights or the adapter, and the optimizer state (under
   FSDP2 with ``SHARDED_STATE_DICT``, this rank's shards only). Tied tensors stay tied in the copy. The copies are
   kept and reused by the next checkpoint (whose write starts only after this one's is done), so host memory holds
   one checkpoint's worth for the run (the memory plan counts it). The small files of
   the optimizer step (scheduler, RNG states, ``trainer_state.json``) are written now, as the Trainer writes them.
3. **Write** (a daemon thread, :class:`BackgroundSaves`): the large files from the copy, the same files the
   synchronous save writes (``save_pretrained`` for the weights or adapter with the tokenizer and training
   arguments, ``torch.save`` for the optimizer state,
   ``torch.distributed.checkpoint`` for FSDP2 shards), then each rank flushes and hashes the files it owns and the
   checkpoint is marked complete and rotated as :mod:`sft.train.checkpoint` does, with the collectives on a gloo
   process group of their own (:func:`sft.distributed.collectives.new_gloo_group`), so that they never interleave with
   training's collectives on the default group.

Failure: an error of the background write (a full disk, a lost peer) on any rank leaves the checkpoint without a
marker (ignored by ``auto`` resume); every rank learns it from the thread's all-gather and raises at the next wait (the
next save or the end of training), the rank that failed with its own error. A process killed during the write leaves
the same incomplete folder. The thread is a daemon: an exception in training abandons the write in flight.

The pattern (stage to host memory, write in the background, one save in flight) is that of
``torch.distributed.checkpoint.async_save`` and torchtitan's asynchronous checkpointing.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("sft")

MIB = 2 ** 20


def stage(obj: Any, pin: bool = False, memo: Optional[dict] = None, pool: Optional[dict] = None) -> Any:
    """A copy of ``obj`` whose tensors are in host memory, detached from anything training will change.

    ``obj``: a tensor, a ``DTensor`` (its local shard is copied; the copy keeps its mesh and placements, no collective
    runs), or a dict / list / tuple of them (a state dict, an optimizer state dict); any other value is kept as it is
    (numbers, strings, param group settings). Tensors that share storage (tied embeddings) share it in the copy too:
    ``memo`` maps each source storage to its copy. ``pool``: copies of an earlier call, by source storage, reused
    when their size fits (a fresh allocation's first touch of every page costs as much as the copy itself); the
    caller must be done with them. ``pin``: allocate new copies in page-locked memory (CUDA only).
    """
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            return DTensor.from_local(stage(obj.to_local(), pin, memo, pool), obj.device_mesh, obj.placements,
                                      run_check=False, shape=obj.shape, stride=obj.stride())
        t = obj.detach()
        key = (t.untyped_storage().data_ptr(), t.device, t.dtype)
        if t.untyped_storage().nbytes() == 0:
            return t.to("cpu", copy=True)
        if key not in memo:  # the whole storage once, then a view of it with this tensor's offset and strides
            src = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
            dst = (pool or {}).get(key)
            if dst is None or dst.shape != src.shape:
                dst = torch.empty(src.shape, dtype=t.dtype, pin_memory=pin and t.is_cuda)
            dst.copy_(src, non_blocking=pin and t.is_cuda)
            memo[key] = dst
        base = memo[key]
        return torch.empty(0, dtype=t.dtype).set_(base.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    if isinstance(obj, dict):
        return type(obj)((k, stage(v, pin, memo, pool)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: stage(v, pin, memo, pool) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [stage(v, pin, memo, pool) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def staged_bytes(memo: dict) -> int:
    """Bytes held by the copies :func:`stage` made with ``memo``."""
    return sum(t.untyped_storage().nbytes() for t in memo.values())


class BackgroundSaves:
    """At most one checkpoint written in the background; see the module docstring.

    Args:
        group: the process group of the thread's collectives (a gloo group of every rank), or None for one process.
    """

    def __init__(self, group=None):
        self.group = group
        self.jobs: list[tuple[str, Callable[[], None]]] = []
        self.staged = 0  # bytes copied for the checkpoint being staged
        self.staging_s = 0.0
        self._pool: dict = {}  # the last checkpoint's host copies, reused by the next (the write is done by then)
        self._staging_memo: dict = {}
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._path: Optional[str] = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def add(self, what: str, write: Callable[[], None]) -> None:
        """Queue ``write`` (no argument; writes one or more files of the checkpoint being staged)."""
        self.jobs.append((what, write))

    def stage(self, obj: Any) -> Any:
        """:func:`stage` ``obj`` for the checkpoint being staged, counting the bytes and the time it takes."""
        start, memo = time.perf_counter(), {}
        out = stage(obj, pin=torch.cuda.is_available(), memo=memo, pool=self._pool)
        self._staging_memo.update(memo)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.staging_s += time.perf_counter() - start
        self.staged += staged_bytes(memo)
        return out

    def start(self, path: str, complete: Callable[[Optional[BaseException]], None]) -> None:
        """Write the queued files of checkpoint ``path`` in the background, then call ``complete(error)`` there (every
        rank: flush, hash, gather, mark; ``error`` is this rank's write error or None) and forget the queue."""
        if self.staged:
            logger.info("staged %.1f MiB of checkpoint %s in host memory in %.2f s; writing it in the background",
                        self.staged / MIB, path, self.staging_s)
        jobs, self.jobs = self.jobs, []
        self._path, self._error = path, None

        def run():
            error = None
            try:
                for _, write in jobs:
                    write()
            except BaseException as e:  # noqa: BLE001 (kept and raised in the main thread at the next wait)
                error = e
            try:
                complete(error)
            except BaseException as e:  # noqa: BLE001
                error = error or e
            self._error = error

        self._thread = threading.Thread(target=run, name="sft-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self, why: str) -> float:
        """Wait for the save in flight (none: returns 0 at once); log how long when it blocked training for more than
        10 ms. Returns the seconds waited. Raises the error of the background write (this rank's, or a
        :class:`~sft.train.checkpoint.CheckpointError` naming the rank that failed)."""
        if self._thread is None:
            return 0.0
        start = time.perf_counter()
        self._thread.join()
        self._thread = None
        waited = time.perf_counter() - start
        if waited > 0.01:
            logger.info("waited %.2f s for the background write of %s to finish (%s)", waited, self._path, why)
        error, self._error = self._error, None
        if error is not None:
            raise error
        return waited

    def reset_staging(self) -> None:
        """Start staging the next checkpoint (after :meth:`wait`): the last one's copies become the pool to reuse."""
        if self._staging_memo:
            self._pool, self._staging_memo = self._staging_memo, {}
        self.staged, self.staging_s = 0, 0.0
