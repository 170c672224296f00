"""Placement arithmetic as pure functions: one worker's Ray resources, and whether the alive nodes can ever hold
the workers under a placement strategy (a clear error at once instead of a placement group that waits forever)."""
from __future__ import annotations

from typing import Optional

from sft.ray.flags import RayArguments


def worker_resources(r: RayArguments, use_gpu: bool) -> dict:
    """One worker's Ray resources (one placement-group bundle), e.g. ``{"CPU": 1.0}`` or \
``{"CPU": 1.0, "GPU": 1.0}``."""
    bundle = {"CPU": float(r.cpus_per_worker)}
    if use_gpu:
        bundle["GPU"] = float(r.gpus_per_worker)
    return bundle


def _fits(resources: dict, bundle: dict, times: int = 1) -> bool:
    return all(resources.get(k, 0.0) + 1e-9 >= v * times for k, v in bundle.items())


def _capacity(resources: dict, bundle: dict) -> int:
    return min(int((resources.get(k, 0.0) + 1e-9) // v) for k, v in bundle.items() if v > 0)


def _node_line(n: dict) -> str:
    res = n.get("Resources", {})
    shown = ", ".join(f"{k} {res[k]:g}" for k in ("CPU", "GPU") if k in res) or "no CPU/GPU"
    return f"{n.get('NodeManagerHostname', '?')} ({n.get('NodeManagerAddress', '?')}: {shown})"


def placement_problem(nodes: list[dict], strategy: str, num_workers: int, bundle: dict) -> Optional[str]:
    """Why the alive ``nodes`` can never hold ``num_workers`` bundles under ``strategy``, or None when they can.

    ``nodes``: entries of ``ray.nodes()`` (``Alive``, ``Resources`` = total, not free, resources, \
``NodeManagerHostname``,
    ``NodeManagerAddress``). Rules follow Ray's placement group strategies: STRICT_SPREAD needs ``num_workers``
    distinct nodes that each fit one bundle; STRICT_PACK one node that fits all; PACK and SPREAD only the total.
    Resources used by other jobs are not counted here (that wait is bounded by ``--placement_timeout``).
    """
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    seen = "; the cluster's alive nodes: " + (", ".join(_node_line(n) for n in alive) or "none")
    need = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
    if bundle.get("GPU", 0) > 0 and not any(n.get("Resources", {}).get("GPU", 0) > 0 for n in alive):
        return (f"--use_gpu True: each of the {num_workers} worker(s) needs GPU {bundle['GPU']:g}, but no alive node "
                f"of the cluster has a GPU{seen}. Fix: --use_gpu False (or leave --use_gpu out: GPUs are used when the "
                "cluster has them), or start Ray on GPU nodes")
    if strategy == "STRICT_SPREAD":
        ok = [n for n in alive if _fits(n.get("Resources", {}), bundle)]
        if len(ok) < num_workers:
            return (f"--placement_strategy STRICT_SPREAD puts each of the {num_workers} workers on a different node, "
                    f"each with {need}, but only {len(ok)} alive node(s) can hold one{seen}. Fix: --num_workers "
                    f"{max(len(ok), 1)}, start more nodes (ray start --address=HEAD:PORT), or --placement_strategy "
                    "SPREAD (different nodes where possible)")
    elif strategy == "STRICT_PACK":
        if not any(_fits(n.get("Resources", {}), bundle, num_workers) for n in alive):
            return (f"--placement_strategy STRICT_PACK puts all {num_workers} workers on one node, which needs "
                    f"{', '.join(f'{k} {v * num_workers:g}' for k, v in bundle.items())} on a single node{seen}. Fix: "
                    "fewer workers, smaller --cpus_per_worker/--gpus_per_worker, or --placement_strategy PACK")
    else:
        total = sum(_capacity(n.get("Resources", {}), bundle) for n in alive)
        if total < num_workers:
            return (f"{num_workers} workers with {need} each do not fit in the cluster: its alive nodes hold at most "
                    f"{total}{seen}. Fix: --num_workers {max(total, 1)}, smaller --cpus_per_worker/--gpus_per_worker, "
                    "or more nodes")
    return None
