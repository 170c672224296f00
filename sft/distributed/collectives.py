"""Every collective the rest of sft runs on the default process group (and, for background checkpoint writes, on a
gloo group of their own: :func:`new_gloo_group`), as one small function each, and the queries they rest on (rank,
world size, backend).

Each collective is a no-op that returns the local value when there is no initialised process group (a single
process, a test, a notebook) or when the group has one process; otherwise it is a collective of the default group,
bounded by that group's timeout (``--ddp_timeout``, :func:`sft.distributed.process_group.init_process_group`): every
rank must call the same collectives in the same order.

Devices: the object collectives (:func:`gather_objects`, :func:`broadcast_object`) leave the choice to torch (under
NCCL it pickles into a tensor on the current CUDA device, ``torch.cuda.set_device`` having been called by the
process group's start). :func:`any_rank` and :func:`all_ranks` reduce one int32 on ``device``, by default the
current CUDA device under NCCL and the CPU otherwise (gloo), the device each backend requires.

Each collective of the default group marks this rank as waiting in it (:meth:`sft.distributed.watchdog.Record.wait`),
so that a hang report names where the others waited.

Imports torch only when called (the module itself is cheap to import).
"""
from __future__ import annotations

from typing import Any, Optional

from sft.distributed.watchdog import RECORD


def _dist():
    """``torch.distributed`` when its default process group is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def initialized() -> bool:
    """True when torch.distributed's default process group is initialised in this process."""
    return _dist() is not None


def rank() -> int:
    """This process's global rank in the default process group; 0 without one."""
    dist = _dist()
    return dist.get_rank() if dist else 0


def world_size() -> int:
    """The number of processes in the default process group; 1 without one."""
    dist = _dist()
    return dist.get_world_size() if dist else 1


def backend() -> Optional[str]:
    """The default process group's backend (``"gloo"``, ``"nccl"``, ...); None without one."""
    dist = _dist()
    return dist.get_backend() if dist else None


def _several():
    """``torch.distributed`` when a collective must run (an initialised group of more than one process), else None."""
    dist = _dist()
    return dist if dist and dist.get_world_size() > 1 else None


def barrier(group=None) -> None:
    """Wait until every rank has called this (``dist.barrier``); a no-op for one process or without a group.
    ``group``: as for :func:`gather_objects`."""
    dist = _several()
    if dist and group is not None:
        dist.barrier(group=group)
    elif dist:
        with RECORD.wait("collective barrier"):
            dist.barrier()


def gather_objects(obj: Any, group=None) -> list:
    """``obj`` of every rank in rank order (``all_gather_object``: ``obj`` must pickle), or ``[obj]`` for one
    process or without a group. The list has one entry per rank. ``group``: a process group of every rank made by
    :func:`new_gloo_group`, for a thread other than the training loop's (not recorded by the hang watchdog, which
    follows the training loop); None: the default group."""
    dist = _several()
    if not dist:
        return [obj]
    out: list = [None] * dist.get_world_size()
    if group is not None:
        dist.all_gather_object(out, obj, group=group)
        return out
    with RECORD.wait("collective all_gather_object"):
        dist.all_gather_object(out, obj)
    return out


def new_gloo_group():
    """A gloo process group of every rank, for collectives run by a background thread (checkpoint writes,
    :mod:`sft.train.async_save`) while the training loop runs its own on the default group; None for one process or
    without a group. Collective: every rank must call it, in the same order as any other group creation."""
    dist = _several()
    if not dist:
        return None
    with RECORD.wait("creating a gloo process group"):
        return dist.new_group(backend="gloo")


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``broadcast_object_list``; the other ranks' ``obj`` is ignored), or
    ``obj`` itself for one process or without a group."""
    dist = _several()
    if not dist:
        return obj
    box = [obj]
    with RECORD.wait("collective broadcast_object_list"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def _reduce_flag(flag: bool, op: str, device) -> bool:
    dist = _several()
    if not dist:
        return bool(flag)
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([int(bool(flag))], dtype=torch.int32, device=device)
    with RECORD.wait(f"collective all_reduce ({op})"):
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return bool(t.item())


def any_rank(flag: bool, device=None) -> bool:
    """True on every rank when ``flag`` is true on at least one (an all-reduce MAX of one int32 on ``device``:
    default the current CUDA device under NCCL, else the CPU); ``bool(flag)`` for one process or without a group."""
    return _reduce_flag(flag, "MAX", device)


def all_ranks(flag: bool, device=None) -> bool:
    """True on every rank when ``flag`` is true on all of them (an all-reduce MIN of one int32 on ``device``, as
    :func:`any_rank`); ``bool(flag)`` for one process or without a group."""
    return _reduce_flag(flag, "MIN", device)


# Tensor collectives of a subgroup (expert parallelism, sft.model.expert_parallel): ``group`` is a process group made
# by torch.distributed.new_group (every member calls them in the same order); None: a group of one, nothing runs.

def _exchange(x, send: tuple, recv: tuple, group):
    import torch.distributed as dist

    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    with RECORD.wait("collective all_to_all_single (experts)"):
        dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)
    return out


def all_to_all_rows(x, send_counts, recv_counts, group):
    """Exchange rows of ``x`` [S, ...] in a group of n ranks: the first ``send_counts[0]`` rows go to the group's
    rank 0, the next ``send_counts[1]`` to rank 1, ...; returns [sum(recv_counts), ...], the rows received from
    rank 0 first (``recv_counts[j]`` of them from rank j, as :func:`all_to_all_counts` gives). Autograd-aware: the
    gradient of the result returns to the rows' senders. Counts are int sequences of length n; ``group`` None:
    ``x`` itself (a group of one)."""
    if group is None:
        return x
    send, recv = tuple(int(c) for c in send_counts), tuple(int(c) for c in recv_counts)
    if not x.requires_grad:
        return _exchange(x, send, recv, group)
    # torch's autograd-aware all-to-all (its backward sends the gradient back with the counts swapped); the forward's
    # wait is recorded for the hang report, the backward's is not
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    with RECORD.wait("collective all_to_all_single (experts)"):
        return all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)


def all_to_all_counts(counts, group):
    """``counts`` [n] int64 (rows this rank sends to each rank of the group) -> [n] (rows each rank sends to this
    one); ``counts`` itself for ``group`` None."""
    if group is None:
        return counts
    return _exchange(counts, (1,) * counts.numel(), (1,) * counts.numel(), group)


def all_reduce_sum(t, group):
    """Sum ``t`` (a tensor, in place) over ``group``'s ranks; returns ``t``. Nothing runs for ``group`` None."""
    if group is not None:
        import torch.distributed as dist

        with RECORD.wait("collective all_reduce (experts)"):
            dist.all_reduce(t, group=group)
    return t


def all_gather_tensors(t, group) -> list:
    """``t`` of every rank of ``group`` in group-rank order (``all_gather``: the same shape and dtype on every rank);
    ``[t]`` for ``group`` None."""
    if group is None:
        return [t]
    import torch.distributed as dist

    out = [t.new_empty(t.shape) for _ in range(dist.get_world_size(group))]
    with RECORD.wait("collective all_gather (experts)"):
        dist.all_gather(out, t.contiguous(), group=group)
    return out
