"""Data preparation spread over every process of the job, outside any collective timeout.

Layout of one source's cache folder ``<cache>/<key>/`` (the key hashes the source's bytes, the tokenizer and
the settings, :func:`sft.data.store.cache_key.cache_key`), for a job of ``W`` shards (``W`` = world size):

* ``shard-00003-of-00008.<run>/part-00.arrow ...``: the samples of records ``index % W == 3`` (Arrow IPC stream
  files, memory-mapped by ``datasets.Dataset.from_file``), one part per ``--preprocessing_num_workers`` process;
* ``shard-00003-of-00008.done``: the completion marker, written last and atomically (a temporary file renamed
  over it) after the shard's folder is complete; it names that folder and holds the shard's record check and
  truncation report. A folder without a marker (a killed or a still running preparation) is never read;
* ``shard-00003-of-00008.failed-<run>``: written by a rank whose preparation failed, with its message; every
  rank of the same run (``<run>``, agreed at the start) stops with it.

The rows of the dataset do not depend on ``W``: each sample carries its record's index and the shards' rows are
read back in record order (:func:`sft.data.store.dataset.in_record_order`), so a complete set written at one world size
also serves a run at another (:func:`sft.data.store.dataset.shard_count`).

Who prepares what: with a cache folder that every node sees (checked at the start with one probe file per
node), shard ``k`` is prepared by global rank ``k``: once per job. With a node-local folder, the ranks of each
node prepare every shard between them (shard ``k`` by local rank ``k % local world size``): once per node.
Shards that already have a marker are not prepared again. Then each rank waits for the markers of all shards,
polling the file system with its own bound (``--data_timeout``), never in a collective bounded by
``--ddp_timeout``; the only collectives here are two small exchanges at the start, when every rank has arrived.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from typing import Callable, Optional

from sft.distributed import collectives
from sft.distributed.watchdog import RECORD
from sft.errors import DataError
from sft.fsio import atomic_write_json, read_json

logger = logging.getLogger(__name__)

PROGRESS_FIRST_S = 5.0  # a rank that has waited this long says so, and again every PROGRESS_EVERY_S seconds
PROGRESS_EVERY_S = 30.0
POLL_S = 0.5


@dataclasses.dataclass
class JobView:
    """Where this process is in the job: global ``rank`` of ``world_size``, ``local_rank`` of
    ``local_world_size`` on node ``node_rank`` (torchrun's ``GROUP_RANK``, Ray's ``NODE_RANK``)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    host: str = dataclasses.field(default_factory=socket.gethostname)

    @classmethod
    def from_env(cls) -> "JobView":
        """From torchrun's / Ray Train's variables; rank and world size from the process group when it is up."""
        env = os.environ
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        if collectives.initialized():
            rank, world = collectives.rank(), collectives.world_size()
        return cls(rank=rank, world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
                   node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))))


@dataclasses.dataclass
class ShardPlan:
    """What every rank agreed on for this run: ``run`` (a random id naming this run's failure markers),
    ``shared`` (every node sees the same cache folder) and the node rank of every global rank."""

    view: JobView
    run: str
    shared: bool
    nodes: list

    def preparers(self, n_shards: int) -> dict[int, list[int]]:
        """Shard -> the global ranks that prepare it in this run (several with a node-local cache)."""
        v = self.view
        if self.shared:
            return {k: [k] for k in range(n_shards)}
        out: dict[int, list[int]] = {k: [] for k in range(n_shards)}
        for r, node in enumerate(self.nodes):
            local = sum(1 for q in range(r) if self.nodes[q] == node)
            for k in range(n_shards):
                if k % v.local_world_size == local:
                    out[k].append(r)
        return out

    def mine(self, n_shards: int) -> list[int]:
        return [k for k, ranks in self.preparers(n_shards).items() if self.view.rank in ranks]


def agree(cache_root: str, view: JobView) -> ShardPlan:
    """Agree on the run id and whether ``cache_root`` is shared between nodes (two quick collectives when
    several processes run; every rank calls this at the same point, before any preparation)."""
    if view.world_size == 1:
        return ShardPlan(view, uuid.uuid4().hex[:12], True, [view.node_rank])
    run = collectives.broadcast_object(uuid.uuid4().hex[:12] if view.rank == 0 else None, src=0)
    probe = os.path.join(cache_root, f".probe-{run}")
    os.makedirs(probe, exist_ok=True)
    open(os.path.join(probe, f"node-{view.node_rank}"), "w").close()
    nodes = collectives.gather_objects(view.node_rank)  # also: every rank has written its probe file
    sees_all = all(os.path.exists(os.path.join(probe, f"node-{n}")) for n in set(nodes))
    seen = collectives.gather_objects(sees_all)
    if view.local_rank == 0:
        import shutil

        shutil.rmtree(probe, ignore_errors=True)
    shared = all(seen)
    if view.rank == 0 and len(set(nodes)) > 1:
        logger.info("data cache %s is %s", cache_root, "shared by every node: each shard is prepared once per job"
                    if shared else "local to each node: each node prepares every shard")
    return ShardPlan(view, run, shared, list(nodes))


def shard_name(k: int, n: int) -> str:
    return f"shard-{k:05d}-of-{n:05d}"


def read_marker(key_dir: str, k: int, n: int) -> Optional[dict]:
    """The completion marker of shard ``k`` of ``n`` (None when the shard is not complete).

    Not :func:`sft.train.integrity.read_marker` (a checkpoint's marker, which must list its files and whose reader
    says why one cannot be used): a shard's marker is whatever its preparer wrote, and a missing or unparsable one
    only means "not yet" to the ranks polling for it. Both read through :func:`sft.fsio.read_json`."""
    try:
        return read_json(os.path.join(key_dir, shard_name(k, n) + ".done"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def prepare_shard(key_dir: str, k: int, n: int, plan: ShardPlan, write_parts: Callable[[str], dict]) -> None:
    """Prepare shard ``k`` of ``n`` into a private folder, then publish it with its marker.

    ``write_parts(folder)`` writes the shard's ``part-*.arrow`` files into ``folder`` and returns the marker's
    content (``{"parts": [...], ...}``). Any exception is written to this run's failure marker first, so that
    the waiting ranks stop with this rank's message, and then raised.
    """
    name = shard_name(k, n)
    tmp = os.path.join(key_dir, f"{name}.tmp-{plan.view.host}-{os.getpid()}")
    try:
        os.makedirs(tmp, exist_ok=True)
        marker = write_parts(tmp)
        final = f"{name}.{plan.run}-{plan.view.rank}"
        os.replace(tmp, os.path.join(key_dir, final))
        atomic_write_json(os.path.join(key_dir, name + ".done"), dict(marker, dir=final))
    except BaseException as e:
        message = str(e) if isinstance(e, DataError) else f"{type(e).__name__}: {e}"
        v = plan.view
        atomic_write_json(os.path.join(key_dir, f"{name}.failed-{plan.run}"),
                          {"rank": v.rank, "node_rank": v.node_rank, "host": v.host, "message": message})
        raise


def _failure(key_dir: str, n: int, run: str, waiting: list[int]) -> Optional[dict]:
    for k in waiting:
        try:
            return dict(read_json(os.path.join(key_dir, f"{shard_name(k, n)}.failed-{run}")), shard=k)
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return None


def wait_for_shards(key_dir: str, n: int, plan: ShardPlan, timeout_s: float, what: str) -> list[dict]:
    """:func:`_wait_for_shards`, marked as a wait for other ranks in this process's progress record
    (:mod:`sft.distributed.watchdog`): a rank frozen while preparing its shard is the one named."""
    with RECORD.wait(f"waiting for data shards of {what}"):
        return _wait_for_shards(key_dir, n, plan, timeout_s, what)


def _wait_for_shards(key_dir: str, n: int, plan: ShardPlan, timeout_s: float, what: str) -> list[dict]:
    """Poll until every shard of ``key_dir`` has its marker; return the markers in shard order.

    Logs (WARNING, so every rank's lines show) after :data:`PROGRESS_FIRST_S` seconds and then every
    :data:`PROGRESS_EVERY_S` seconds which shards it waits for and on which nodes and ranks they are prepared.

    Raises:
        DataError: a rank of this run failed to prepare a shard (its message), or ``timeout_s`` seconds
            passed (naming the shards, nodes and ranks awaited, and --data_timeout).
    """
    start = time.monotonic()
    last = start - PROGRESS_EVERY_S + PROGRESS_FIRST_S
    preparers = plan.preparers(n)
    markers: dict[int, dict] = {}
    while True:
        for k in range(n):
            if k not in markers:
                m = read_marker(key_dir, k, n)
                if m is not None:
                    markers[k] = m
        waiting = [k for k in range(n) if k not in markers]
        if not waiting:
            waited = time.monotonic() - start
            if waited >= PROGRESS_FIRST_S:
                logger.warning("rank %d: every shard of %s is ready after waiting %.0f s", plan.view.rank, what, waited)
            return [markers[k] for k in range(n)]
        failed = _failure(key_dir, n, plan.run, waiting)
        if failed:
            raise DataError(f"rank {failed['rank']} (node {failed['node_rank']}, host {failed['host']}) could not "
                            f"prepare shard {failed['shard']} of {n} of {what}: {failed['message']}")
        now = time.monotonic()
        ranks = sorted({r for k in waiting for r in preparers[k]
                        if plan.shared or plan.nodes[r] == plan.view.node_rank})
        nodes = sorted({plan.nodes[r] for r in ranks})
        where = (f"shard(s) {_ids(waiting)} of {n} of {what} from node(s) {_ids(nodes)} (rank(s) {_ids(ranks)})")
        if now - start > timeout_s:
            raise DataError(f"rank {plan.view.rank}: {where} not prepared within --data_timeout {timeout_s:g} s; "
                            "look at those ranks' logs (a crash, a killed node), or raise --data_timeout for a "
                            "preparation that takes longer")
        if now - last >= PROGRESS_EVERY_S:
            last = now
            logger.warning("rank %d: waiting for %s; %.0f s of --data_timeout %g s", plan.view.rank, where,
                           now - start, timeout_s)
        time.sleep(POLL_S)


def _ids(xs: list[int]) -> str:
    shown = ", ".join(map(str, xs[:8]))
    return shown + (f" ... ({len(xs)} in all)" if len(xs) > 8 else "")
