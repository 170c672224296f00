"""The Ray launcher's own flags (:class:`RayArguments`) and their checks; every finetune.py flag is accepted too."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from sft.errors import ConfigError

STRATEGIES = {
    "PACK": "as few nodes as possible (best effort)",
    "SPREAD": "as many different nodes as possible (best effort)",
    "STRICT_PACK": "all workers on one node, or fail",
    "STRICT_SPREAD": "every worker on a different node, or fail",
}
MAX_PLACEMENT_TIMEOUT_S = 365 * 24 * 3600


@dataclass
class RayArguments:
    """The Ray launcher's own flags (``scripts/ray_train.py``); every finetune.py flag is accepted as well."""

    ray_address: Optional[str] = field(
        default=None,
        metadata={"help": "Ray cluster to run on: 'auto' (the cluster started with `ray start` on this machine; "
                  "error if none), HOST:PORT of the head's GCS (e.g. 10.0.0.1:6379), or 'local' (always a new Ray "
                  "on this machine alone). Unset: $RAY_ADDRESS, else the cluster started on this machine, else "
                  "a new single-machine Ray."},
    )
    num_workers: int = field(
        default=0,
        metadata={"help": "Training processes (world size). 0 = one per GPU of the cluster when the workers use "
                  "GPUs, else one per alive node."},
    )
    use_gpu: Optional[bool] = field(
        default=None,
        metadata={"help": "Give each worker --gpus_per_worker GPUs (nccl, bf16 by default). Unset: yes when the "
                  "cluster has GPUs."},
    )
    cpus_per_worker: float = field(default=1.0, metadata={"help": "Logical CPUs Ray reserves for each worker."})
    gpus_per_worker: float = field(default=1.0, metadata={"help": "GPUs Ray reserves for each worker (with GPUs)."})
    placement_strategy: str = field(
        default="PACK",
        metadata={"help": "How Ray places the workers on nodes: "
                  + "; ".join(f"{k}: {v}" for k, v in STRATEGIES.items())
                  + " (Ray placement group strategies)."},
    )
    placement_timeout: float = field(
        default=60.0,
        metadata={"help": "Seconds to wait for Ray to reserve the workers' resources (they may be in use by other "
                  "jobs) before stopping with an error. A placement the alive nodes can never hold fails at once."},
    )


def check_ray_args(r: RayArguments) -> None:
    """Normalise ``placement_strategy`` (case-insensitive) and check the numbers.

    Raises:
        ConfigError: every problem, each naming the flag, the value and the fix.
    """
    p = []
    key = str(r.placement_strategy).strip().upper().replace("-", "_")
    if key in STRATEGIES:
        r.placement_strategy = key
    else:
        import difflib

        close = difflib.get_close_matches(key, list(STRATEGIES), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        p.append(f"--placement_strategy {r.placement_strategy}: not a Ray placement strategy{hint}; choose one of "
                 + ", ".join(f"{k} ({v})" for k, v in STRATEGIES.items()))
    if r.num_workers < 0:
        p.append(f"--num_workers {r.num_workers}: must be >= 1 (or 0 for one per GPU / per node)")
    for name in ("cpus_per_worker", "gpus_per_worker"):
        v = getattr(r, name)
        if not (math.isfinite(v) and v > 0):
            p.append(f"--{name} {v:g}: must be a positive number of {name[:3].upper()}s")
        elif v < 1e-4:  # Ray's resource unit: smaller fractions fail in Ray Train's controller (a traceback)
            p.append(f"--{name} {v:g}: Ray counts {name[:3].upper()}s in steps of 0.0001; give at least 0.0001")
    if not (math.isfinite(r.placement_timeout) and r.placement_timeout > 0):
        p.append(f"--placement_timeout {r.placement_timeout:g}: must be a positive number of seconds")
    elif r.placement_timeout > MAX_PLACEMENT_TIMEOUT_S:  # Ray's wait overflows a C long far below 1e308
        p.append(f"--placement_timeout {r.placement_timeout:g}: at most {MAX_PLACEMENT_TIMEOUT_S} seconds (a year); "
                 "give the longest wait you mean, in seconds")
    if r.ray_address is not None and not r.ray_address.strip():
        p.append("--ray_address is empty; give 'auto', HOST:PORT of the head node, or leave the flag out")
    elif r.ray_address is not None and r.ray_address.strip().startswith("ray://"):
        p.append(f"--ray_address {r.ray_address}: Ray Client (ray://) is not supported: the launcher reads the data "
                 "and writes --output_dir on a shared filesystem, so run it on a node of the cluster with "
                 "--ray_address auto (or HOST:6379)")
    if p:
        raise ConfigError(p)
