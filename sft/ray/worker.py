"""What runs inside the Ray cluster: the :class:`Coordinator` actor and :func:`train_worker`, Ray Train's training
function, which runs the very training of ``finetune.py`` in each worker."""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Optional

from sft.distributed.process_group import deepspeed_cpu_default
from sft.errors import PREEMPTED_EXIT_CODE
from sft.ray.flags import RayArguments


class Coordinator:
    """A small Ray actor shared by the driver and the workers: the stop request (preemption), where each rank
    runs, and each rank's exit code. Created by the driver on its own node with 0 CPUs."""

    def __init__(self):
        self.stop: Optional[int] = None
        self.placement: dict[int, dict] = {}
        self.outcomes: dict[int, int] = {}

    def request_stop(self, signum: int) -> None:
        if self.stop is None:
            self.stop = int(signum)

    def stop_requested(self) -> Optional[int]:
        return self.stop

    def report_placement(self, rank: int, info: dict) -> None:
        self.placement[rank] = info

    def report_outcome(self, rank: int, code: int) -> None:
        self.outcomes[rank] = code

    def state(self) -> tuple[dict, dict]:
        return self.placement, self.outcomes


class WorkerFailed(RuntimeError):
    """A worker's run returned an error code; raised so that Ray Train stops every worker."""


def _poll_stop(coordinator, done: threading.Event, interval_s: float = 1.0) -> None:
    """Worker thread: when the driver asks to stop, act as if this process had received the signal."""
    import ray

    from sft.train.preemption import request_stop

    signum = None
    while not done.wait(interval_s):
        if signum is None:
            try:
                signum = ray.get(coordinator.stop_requested.remote(), timeout=30)
            except Exception:  # the driver is gone: Ray ends this worker soon anyway
                return
        if signum is not None and request_stop(signum):  # False until run() has installed its handler: retry
            return


def _node_drain_notice() -> Optional[str]:
    """Why this run should checkpoint and stop now because Ray is draining one of its nodes (a spot/preemptible
    instance being reclaimed, a scale-down), or None. ``ray.train.get_preemption_info`` (Ray Train, alpha API
    checked against ray 2.60) is a barrier across the workers: every worker calls it once per optimizer step."""
    import ray.train

    info = ray.train.get_preemption_info()
    if info is None:
        return None
    deadline = f", deadline in {max(0.0, info.deadline_ms / 1000 - time.time()):.0f} s" if info.deadline_ms else ""
    return (f"Ray is draining node(s) {', '.join(n[:12] for n in info.preempted_node_ids)} "
            f"(ranks {info.preempted_ranks}{deadline})")


def train_worker(config: dict) -> None:
    """Ray Train's training function (one call per worker): :func:`sft.app.train.train` on ``config["argv"]`` in
    ``config["cwd"]`` (the driver's working directory, so relative paths mean the same on every node), under the
    one CLI policy; the node-drain notice is a per-step check of the run.

    Raises:
        WorkerFailed: the run ended with a code other than 0 or 75 (its message is already on stderr).
    """
    import ray
    import ray.train

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    coordinator = config["coordinator"]
    info = {"rank": rank, "local_rank": ctx.get_local_rank(), "node_rank": ctx.get_node_rank(),
            "node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(), "pid": os.getpid()}
    ray.get(coordinator.report_placement.remote(rank, info))
    try:
        os.chdir(config["cwd"])
    except OSError as e:
        ray.get(coordinator.report_outcome.remote(rank, 2))
        raise WorkerFailed(f"rank {rank} on {info['hostname']}: cannot enter the launch directory {config['cwd']} "
                           f"({e.strerror}); the code, data and --output_dir must be on a path shared by every node")
    deepspeed_cpu_default()
    # imports transformers (through sft.app.train) before the poll thread starts: two threads importing it race
    from sft.app.train import train
    from sft.policy import run_cli
    from sft.train import preemption  # noqa: F401  (the poll thread's import, done here)

    done = threading.Event()
    threading.Thread(target=_poll_stop, args=(coordinator, done), daemon=True, name="sft-stop-poll").start()
    try:
        code = run_cli(lambda: train(list(config["argv"]), extra=(RayArguments,), step_checks=[_node_drain_notice]))
    finally:
        done.set()
    ray.get(coordinator.report_outcome.remote(rank, code))
    if code not in (0, PREEMPTED_EXIT_CODE):
        raise WorkerFailed(f"rank {rank} on {info['hostname']} exited with code {code} (its message is above)")
