"""Expert-parallel groups: ``--expert_parallel_size N`` spreads every layer's routed experts over N consecutive ranks.

The world of W processes is cut into W / N **expert-parallel groups** of consecutive global ranks ``[g * N, g * N +
N)`` -- inside one node whenever N divides the processes per node, so the tokens' all-to-all stays on the node's
links. Rank ``r`` of a group keeps experts ``[r * E / N, (r + 1) * E / N)`` of each layer (:mod:`sft.model.
expert_parallel`). The ranks that keep the same experts (global ranks ``r, r + N, r + 2N, ...``: one per group) form
a **replica group** of W / N ranks: their expert gradients are summed over it (:mod:`sft.train.expert_parallel`);
every other parameter is averaged over the whole world as before (DDP). Every rank still reads its own micro batches:
data parallelism is over the whole world, expert parallelism only changes where the experts' rows are computed.

The groups are created once by :func:`start` (every rank must call it: ``torch.distributed.new_group`` is
collective), from :func:`sft.distributed.process_group.start_runtime`; :func:`current` returns this process's.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from sft.errors import ConfigError

logger = logging.getLogger("sft")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """This process's place in expert parallelism.

    Fields:
        size: N, ranks that share one layer's experts (1: off).
        rank: this process's rank inside its expert-parallel group (0..N-1): which E/N experts it keeps.
        world_size: W, processes of the job.
        group: the ``torch.distributed`` group of its N ranks (the tokens' exchange; None when N == 1).
        replica_group: the group of the W / N ranks that keep the same experts (their gradients' sum; None when W == N
            or N == 1).
    """

    size: int = 1
    rank: int = 0
    world_size: int = 1
    group: object = None
    replica_group: object = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def experts(self, total: int) -> tuple[int, int]:
        """``(first, count)``: the experts this rank keeps of a layer's ``total``."""
        count = total // self.size
        return self.rank * count, count


_CURRENT: dict = {"ep": None}


def check_expert_parallel_size(size: int, world_size: Optional[int], experts: Optional[int] = None) -> None:
    """Raise ConfigError (one line) when ``--expert_parallel_size`` is below 1, does not divide the world size (None:
    unknown, not checked) or a layer's ``experts`` (None: not checked)."""
    flag = f"--expert_parallel_size {size}"
    if size < 1:
        raise ConfigError([f"{flag}: must be at least 1 (1: off)"])
    if size > 1 and world_size is not None and world_size % size:
        raise ConfigError([f"{flag}: does not divide the world size {world_size} (nodes x processes per node); launch "
                           f"a multiple of {size} processes or give a divisor of {world_size}"])
    if size > 1 and experts is not None and experts % size:
        raise ConfigError([f"{flag}: does not divide the model's {experts} routed experts per layer; give a divisor "
                           f"of {experts}"])


def layout(world_size: int, rank: int, size: int) -> tuple[int, list[int], list[int]]:
    """``(rank in its group, the group's global ranks, the replica group's global ranks)`` of global ``rank``.

    Raises:
        ValueError: ``size`` < 1 or not dividing ``world_size``.
    """
    if size < 1 or world_size % size:
        raise ValueError(f"expert-parallel size {size} does not divide the world size {world_size}")
    first = rank - rank % size
    return rank % size, list(range(first, first + size)), list(range(rank % size, world_size, size))


def start(size: int) -> ExpertParallel:
    """Create the expert-parallel and replica groups (collective: every rank calls it with the same ``size``) and
    return this process's :class:`ExpertParallel` (kept for :func:`current`). ``size`` 1 (or no process group)
    creates nothing.

    Raises:
        ValueError: ``size`` does not divide the world size.
    """
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if grouped else (1, 0)
    ep_rank, members, replicas = layout(world, rank, int(size))
    group = replica_group = None
    if size > 1:
        for first in range(0, world, size):  # new_group is collective over the whole world: every group, in order
            g = dist.new_group(list(range(first, first + size)))
            group = g if first == members[0] else group
        if world > size:
            for r in range(size):
                g = dist.new_group(list(range(r, world, size)))
                replica_group = g if r == ep_rank else replica_group
    ep = ExpertParallel(int(size), ep_rank, world, group, replica_group)
    _CURRENT["ep"] = ep
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if size > 1 and local > 0 and local % size and rank == 0:
        logger.warning("--expert_parallel_size %d does not divide the %d processes per node: some expert-parallel "
                       "groups span two nodes and exchange every MoE layer's tokens over the network; a size that "
                       "divides the processes per node keeps every group inside a node", size, local)
    return ep


def current() -> ExpertParallel:
    """This process's :class:`ExpertParallel` (size 1 before :func:`start`)."""
    return _CURRENT["ep"] or ExpertParallel()


def reset(ep: Optional[ExpertParallel] = None) -> None:
    """Set (or clear) this process's expert parallelism; for tests that run several configurations in one process."""
    _CURRENT["ep"] = ep
