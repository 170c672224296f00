"""Sequence-parallel groups: ``--sequence_parallel_size N`` splits every micro batch's tokens over N consecutive ranks.

The world of W processes is cut into W / N sequence-parallel groups of consecutive global ranks ``[g * N, g * N +
N)`` -- inside one node whenever N divides the processes per node, so the attention's exchanges stay on the node's
links and data parallelism runs across nodes (the layout of DeepSpeed's Ulysses, arXiv 2309.14509, and of ALST,
arXiv 2506.13996). The ranks of one group read the same micro batch; the data-parallel rank of a process is its
group's index ``rank // N`` and the data-parallel world ``W / N`` groups. Gradients are still reduced over the whole
world (each rank's loss covers only its own tokens, normalised by the job's supervised tokens: the sum over ranks is
the whole micro batch's gradient), so DDP, ZeRO and FSDP2 shard and reduce as without sequence parallelism.

The groups are created once by :func:`start` (every rank must call it: ``torch.distributed.new_group`` is
collective), from :func:`sft.distributed.process_group.start_runtime`; :func:`current` returns this process's.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

logger = logging.getLogger("sft")


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """This process's place in sequence parallelism.

    Fields:
        size: N, ranks sharing one micro batch's tokens (1: off).
        rank: this process's rank inside its group (0..N-1): which slice of the row it holds.
        data_parallel_size: groups in the job (world size / N): data-parallel processes as the samplers count them.
        data_parallel_rank: its group's index (global rank // N): which micro batches it reads.
        group: the ``torch.distributed`` process group of its N ranks (None when N == 1).
    """

    size: int = 1
    rank: int = 0
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    group: object = None

    @property
    def enabled(self) -> bool:
        return self.size > 1


_CURRENT: dict = {"sp": None}


def layout(world_size: int, rank: int, size: int) -> tuple[int, int, int, int]:
    """``(sp rank, data-parallel size, data-parallel rank, first global rank of the group)`` of global ``rank`` in a
    world of ``world_size`` cut into groups of ``size`` consecutive ranks.

    Raises:
        ValueError: ``size`` < 1 or not dividing ``world_size``.
    """
    if size < 1 or world_size % size:
        raise ValueError(f"sequence-parallel size {size} does not divide the world size {world_size}")
    return rank % size, world_size // size, rank // size, rank - rank % size


def start(size: int) -> SequenceParallel:
    """Create the sequence-parallel groups of ``size`` consecutive ranks (collective: every rank of the job calls it
    with the same ``size``) and return this process's :class:`SequenceParallel` (also kept for :func:`current`).
    ``size`` 1 (or no process group) creates nothing.

    Raises:
        ValueError: ``size`` does not divide the world size.
    """
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if grouped else (1, 0)
    sp_rank, dp_size, dp_rank, first = layout(world, rank, int(size))
    group = None
    if size > 1:
        for start_rank in range(0, world, size):  # new_group is collective over the whole world: every group
            g = dist.new_group(list(range(start_rank, start_rank + size)))
            if start_rank == first:
                group = g
    sp = SequenceParallel(int(size), sp_rank, dp_size, dp_rank, group)
    _CURRENT["sp"] = sp
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    line = crossing_line(size, local)
    if line and rank == 0:
        logger.warning("%s", line)
    return sp


def crossing_line(size: int, local_world_size: int) -> Optional[str]:
    """The warning for groups of ``size`` ranks that span nodes of ``local_world_size`` processes each (their
    attention exchanges then cross the network at every layer), or None when every group stays inside a node."""
    if size <= 1 or local_world_size <= 0 or local_world_size % size == 0:
        return None
    return (f"--sequence_parallel_size {size} does not divide the {local_world_size} processes per node: some "
            "sequence-parallel groups span two nodes and exchange every layer's attention over the network; a size "
            "that divides the processes per node keeps every group inside a node")


def current() -> SequenceParallel:
    """This process's :class:`SequenceParallel` (size 1 before :func:`start`)."""
    return _CURRENT["sp"] or SequenceParallel()


def reset(sp: Optional[SequenceParallel] = None) -> None:
    """Set (or clear) this process's sequence parallelism; for tests that run several configurations in one
    process."""
    _CURRENT["sp"] = sp
