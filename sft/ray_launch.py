"""Ray launch path: the training of finetune.py in Ray Train workers placed by a Ray placement group.

    ray start --head --port 6379                    # node A
    ray start --address A:6379                      # every other node
    python scripts/ray_train.py --num_workers 2 --placement_strategy SPREAD [finetune.py flags]   # once, on A

The driver (:func:`main`, run once on any node of the cluster):

1. parses the finetune.py flags together with :class:`RayArguments` (one ``HfArgumentParser``, so the same YAML
   ``--config`` can hold both) and checks the configuration and every data record in this process, as
   ``finetune/launch.sh`` does before torchrun: a mistake is reported once, before any worker starts;
2. connects to Ray (``ray.init``), checks that the alive nodes can hold ``--num_workers`` workers under
   ``--placement_strategy`` (:func:`placement_problem`: a clear error at once instead of a placement group that
   waits forever), then reserves that placement group for at most ``--placement_timeout`` seconds;
3. runs Ray Train's ``TorchTrainer`` (torch.distributed set up by Ray: gloo on CPU, nccl on GPU, RANK /
   LOCAL_RANK / WORLD_SIZE / MASTER_ADDR set in each worker) with :func:`train_worker`, which calls the very
   ``finetune.main`` that torchrun runs: same parsing, resume (``--resume_from_checkpoint auto``), atomic
   checkpoints, rank-0 saves to ``--output_dir`` (which must be a path shared by every node);
4. turns SIGTERM / SIGINT into :func:`sft.preemption.request_stop` in every worker (Ray Train runs the training
   function in a thread, which cannot receive signals): the workers agree on a step, save a checkpoint and
   stop; the driver exits 75 like the torchrun launcher, and the same command resumes;
5. prints where each rank ran (Ray's node id and address) and writes it to ``<output_dir>/ray_placement.json``.

Exit codes: 0 done; 2 a configuration or data problem (message on stderr); 75 preempted (checkpoint saved);
1 a worker failed (its traceback is above, forwarded by Ray).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .errors import PREEMPTED_EXIT_CODE, ConfigError, SFTError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = {
    "PACK": "as few nodes as possible (best effort)",
    "SPREAD": "as many different nodes as possible (best effort)",
    "STRICT_PACK": "all workers on one node, or fail",
    "STRICT_SPREAD": "every worker on a different node, or fail",
}
PLACEMENT_FILE = "ray_placement.json"
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
        metadata={"help": "How Ray places the workers on nodes: " + "; ".join(f"{k}: {v}" for k, v in STRATEGIES.items())
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


# --------------------------------------------------------------------------------------------------- placement

def worker_resources(r: RayArguments, use_gpu: bool) -> dict:
    """One worker's Ray resources (one placement-group bundle), e.g. ``{"CPU": 1.0}`` or ``{"CPU": 1.0, "GPU": 1.0}``."""
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

    ``nodes``: entries of ``ray.nodes()`` (``Alive``, ``Resources`` = total, not free, resources, ``NodeManagerHostname``,
    ``NodeManagerAddress``). Rules follow Ray's placement group strategies: STRICT_SPREAD needs ``num_workers``
    distinct nodes that each fit one bundle; STRICT_PACK one node that fits all; PACK and SPREAD only the total.
    Resources used by other jobs are not counted here (that wait is bounded by ``--placement_timeout``).
    """
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    seen = "; the cluster's alive nodes: " + (", ".join(_node_line(n) for n in alive) or "none")
    need = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
    if bundle.get("GPU", 0) > 0 and not any(n.get("Resources", {}).get("GPU", 0) > 0 for n in alive):
        return (f"--use_gpu True: each of the {num_workers} worker(s) needs GPU {bundle['GPU']:g}, but no alive node of "
                f"the cluster has a GPU{seen}. Fix: --use_gpu False (or leave --use_gpu out: GPUs are used when the "
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


def reserve_placement(strategy: str, num_workers: int, bundle: dict, timeout_s: float) -> None:
    """Reserve the workers' placement group once, waiting at most ``timeout_s`` seconds, then release it for Ray
    Train (whose own wait retries without end when the resources never come).

    Raises:
        SFTError: not reserved in time (resources held by other jobs, or nodes lost meanwhile).
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy)
    try:
        if not pg.wait(timeout_seconds=timeout_s):
            raise SFTError(f"Ray could not reserve {num_workers} x {bundle} with --placement_strategy {strategy} "
                           f"within --placement_timeout {timeout_s:g} s, although the alive nodes can hold them: they are in use by "
                           "other jobs (see `ray status`), or the timeout is too short for Ray to place them; free "
                           "them, wait, or raise --placement_timeout")
    finally:
        remove_placement_group(pg)


# ---------------------------------------------------------------------------------------------------- workers

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
    """A worker's finetune.main returned an error code; raised so that Ray Train stops every worker."""


def _poll_stop(coordinator, done: threading.Event, interval_s: float = 1.0) -> None:
    """Worker thread: when the driver asks to stop, act as if this process had received the signal."""
    import ray

    from .preemption import request_stop

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
    return f"Ray is draining node(s) {', '.join(n[:12] for n in info.preempted_node_ids)} (ranks {info.preempted_ranks}{deadline})"


def _deepspeed_on_cpu_quietly() -> None:
    """DS_ACCELERATOR=cpu in a process without CUDA, as finetune/launch.sh does: DeepSpeed's choice anyway, without
    its warning. Called in the driver and in every worker (each node decides for itself)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def train_worker(config: dict) -> None:
    """Ray Train's training function (one call per worker): ``finetune.main(config["argv"])`` in
    ``config["cwd"]`` (the driver's working directory, so relative paths mean the same on every node).

    Raises:
        WorkerFailed: finetune.main returned a code other than 0 or 75 (its message is already on stderr).
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
    if config["root"] not in sys.path:
        sys.path.insert(0, config["root"])
    _deepspeed_on_cpu_quietly()
    import finetune  # imports transformers; before the poll thread starts (two threads importing it race)

    from . import preemption  # imported here for the same reason

    preemption.add_step_check(_node_drain_notice)

    done = threading.Event()
    threading.Thread(target=_poll_stop, args=(coordinator, done), daemon=True, name="sft-stop-poll").start()
    try:
        code = finetune.main(list(config["argv"]), extra=(RayArguments,))
    finally:
        done.set()
    ray.get(coordinator.report_outcome.remote(rank, code))
    if code not in (0, PREEMPTED_EXIT_CODE):
        raise WorkerFailed(f"rank {rank} on {info['hostname']} exited with code {code} (its message is above)")


# ----------------------------------------------------------------------------------------------------- driver

def _print(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


_SUMMARY: list[str] = []  # the driver's closing lines, printed after ray.shutdown() (after Ray's forwarded output)


def _summary(msg: str) -> None:
    _SUMMARY.append(msg)


class _Interrupted(Exception):
    """SIGTERM before training started (nothing to save)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise _Interrupted(signum)


def _job_env() -> dict:
    """Environment for every process of this Ray job (set once in ``ray.init``, so the coordinator, Ray Train's
    controller and the workers share it): the repository on PYTHONPATH (the same path on every node), this
    project's SFT_* switches and the Hugging Face offline switches. Anything per node (NCCL_*, GLOO_*, HF_HOME)
    comes from the environment of ``ray start`` on that node."""
    env = {k: v for k, v in os.environ.items()
           if (k.startswith("SFT_") and k not in ("SFT_CHECK_ONLY", "SFT_EXIT_CODE_FILE"))
           or k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


GCS_CONNECT_TIMEOUT_S = 10.0


def _gcs_unreachable(address: Optional[str], timeout_s: float = GCS_CONNECT_TIMEOUT_S) -> Optional[str]:
    """Why a HOST:PORT Ray address (``--ray_address``, else ``$RAY_ADDRESS``) is not reachable, or None.

    ``ray.init`` retries an unreachable GCS for minutes, printing a warning every few seconds; one TCP connect with
    ``timeout_s`` tells at once. ``auto``/``local``/unset (Ray's own lookup) are left to Ray.
    """
    flag = "--ray_address"
    env = os.environ.get("RAY_ADDRESS", "").strip() or None
    if env and (address is None or address.strip() == "auto"):  # ray.init's own rule: the variable wins then
        address, flag = env, "$RAY_ADDRESS" + (" (which --ray_address auto uses)" if address else "")
    if address is None or address.strip().lower() in ("auto", "local"):
        return None
    if "://" in address:
        if flag.startswith("$") and address.startswith("ray://"):
            return (f"{flag} {address}: Ray Client (ray://) is not supported: the launcher reads the data and writes "
                    "--output_dir on a shared filesystem; unset RAY_ADDRESS or set it to HOST:PORT of the head "
                    "(e.g. 10.0.0.1:6379), and run the launcher on a node of the cluster")
        return None
    a = address.strip()
    host, sep, port = a.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return (f"{flag} {address}: not a Ray address; give HOST:PORT of the head node's GCS (e.g. 10.0.0.1:6379, "
                "the port of `ray start --head --port`), 'auto' or 'local'")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e) or type(e).__name__)
        return (f"{flag} {address}: no Ray head answers at {host}:{port} ({why}); check the "
                "address and port of `ray start --head --port` on the head node and that the head is running, or "
                "use --ray_address local for a Ray on this machine alone")
    return None


def _connect(address: Optional[str]):
    import ray

    problem = _gcs_unreachable(address)
    if problem:
        raise SFTError(problem)
    try:
        # Ray's own lookup when unset: $RAY_ADDRESS, the cluster `ray start` made on this machine, else a new one.
        # Ray's library loggers in every actor of this job at ERROR: without Ray's dashboard (ray[train] does not
        # install it) Ray Train's placement-group cleaner warns every second that the state API is unavailable.
        # Ray Train's errors, the workers' output and this launcher's own report still show.
        # SIGTERM blocked while Ray may start its daemons here (a local Ray): they inherit the mask (as Ray itself
        # does for SIGINT), so a SIGTERM to the whole process group or job step (`timeout`, SLURM, systemd) reaches
        # this launcher, which then stops the workers after a checkpoint, and not Ray's GCS and raylet under them.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            ray.init(address=address, logging_level="WARNING", runtime_env={"env_vars": _job_env()},
                     logging_config=ray.LoggingConfig(log_level="ERROR"))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise SFTError(f"--ray_address {address}: cannot connect to a Ray cluster ({first}); start one with "
                       "`ray start --head --port 6379` on the head node, give its HOST:PORT, or leave "
                       "--ray_address out to start Ray on this machine") from None


def _report_placement(placement: dict, out_dir: str, strategy: str) -> None:
    if not placement:
        return
    ranks = [placement[r] for r in sorted(placement)]
    nodes = sorted({p["node_id"] for p in ranks})
    _summary(f"ray: placement {strategy}: {len(ranks)} worker(s) on {len(nodes)} node(s)")
    for p in ranks:
        _summary(f"ray:   rank {p['rank']} (local rank {p['local_rank']}) on {p['hostname']} ({p['node_ip']}, "
               f"node {p['node_id'][:12]}), pid {p['pid']}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, PLACEMENT_FILE), "w", encoding="utf-8") as f:
            json.dump({"placement_strategy": strategy, "nodes": len(nodes), "workers": ranks}, f, indent=2)
    except OSError as e:
        _summary(f"ray: warning: cannot write {os.path.join(out_dir, PLACEMENT_FILE)}: {e.strerror}")


class _Signals:
    """Driver's SIGTERM/SIGINT: the first one asks every worker to stop after a checkpoint; later ones are
    reported and ignored (the workers' --preemption_timeout watchdog bounds the wait)."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous = {}

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _on_signal(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            os.write(2, (f"ray: received {signal.Signals(signum).name}: asking every worker to finish its step, save a "
                         f"checkpoint and stop (exit {PREEMPTED_EXIT_CODE})\n").encode())
        else:
            os.write(2, b"ray: already stopping: waiting for the workers' checkpoint (--preemption_timeout bounds it)\n")


def _fit(trainer, coordinator, preemption_timeout: float):
    """``trainer.fit()`` in a thread (so that Ray Train does not take SIGINT, and signals reach this main thread).
    Returns ``(result, error, signum)``."""
    import ray

    box: dict = {}

    def target():
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="ray-train-fit")
    with _Signals() as sig:
        t.start()
        sent_at = None
        while t.is_alive():
            t.join(0.5)
            if sig.signum is not None and sent_at is None:
                ray.get(coordinator.request_stop.remote(sig.signum))
                sent_at = time.monotonic()
            if sent_at is not None and time.monotonic() - sent_at > preemption_timeout + 60:
                _print("ray: the workers did not stop within --preemption_timeout + 60 s; leaving them to Ray")
                break
    return box.get("result"), box.get("error"), sig.signum


def _worker_error(err: BaseException) -> str:
    text = str(err).strip()
    for line in text.splitlines():
        if "WorkerFailed:" in line:
            return line.split("WorkerFailed:", 1)[1].strip()
    return text[-3000:] if text else type(err).__name__


def main(argv: Optional[list[str]] = None) -> int:
    """``scripts/ray_train.py``: see the module docstring. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        import transformers

        parser = transformers.HfArgumentParser((RayArguments,))
        parser.prog = "ray_train.py"
        print(parser.format_help())
        print("\nEvery finetune.py flag is accepted too (python finetune.py -h); --config YAML may hold both kinds.")
        return 0
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)  # replaced by _fit's own handlers during training
    try:
        return _drive(argv)
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
        _print("interrupted before training started (SIGINT); nothing to save")
        return 130
    except _Interrupted as e:
        _print(f"interrupted before training started ({signal.Signals(e.signum).name}); nothing to save")
        return 128 + e.signum
    except SFTError as e:
        if os.environ.get("SFT_DEBUG"):
            raise
        label = "preempted" if e.exit_code == PREEMPTED_EXIT_CODE else "error"
        _print(f"{label}: {e}")
        return e.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _drive(argv: list[str]) -> int:
    from .arguments import parse_args

    ray_args = parse_args(argv, (RayArguments,))[4]
    check_ray_args(ray_args)
    # The whole configuration and every data record, once, here (what each worker will also check).
    import finetune

    _deepspeed_on_cpu_quietly()

    os.environ["SFT_CHECK_ONLY"] = "1"
    try:
        code = finetune.main(argv, extra=(RayArguments,))
    finally:
        del os.environ["SFT_CHECK_ONLY"]
    if code:
        return code
    import ray

    _connect(ray_args.ray_address)
    _SUMMARY.clear()
    try:
        return _train(ray_args, argv)
    finally:
        ray.shutdown()
        for line in _SUMMARY:  # last, after everything Ray forwarded from the workers
            _print(line)


def _train(ray_args: RayArguments, argv: list[str]) -> int:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = sum(n.get("Resources", {}).get("GPU", 0.0) for n in nodes)
    use_gpu = ray_args.use_gpu if ray_args.use_gpu is not None else gpus > 0
    num_workers = ray_args.num_workers or (max(1, int(gpus // ray_args.gpus_per_worker)) if use_gpu else len(nodes))
    bundle = worker_resources(ray_args, use_gpu)
    problem = placement_problem(nodes, ray_args.placement_strategy, num_workers, bundle)
    if problem:
        raise SFTError(problem)
    # Defaults placed before the user's flags (the last occurrence wins), as finetune/launch.sh does; no tqdm
    # bars (Ray forwards worker output line by line; the step lines of sft.callbacks show progress).
    defaults = ((["--ddp_timeout", "600"] if num_workers > 1 else []) + (["--bf16", "True"] if use_gpu else [])
                + ["--disable_tqdm", "True"])
    worker_argv = defaults + argv
    from .arguments import parse_args

    training_args = parse_args(worker_argv, (RayArguments,))[2]
    _print(f"ray: {len(nodes)} alive node(s); {num_workers} worker(s) x {bundle}, placement {ray_args.placement_strategy}")
    reserve_placement(ray_args.placement_strategy, num_workers, bundle, ray_args.placement_timeout)

    # print() in the workers as-is (Ray Train's print patch would show every Trainer log line twice).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    here = ray.get_runtime_context().get_node_id()
    coordinator = ray.remote(num_cpus=0)(Coordinator).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote()
    out_dir = os.path.abspath(training_args.output_dir)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"argv": worker_argv, "cwd": os.getcwd(), "root": ROOT, "coordinator": coordinator},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=int(training_args.ddp_timeout)),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=bundle,
                                     placement_strategy=ray_args.placement_strategy),
        run_config=RunConfig(name=f"sft-{os.path.basename(out_dir)}-{time.strftime('%Y%m%d-%H%M%S')}",
                             failure_config=FailureConfig(max_failures=0)),
    )
    result, error, signum = _fit(trainer, coordinator, training_args.preemption_timeout)
    signal.signal(signal.SIGTERM, lambda *_: os.write(2, b"ray: training is over; shutting Ray down\n"))
    placement, outcomes = ray.get(coordinator.state.remote())
    _report_placement(placement, out_dir, ray_args.placement_strategy)
    if signum is not None and (error is not None or PREEMPTED_EXIT_CODE in outcomes.values() or result is None):
        _summary(f"preempted: stopped by {signal.Signals(signum).name}; the checkpoint is in {out_dir}; run the same "
               f"command again to resume (exit {PREEMPTED_EXIT_CODE})")
        return PREEMPTED_EXIT_CODE
    if error is not None:
        bad = sorted(c for c in outcomes.values() if c not in (0, PREEMPTED_EXIT_CODE))
        _summary(f"error: Ray Train stopped: {_worker_error(error)}")
        return bad[0] if bad else 1
    if PREEMPTED_EXIT_CODE in outcomes.values():  # the workers were signalled directly (e.g. by a scheduler)
        _summary(f"preempted: the checkpoint is in {out_dir}; run the same command again to resume")
        return PREEMPTED_EXIT_CODE
    return 0
