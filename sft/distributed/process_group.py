"""The one owner of the distributed runtime inside a training process.

Order in a run (:func:`sft.app.train.train`): parse -> validate -> :func:`start_runtime` -> plan -> train -> save.

* :func:`prepare_training_args` -- while parsing: the CPU/gloo choice (pure).
* :func:`start_runtime` -- after validation, once per process, called by :func:`sft.app.train.begin`: a process group
  with ``--ddp_timeout`` under torchrun, then transformers' device setup on it, DeepSpeed's communication under
  ``--deepspeed``; returns the frozen :class:`Runtime` the run passes down. Until then nothing has started:
  transformers 5.24's ``__post_init__`` evaluates ``self.device`` (its step "8. Device Init"), which would start
  the process group through accelerate 1.15's ``PartialState`` -- on CPU without a timeout (torch's default:
  30 minutes) --, so :class:`sft.config.deferred.DeferredRuntime` answers ``device`` with None and the world size
  and ranks from torchrun's environment until the runtime has started.
* :func:`enable_fsdp` -- under ``--fsdp`` on CPU: the FSDP2 plugin that accelerate 1.15 drops for CPU
  process groups, given back as the Trainer creates its ``Accelerator`` (:mod:`sft.compat.accelerate`).
"""
from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import os
import signal
import socket
import sys
from typing import Mapping, Optional

from sft.compat.accelerate import enable_fsdp_on_cpu
from sft.compat.deepspeed import skip_shm_comm_op_build
from sft.distributed import collectives, expert_parallel, sequence_parallel, watchdog
from sft.distributed.expert_parallel import check_expert_parallel_size
from sft.distributed.sequence_parallel import SequenceParallel
from sft.errors import ConfigError
from sft.logs import release_import_notices

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclasses.dataclass(frozen=True)
class Runtime:
    """This process's place in the job, once the runtime has started (:func:`start_runtime`).

    Fields:
        world_size: processes of the job (1 without a process group).
        rank: this process's global rank (0..world_size-1).
        local_rank: its rank on this node (torchrun's ``LOCAL_RANK``; 0 in one process).
        device: the device it trains on, as torch spells it (``"cpu"``, ``"cuda:0"``).
        backend: the process group's backend (``"gloo"``, ``"nccl"``), or None without one.
        sequence_parallel: its place in sequence parallelism (:mod:`sft.distributed.sequence_parallel`; size 1:
            off).
    """

    world_size: int
    rank: int
    local_rank: int
    device: str
    backend: Optional[str]
    sequence_parallel: SequenceParallel = SequenceParallel()

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes what one process writes (logs of the job, the final model)."""
        return self.rank == 0


_STARTED: dict = {"runtime": None, "starting": False}  # this process's runtime: started once (start_runtime)


def current_runtime() -> Optional[Runtime]:
    """The :class:`Runtime` :func:`start_runtime` returned in this process, or None before it ran."""
    return _STARTED["runtime"]


def runtime_starting() -> bool:
    """True from the moment :func:`start_runtime` begins the device setup (transformers' ``device`` may then be
    evaluated: :class:`sft.config.deferred.DeferredRuntime`)."""
    return _STARTED["starting"] or _STARTED["runtime"] is not None


def die_with_agent(env: Mapping[str, str] = os.environ) -> bool:
    """In a worker that torchrun started: ask the kernel to SIGKILL this process when its parent, torchrun's
    agent, dies (``prctl(PR_SET_PDEATHSIG)``, Linux). torch 2.13 starts each worker in a session of its own, so a
    killed agent otherwise leaves its workers running as orphans that keep the other nodes' collectives alive
    (measured: the elastic survivors then never restart). A worker whose agent is already gone kills itself.
    Returns True when armed; False outside torchrun or where prctl is not available."""
    if "TORCHELASTIC_RUN_ID" not in env or not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def elastic_start_line(env: Mapping[str, str], world_size: int, resume: Optional[str]) -> Optional[str]:
    """The line each node's first worker logs at the start of every round of an elastic job (``SFT_ELASTIC=1``,
    exported by ``finetune/launch.sh`` for ``NNODES=MIN:MAX``), or None outside one: the world size of this
    round, the failures restarted so far on this node (torchrun's ``TORCHELASTIC_RESTART_COUNT`` of
    ``TORCHELASTIC_MAX_RESTARTS``; a node admitted later counts from 0) and the checkpoint it resumes from."""
    if env.get("SFT_ELASTIC") != "1":
        return None
    restarts, most = env.get("TORCHELASTIC_RESTART_COUNT", "0"), env.get("TORCHELASTIC_MAX_RESTARTS", "?")
    start = f"resuming from {os.path.abspath(resume)}" if resume else "no checkpoint yet: starting from step 0"
    return (f"elastic: this round has world size {world_size} ({env.get('GROUP_WORLD_SIZE', '?')} node(s)); "
            f"failures restarted so far on this node: {restarts} of {most}; {start}")


NCCL_TRACE_DIR = "nccl_trace"  # under --output_dir; not user content: an output folder holding only it counts as empty


def flight_recorder_defaults(output_dir: Optional[str], env=os.environ) -> dict:
    """On CUDA, PyTorch's NCCL flight recorder: the last collectives of every rank in a ring buffer
    (``TORCH_FR_BUFFER_SIZE``), dumped when a collective times out (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to one file per
    rank under ``OUTPUT_DIR/nccl_trace/rank_<N>`` (``TORCH_FR_DUMP_TEMP_FILE``: the prefix torch appends the rank
    to). Torch's own names (torch 2.13 ``distributed_c10d``; torchtitan sets the same three); a variable the user
    set is kept. Read the dumps with ``torchfrtrace OUTPUT_DIR/nccl_trace -p rank_`` (docs/multi-node.md). Sets
    them in ``env`` and returns those it set."""
    if not output_dir:
        return {}
    wanted = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_FR_DUMP_TEMP_FILE": os.path.join(os.path.abspath(output_dir), NCCL_TRACE_DIR, "rank_")}
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" in env:  # the older name of the buffer size, set by the user
        wanted.pop("TORCH_FR_BUFFER_SIZE")
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in env:  # the older name of the dump prefix
        wanted.pop("TORCH_FR_DUMP_TEMP_FILE")
    set_here = {k: v for k, v in wanted.items() if k not in env}
    env.update(set_here)
    if "TORCH_FR_DUMP_TEMP_FILE" in set_here:
        os.makedirs(os.path.dirname(set_here["TORCH_FR_DUMP_TEMP_FILE"]), exist_ok=True)
    return set_here


def init_process_group(backend: str | None, timeout_s: float, output_dir: Optional[str] = None) -> bool:
    """Initialise torch.distributed from torchrun's environment with a bounded timeout, and on CUDA with this
    process's device.

    CPU: transformers 5.24 ``TrainingArguments._setup_devices`` passes ``timeout=ddp_timeout`` to accelerate for
    GPUs but not for ``use_cpu`` runs, and accelerate 1.15 ``PartialState`` (MULTI_CPU branch) then calls
    ``init_process_group`` without it: a lost peer would block gloo for torch's 30-minute default.
    CUDA: accelerate 1.15 calls ``init_process_group`` without ``device_id``; NCCL then warns "Guessing device ID
    based on global rank. This can cause a hang if rank to GPU mapping is heterogeneous" at the first barrier.
    Here the group is bound to ``cuda:LOCAL_RANK`` (``torch.cuda.set_device`` first, as torchrun's convention maps
    local rank to device), backend ``--ddp_backend`` or ``nccl``.
    On CUDA the NCCL flight recorder is turned on first (:func:`flight_recorder_defaults`, dumps under
    ``output_dir``).
    Calling this first makes accelerate (and DeepSpeed) reuse our group. Returns True when it initialised the group.
    """
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not all(k in os.environ for k in ("RANK", "MASTER_ADDR", "MASTER_PORT")):
        return False  # not torchrun's env:// (e.g. an MPI launch): leave it to accelerate
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        flight_recorder_defaults(output_dir)
        dist.init_process_group(backend=backend or "nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group(backend=backend or "gloo", timeout=timeout)
    return True


def finish_process_group() -> None:
    """After a run that trained and saved: destroy the default process group, as torch asks before a process exits.

    Without it torch warns "destroy_process_group() was not called before program exit", and under gloo a rank
    that leaves first can abort at exit ("terminate called without an active exception", SIGABRT, exit 134: its
    communication threads torn down with the interpreter). Every rank meets at a barrier first, so none destroys its
    group while another still uses it. A no-op without a process group, and in a Ray worker (Ray Train owns that
    group: :mod:`sft.ray.worker` calls :func:`sft.app.train.train`, not this)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return

    with watchdog.RECORD.wait("collective barrier (the end of the run)"):
        dist.barrier()
    watchdog.stop()  # says "finished": a rank that leaves first is never named while the others close
    dist.destroy_process_group()
    _STARTED["finished"] = True


def finished_cleanly() -> bool:
    """True once :func:`finish_process_group` destroyed this process's group after every rank met at its barrier."""
    return bool(_STARTED.get("finished"))


def prepare_training_args(args) -> bool:
    """The device and backend choice while parsing (pure: nothing starts; see :func:`start_runtime`).

    On a machine without CUDA: ``use_cpu = True`` and ``ddp_backend`` defaults to ``gloo`` when several
    processes run (otherwise ``torchrun --nproc_per_node 2`` would start two independent trainings);
    ``--fp16`` is switched off. Returns True when ``--fp16 True`` was switched off for want of CUDA (recorded in
    ``training_args.parsed`` and reported by :func:`sft.app.validation.validate` with every other problem).
    """
    import torch

    if torch.cuda.is_available():
        return False
    args.use_cpu = True
    if args.ddp_backend is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        args.ddp_backend = "gloo"
    fp16_without_cuda, args.fp16 = bool(args.fp16), False
    return fp16_without_cuda


def start_runtime(training_args) -> Runtime:
    """Start this process's runtime and return it as a frozen :class:`Runtime`. The first call starts: workers that
    die with their torchrun agent (:func:`die_with_agent`), :mod:`faulthandler` (a process that crashes in C++ prints
    every thread's Python stack), the hang watcher (before the group where the agent's
    store allows, after it otherwise), the process group under torchrun with ``--ddp_timeout``
    (:func:`init_process_group`), then transformers' device setup on it (accelerate's ``PartialState`` reuses the
    group), the sequence-parallel groups of ``--sequence_parallel_size`` (:func:`sft.distributed.sequence_parallel.
    start`) and the expert-parallel groups of ``--expert_parallel_size`` (:func:`sft.distributed.expert_parallel.
    start`). Every call sets up ``training_args``' device on that runtime and, under ``--deepspeed`` or sequence
    parallelism (whose Ulysses attention exchanges through it), DeepSpeed's communication (:func:`init_deepspeed_comm`);
    later calls return the same :class:`Runtime`.

    Raises:
        ConfigError: torchrun's variables are incomplete or garbled (e.g. ``LOCAL_RANK`` set without
            ``MASTER_ADDR``): the library's own sentence, exit code 2.
    """

    runtime = current_runtime()
    # before anything starts (also in a process whose runtime started earlier): one line, exit 2, on every rank
    check_sequence_parallel_size(training_args.sequence_parallel_size, collectives.world_size()
                                 if collectives.initialized() else training_args.world_size)
    if runtime is None:
        die_with_agent()  # every torchrun worker, CPU or GPU, before it joins a process group
        if not faulthandler.is_enabled():  # a rank that crashes in C++ (SIGSEGV, SIGABRT) prints its Python stacks
            faulthandler.enable(all_threads=True)
        if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                and os.environ.get("TORCHELASTIC_MAX_RESTARTS") == "0"):
            start_progress_watcher(training_args)  # the agent's store is up: a rank frozen before it joins is named
    try:
        if runtime is None:
            init_process_group(training_args.ddp_backend, training_args.ddp_timeout, training_args.output_dir)
        _STARTED["starting"] = True
        device = training_args.device  # transformers' _setup_devices, now on our process group
    except ValueError as e:  # torchrun's variables incomplete or garbled (torch's / accelerate's text)
        raise ConfigError([str(e).strip()]) from None
    finally:
        _STARTED["starting"] = False
    if runtime is None:
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if grouped else 1
        check_sequence_parallel_size(training_args.sequence_parallel_size, world)
        runtime = Runtime(world_size=dist.get_world_size() if grouped else 1, rank=dist.get_rank() if grouped else 0,
                          local_rank=int(os.environ.get("LOCAL_RANK", "0")) if grouped else 0, device=str(device),
                          backend=dist.get_backend() if grouped else None,
                          sequence_parallel=sequence_parallel.start(training_args.sequence_parallel_size))
        check_expert_parallel_size(training_args.expert_parallel_size, world)
        expert_parallel.start(training_args.expert_parallel_size)  # groups of E/N experts per rank, and replicas
        _STARTED["runtime"] = runtime
        start_progress_watcher(training_args)
    init_deepspeed_comm(training_args)
    return runtime


def check_sequence_parallel_size(size: int, world_size: int) -> None:
    """Raise ConfigError (one line) when ``--sequence_parallel_size`` does not divide the world size."""
    if size > 1 and world_size % size:
        raise ConfigError([f"--sequence_parallel_size {size}: does not divide the world size {world_size} (nodes x "
                           f"processes per node); launch a multiple of {size} processes or give a divisor of "
                           f"{world_size}"])


def hang_timeout_s(hang_timeout: Optional[float], ddp_timeout: float) -> float:
    """``--hang_timeout`` in force: the value given, or unset: 300 s, at most half of ``--ddp_timeout`` (a stuck
    rank is named before torch's own timeout ends the job without saying which), and at least 30 s: no hair trigger
    under a very short ``--ddp_timeout`` (then torch's timeout comes first inside a collective; a rank frozen
    outside one is still named)."""
    return float(hang_timeout) if hang_timeout is not None else min(300.0, max(float(ddp_timeout) / 2, 30.0))


def start_progress_watcher(training_args, env: Mapping[str, str] = os.environ):
    """Under torchrun with several processes: the progress watcher (:mod:`sft.distributed.watchdog`) with
    ``--hang_timeout`` and the straggler report's beats (``--straggler_factor`` > 0), on the job's store
    (``MASTER_ADDR:MASTER_PORT``). Returns it, or None (one process, not torchrun -- Ray Train owns its group --,
    or both switched off). On the agent's store of a job that never restarts (a static rendezvous) it starts before
    the process group, keys named by the run id; otherwise after it, with one collective (rank 0's token: every rank
    calls it). Idempotent."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    import uuid

    timeout = hang_timeout_s(training_args.hang_timeout, training_args.ddp_timeout)
    running = watchdog.current()
    if running is not None and running.is_alive():
        return running
    world, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    if world <= 1 or (timeout <= 0 and not training_args.straggler_factor):
        return None
    import torch.distributed as dist

    if collectives.initialized():  # one collective: rank 0's token names this round's keys (rounds may share a store)
        token = collectives.broadcast_object(uuid.uuid4().hex if collectives.rank() == 0 else None)
    else:  # before the group, on the agent's store of a job that never restarts: one round, named by its run id
        token = f"{env.get('TORCHELASTIC_RUN_ID', 'none')}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    interval = watchdog.interval_for(timeout)
    host, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,  # a connection of its own
                          timeout=datetime.timedelta(seconds=max(2.0, 2 * interval)))
    identity = {"host": socket.gethostname(), "pid": os.getpid(),
                "node_rank": int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
                "local_rank": int(env.get("LOCAL_RANK", "0"))}
    watcher = watchdog.Watcher(store, token, rank, world, timeout, interval, identity, store_name=f"{host}:{port}")
    watchdog.set_current(watcher)
    watcher.start()
    return watcher


def deepspeed_cpu_default() -> None:
    """``DS_ACCELERATOR=cpu`` in a process without CUDA (as ``finetune/launch.sh`` exports it): DeepSpeed's own
    choice there anyway, without its warning about choosing it. Each node decides for itself."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def init_deepspeed_comm(training_args) -> None:
    """Under DeepSpeed (or ``--sequence_parallel_size`` > 1: DeepSpeed's Ulysses attention exchanges through
    ``deepspeed.comm``), start ``deepspeed.comm`` on the process group before the model is built.

    ZeRO-3 builds the model inside ``deepspeed.zero.Init`` (transformers does this in ``from_pretrained``
    when the config has stage 3), which partitions each parameter as it is created and reads the world
    size from ``deepspeed.comm``; before ``deepspeed.init_distributed`` it sees a world of 1 and rejects the
    batch sizes. ``training_args.device`` creates the torch process group first (gloo on CPU, nccl on
    GPU, with ``--ddp_timeout``); ``init_distributed`` then reuses it. A single process started without
    torchrun gets a one-process world on loopback (DeepSpeed would otherwise look for MPI).
    """
    if not training_args.deepspeed and (training_args.sequence_parallel_size <= 1 or training_args.world_size <= 1):
        return
    import torch

    release_import_notices("deepspeed")  # this run uses DeepSpeed: its import-time notices concern it
    deepspeed_cpu_default()
    skip_shm_comm_op_build()
    import deepspeed

    _ = training_args.device  # initializes torch.distributed when torchrun started us (accelerate PartialState)
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    backend = (torch.distributed.get_backend() if torch.distributed.is_initialized()
               else "nccl" if torch.cuda.is_available() else "gloo")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=training_args.ddp_timeout))


def enable_fsdp(trainer) -> None:
    """Under ``--fsdp`` in several CPU processes, give accelerate's state the FSDP2 plugin it drops on CPU
    (:func:`sft.compat.accelerate.enable_fsdp_on_cpu`), so that the model is sharded with ``fully_shard`` over
    gloo instead of being replicated by DDP. Called by the Trainer right after it creates its
    ``Accelerator`` (:class:`sft.train.trainer.Trainer`), before the model is prepared. GPU runs are untouched."""
    if trainer.args.fsdp_plugin_args is None or trainer.is_fsdp_enabled or not trainer.args.use_cpu:
        return

    if enable_fsdp_on_cpu(trainer.accelerator, trainer.args.fsdp_plugin_args):
        trainer.is_fsdp_enabled = True
