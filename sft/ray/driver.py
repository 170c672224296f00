"""The Ray launcher's driver, run once on any node of the cluster (``sft-ray``, ``scripts/ray_train.py``,
``finetune/finetune_ray.sh``)::

    ray start --head --port 6379                    # node A
    ray start --address A:6379                      # every other node
    sft-ray --num_workers 2 --placement_strategy SPREAD [finetune.py flags]   # once, on A

1. parses the finetune.py flags together with :class:`~sft.ray.flags.RayArguments` once (one
   ``HfArgumentParser``, so the same YAML ``--config`` can hold both) and checks the configuration and every
   data record in this process, as ``finetune/launch.sh`` does before torchrun: a mistake is reported once,
   before any worker starts;
2. connects to Ray (``ray.init``), checks that the alive nodes can hold ``--num_workers`` workers under
   ``--placement_strategy`` (:func:`~sft.ray.placement.placement_problem`), then reserves that placement
   group for at most ``--placement_timeout`` seconds;
3. runs Ray Train's ``TorchTrainer`` (torch.distributed set up by Ray: gloo on CPU, nccl on GPU, RANK /
   LOCAL_RANK / WORLD_SIZE / MASTER_ADDR set in each worker) with :func:`~sft.ray.worker.train_worker`, which
   runs the very training that torchrun runs: same parsing, resume, atomic checkpoints, rank-0 saves to
   ``--output_dir`` (which must be a path shared by every node);
4. turns SIGTERM / SIGINT into a stop request for every worker (through the coordinator actor): the workers
   agree on a step, save a checkpoint and stop; the driver exits 75 like the torchrun launcher;
5. prints where each rank ran and writes it to ``<output_dir>/ray_placement.json``.

Exit codes: 0 done; 2 a configuration or data problem (message on stderr); 75 preempted (checkpoint saved);
1 a worker failed (its traceback is above, forwarded by Ray).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

from sft.distributed.contract import resolve
from sft.distributed.process_group import deepspeed_cpu_default
from sft.errors import PREEMPTED_EXIT_CODE, SFTError
from sft.policy import run_cli
from sft.ray.flags import RayArguments, check_ray_args
from sft.ray.placement import placement_problem, worker_resources
from sft.ray.worker import Coordinator, train_worker

PLACEMENT_FILE = "ray_placement.json"


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
                           f"within --placement_timeout {timeout_s:g} s, although the alive nodes can hold them: "
                           "they are in use by other jobs (see `ray status`), or the timeout is too short for Ray to "
                           "place them; free them, wait, or raise --placement_timeout")
    finally:
        remove_placement_group(pg)


def _print(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _job_env() -> dict:
    """Environment for every process of this Ray job (set once in ``ray.init``, so the coordinator, Ray Train's
    controller and the workers share it): this project's SFT_* switches and the Hugging Face offline switches.
    Anything per node (NCCL_*, GLOO_*, HF_HOME) comes from the environment of ``ray start`` on that node; the
    ``sft`` package must be installed in the Python that ``ray start`` runs on every node."""
    return {k: v for k, v in os.environ.items()
            if (k.startswith("SFT_") and k != "SFT_EXIT_CODE_FILE")
            or k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM")}


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
        resolve(host)  # an OSError also for a text that is no host name (socket itself raises UnicodeError then)
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


def _placement_lines(placement: dict, out_dir: str, strategy: str) -> list[str]:
    """Where each rank ran, as closing lines; also written to ``<out_dir>/ray_placement.json``."""
    if not placement:
        return []
    ranks = [placement[r] for r in sorted(placement)]
    nodes = sorted({p["node_id"] for p in ranks})
    lines = [f"ray: placement {strategy}: {len(ranks)} worker(s) on {len(nodes)} node(s)"]
    lines += [f"ray:   rank {p['rank']} (local rank {p['local_rank']}) on {p['hostname']} ({p['node_ip']}, "
              f"node {p['node_id'][:12]}), pid {p['pid']}" for p in ranks]
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, PLACEMENT_FILE), "w", encoding="utf-8") as f:
            json.dump({"placement_strategy": strategy, "nodes": len(nodes), "workers": ranks}, f, indent=2)
    except OSError as e:
        lines.append(f"ray: warning: cannot write {os.path.join(out_dir, PLACEMENT_FILE)}: {e.strerror}")
    return lines


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
            os.write(2, b"ray: already stopping: waiting for the workers' checkpoint "
                        b"(--preemption_timeout bounds it)\n")


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
    """``sft-ray`` / ``scripts/ray_train.py``: see the module docstring. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        import transformers

        parser = transformers.HfArgumentParser((RayArguments,))
        parser.prog = "sft-ray"
        print(parser.format_help())
        print("\nEvery finetune.py flag is accepted too (python finetune.py -h); --config YAML may hold both kinds.")
        return 0
    # SIGINT / SIGTERM before training started (nothing to save): the policy's one line and exit 130 / 143;
    # _fit's own handlers take over while the workers train.
    return run_cli(lambda: _drive(argv))


def _drive(argv: list[str]) -> int:
    """Parse once, check once, connect, train. The defaults the workers get are placed before the user's flags
    (the last occurrence wins), as finetune/launch.sh does: ``--ddp_timeout 600`` (a lost worker stops the others
    after 10 minutes, not transformers' 30) and no tqdm bars (Ray forwards worker output line by line; the step
    lines of sft.train.metrics show progress); ``--bf16 True`` is added once the cluster is known to have GPUs."""
    from sft.app.check import check_parsed
    from sft.config.arguments import parse_args

    argv = ["--ddp_timeout", "600", "--disable_tqdm", "True"] + argv
    model_args, data_args, training_args, lora_args, ray_args = parse_args(argv, (RayArguments,))
    check_ray_args(ray_args)
    deepspeed_cpu_default()
    # The whole configuration and every data record, once, here (what each worker will also check).
    workers = [ray_args.num_workers] if ray_args.num_workers > 0 else None  # 0: one per GPU / node, known later
    for line in check_parsed(model_args, data_args, training_args, lora_args, workers):
        _print(f"check: {line}")
    import ray

    _connect(ray_args.ray_address)
    closing: list[str] = []
    try:
        code, closing = _train(ray_args, training_args, argv)
        return code
    finally:
        ray.shutdown()
        for line in closing:  # last, after everything Ray forwarded from the workers
            _print(line)


def _train(ray_args: RayArguments, training_args, argv: list[str]) -> tuple[int, list[str]]:
    """Place and run the workers. Returns ``(exit code, closing lines)``."""
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
    worker_argv = (["--bf16", "True"] if use_gpu else []) + argv
    _print(f"ray: {len(nodes)} alive node(s); {num_workers} worker(s) x {bundle}, "
           f"placement {ray_args.placement_strategy}")
    reserve_placement(ray_args.placement_strategy, num_workers, bundle, ray_args.placement_timeout)

    # print() in the workers as-is (Ray Train's print patch would show every Trainer log line twice).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    here = ray.get_runtime_context().get_node_id()
    coordinator = ray.remote(num_cpus=0)(Coordinator).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote()
    out_dir = os.path.abspath(training_args.output_dir)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"argv": worker_argv, "cwd": os.getcwd(), "coordinator": coordinator},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=int(training_args.ddp_timeout)),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=bundle,
                                     placement_strategy=ray_args.placement_strategy),
        run_config=RunConfig(name=f"sft-{os.path.basename(out_dir)}-{time.strftime('%Y%m%d-%H%M%S')}",
                             failure_config=FailureConfig(max_failures=0)),
    )
    result, error, signum = _fit(trainer, coordinator, training_args.preemption_timeout)
    signal.signal(signal.SIGTERM, lambda *_: os.write(2, b"ray: training is over; shutting Ray down\n"))
    placement, outcomes = ray.get(coordinator.state.remote())
    lines = _placement_lines(placement, out_dir, ray_args.placement_strategy)
    if signum is not None and (error is not None or PREEMPTED_EXIT_CODE in outcomes.values() or result is None):
        return PREEMPTED_EXIT_CODE, lines + [
            f"preempted: stopped by {signal.Signals(signum).name}; the checkpoint is in {out_dir}; run the same "
            f"command again to resume (exit {PREEMPTED_EXIT_CODE})"]
    if error is not None:
        bad = sorted(c for c in outcomes.values() if c not in (0, PREEMPTED_EXIT_CODE))
        return (bad[0] if bad else 1), lines + [f"error: Ray Train stopped: {_worker_error(error)}"]
    if PREEMPTED_EXIT_CODE in outcomes.values():  # the workers were signalled directly (e.g. by a scheduler)
        return PREEMPTED_EXIT_CODE, lines + [f"preempted: the checkpoint is in {out_dir}; run the same command "
                                             "again to resume"]
    return 0, lines
