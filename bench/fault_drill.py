#!/usr/bin/env python
"""A fault drill for an elastic job: 10 faults thrown at one run, nothing lost (a script, not a test; needs root).

    PYTHONPATH=. .venv/bin/python bench/fault_drill.py --seed 1

(``PYTHONPATH=.``: it uses the namespace hosts of ``tests/helpers/netns.py`` and the tiny test model of
``tests/helpers/assets.py``, built once into ``SFT_TEST_ASSETS``, default ``.cache/test-assets``.)

Five network-namespace hosts (``tests/helpers/netns.py``: a private bridge, 10.213.0.0/24) run the real
launcher with ``NNODES=2:3`` and the DDP LoRA preset (``finetune/finetune_lora_single_gpu.sh``) on the tiny
test model and 24 toy conversations, global batch 6 at world sizes 3 and 2 (micro batch 1 x accumulation 2 x
3 nodes; ``sft/train/world_size.py`` makes it accumulation 3 at 2 nodes), a checkpoint every 4 steps, at most 3
kept. Hosts 0-2 start the job; host 0 serves the rendezvous store and is never hurt (an elastic job does not
survive losing it: docs/multi-node.md). ``--seed`` draws the 5 kill steps (of 140; at least 45 steps after a node
kill, whose replacement starts meanwhile, and 10 after a worker kill); the faults, in this order:

1. kill 1, a node: everything on host 2 (launcher, agent, worker) SIGKILLed at once, as in a crash;
   then replacement host 3 is started (join 1) and must be admitted at a restart (world size 3 again);
2. kill 2, a worker: host 1's training process alone SIGKILLed (its launcher and agent stay); right after,
   one byte of the newest complete checkpoint's adapter weights is flipped (corruption 1);
3. kill 3, a node: host 3 (the first replacement); replacement host 4 is started (join 2);
4. kill 4, a worker: host 4's; and corruption 2 as in 2;
5. kill 5, a node: host 1; the two left (hosts 0 and 4, the minimum) train on at world size 2;
6. a full disk: ``--output_dir`` lies on its own tmpfs; once the round after kill 5 has written a checkpoint
   (at world size 2: accumulation 3, not the configured 2), a filler file (another job, say) takes all but half
   a checkpoint of its free space, so the next save overflows; the drill deletes the filler when the
   out-of-space message appears, and the job's next restart has room and resumes that checkpoint at its own
   world size (which must keep its accumulation 3).

Each kill must be followed by a restart of the workers (by torchrun, no person) that resumes from the newest
verified checkpoint at that moment (for a corrupted one: the previous complete one, with the log line that
says why); each join by a round of world size 3 that the new host is part of; the full disk by the
out-of-space paragraph naming the kept checkpoint, which must still verify, and a restart that resumes it.
Then the job must finish (exit 0 on the hosts left), and its per-step losses and final adapter must equal an
uninterrupted single-process run with the same global batch (micro batch 1 x accumulation 6) within 1e-4 and
1e-5: the same samples make every optimizer step at any world size (sft/train/world_size.py) and a resume is exact,
so only the order of the fp32 sums across ranks and micro batches differs (measured ~1e-7 in
tests/cluster/test_elastic.py and tests/integration/train/test_world_size_resume.py).

Prints one line per fault (tried / survived / evidence), ``faults survived: N of 10``, the wall time and the
load (``uptime``) before and after; exits 0 only when all 10 survived. A kill waits for the previous fault to
settle (its restart, the replacement's admission); if that pushes it past its drawn step, both steps are
printed. Removes the namespaces, the tmpfs and every process it started, also on failure or Ctrl-C; the logs
stay in ``--workdir`` (printed).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python") if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")) \
    else sys.executable
PRESET = os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh")  # DDP LoRA
MARKER = "sft_checkpoint_complete.json"  # sft.train.integrity.MARKER

SAVE_STEPS = 4
GLOBAL_BATCH = 6  # micro batch 1 x accumulation 2 x world size 3 = 1 x 3 x 2 = 1 x 6 x 1
ATOL_LOSS = 1e-4  # tolerances and their reason: the module docstring
ATOL_WEIGHTS = 1e-5
PORT = 6001
RDZV_ID = "drill"
TMPFS_MIB = 256  # the output folder's disk: 3 kept checkpoints (~18 MiB each, most of it tokenizer.json) and more


class DrillError(Exception):
    """The drill itself cannot go on (a wait ran out, the store host's launcher ended): one line."""


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def now() -> str:
    return time.strftime("%H:%M:%S")


def say(msg: str) -> None:
    print(f"[{now()}] {msg}", flush=True)


def draw_kill_steps(seed: int, steps: int, gap: int, join_gap: int) -> list[int]:
    """5 global steps, increasing, each after the first checkpoint (so that every restart resumes one, with the
    global batch it recorded), the last at least three checkpoints before the end (room for the full disk); after a
    node kill (kills 1 and 3: a replacement is started and admitted meanwhile) the next is at least ``join_gap``
    steps later, after a worker kill at least ``gap``."""
    lo, hi = SAVE_STEPS + 1, steps - 3 * SAVE_STEPS
    gaps = [join_gap, gap, join_gap, gap]
    if hi - lo < sum(gaps):
        raise SystemExit(f"--steps {steps} leaves no room for 5 kills after step {lo} with gaps {gaps}; give --steps "
                         f"{lo + sum(gaps) + 3 * SAVE_STEPS} or more, or smaller --gap/--join_gap")
    rng = random.Random(seed)
    slack = sorted(rng.randint(0, hi - lo - sum(gaps)) for _ in range(5))  # spread out again by the gaps
    return [lo + s + sum(gaps[:i]) for i, s in enumerate(slack)]


class Job:
    """The launchers on the namespace hosts, their logs, and what the logs say so far."""

    def __init__(self, hosts, work: str, argv: list[str], env: dict):
        self.hosts, self.work, self.argv, self.env = hosts, work, argv, env
        self.procs: dict[int, subprocess.Popen] = {}
        self.offsets: dict[int, int] = {}
        self.step = 0  # the last optimizer step logged by global rank 0 ("step N/M: ..."), whichever host has it
        self.logged = 0  # how many such lines so far

    def log(self, i: int) -> str:
        return os.path.join(self.work, f"host{i}.log")

    def start(self, i: int) -> None:
        out = open(self.log(i), "w")
        self.procs[i] = subprocess.Popen(self.hosts.cmd(i, self.argv), env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, cwd=self.work, start_new_session=True)
        out.close()
        self.offsets[i] = 0

    def text(self, i: int) -> str:
        with open(self.log(i), errors="replace") as f:
            return f.read()

    def poll(self) -> None:
        """Read what the logs gained; the newest ``step N/M:`` line sets :attr:`step`."""
        for i in self.procs:
            with open(self.log(i), errors="replace") as f:
                f.seek(self.offsets[i])
                new = f.read()
            cut = new.rfind("\n") + 1  # whole lines only
            self.offsets[i] += len(new[:cut].encode())
            found = re.findall(r"step (\d+)/\d+: ", new[:cut])
            if found:
                self.step, self.logged = int(found[-1]), self.logged + len(found)

    def wait_for(self, cond, what: str, limit: float) -> None:
        deadline = time.monotonic() + limit
        while True:
            self.poll()
            if cond():
                return
            if self.procs[0].poll() is not None:
                raise DrillError(f"host 0's launcher (the rendezvous store) ended with exit {self.procs[0].returncode} "
                                 f"before {what}; see {self.log(0)}")
            if time.monotonic() > deadline:
                raise DrillError(f"{what}: not within {limit:.0f} s; logs in {self.work}")
            time.sleep(0.2)

    def rounds(self) -> list[tuple[int, str | None]]:
        """Host 0's ``elastic: this round has world size W ...`` lines, in order: (W, checkpoint resumed or None)."""
        found = re.findall(r"elastic: this round has world size (\d+) \(\d+ node\(s\)\); failures restarted so far on "
                           r"this node: \d+ of \d+; (?:resuming from (\S+)|no checkpoint yet)", self.text(0))
        return [(int(w), ck or None) for w, ck in found]

    def kill_host(self, i: int) -> int:
        """SIGKILL everything on host ``i`` at once (its launcher, agent and worker), as in a crash."""
        pids = self.hosts.pids(i)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def worker_pid(self, i: int) -> int | None:
        """Host ``i``'s training process: the one running finetune.py that is neither the launcher's torchrun
        (``-m sft.distributed.torchrun``) nor its ``-m sft check``."""
        for pid in self.hosts.pids(i):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"finetune.py") for a in argv) and b"-m" not in argv and b"bash" not in argv[0]:
                return pid
        return None

    def close(self) -> None:
        from tests.helpers import netns

        netns.kill_groups(self.procs.values())


def newest_verified(out: str) -> str | None:
    from sft.train.checkpoint import checkpoint_dirs, verify

    for _, path in reversed(checkpoint_dirs(out)):
        if os.path.exists(os.path.join(path, MARKER)) and verify(path) is None:
            return path
    return None


def flip_a_byte(path: str) -> int:
    """XOR one byte in the middle of the tensor data of ``path`` (a safetensors file: an 8-byte header length,
    the JSON header, then the data) with 0xFF; returns its offset."""
    from tests.helpers.files import flip_byte

    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
        size = os.fstat(f.fileno()).st_size
    at = 8 + header + (size - 8 - header) // 2
    flip_byte(path, at)
    return at


def fallback_line(bad: str, previous: str) -> re.Pattern:
    """sft.train.checkpoint.choose_resume's warning for a checkpoint ``bad`` whose adapter weights changed on disk, when
    it resumes ``previous`` instead (with several ranks the reason starts ``on rank R:``)."""
    return re.compile(rf"not resuming from {re.escape(bad)}: (on rank \d+: )?adapter_model\.safetensors: its xxh3_128 "
                      rf"checksum differs from the one recorded when it was saved \(the bytes changed on disk\); "
                      rf"resuming from the previous complete checkpoint {re.escape(previous)} instead")


# sft.train.integrity.out_of_space_message: the file being written, and the complete checkpoint kept
OUT_OF_SPACE = re.compile(r"out of disk space while writing (\S+): .*?the previous complete checkpoint (\S+) is intact "
                          r"and the next start resumes from it")


def results(out: str):
    from safetensors.torch import load_file

    with open(os.path.join(out, "trainer_state.json")) as f:
        state = json.load(f)
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    return state["global_step"], losses, load_file(os.path.join(out, "adapter_model.safetensors"))


def train_flags(out: str, steps: int, grad_accum: int, seed: int, cache: str) -> list[str]:
    # dropout 0: dropout masks come from each rank's generator, which differs between world sizes
    return ["--output_dir", out, "--data_cache_dir", cache, "--max_steps", str(steps),
            "--lora_r", "4", "--lora_dropout", "0",
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", str(grad_accum),
            "--save_strategy", "steps", "--save_steps", str(SAVE_STEPS), "--save_total_limit", "3",
            "--disable_tqdm", "True", "--seed", str(seed), "--ddp_timeout", "30"]


class Fault:
    def __init__(self, name: str):
        self.name, self.tried, self.ok, self.evidence = name, False, False, "not reached"

    def line(self) -> str:
        state = "survived" if self.ok else ("NOT survived" if self.tried else "not tried")
        return f"{self.name:<34} tried: {'yes' if self.tried else 'no ':<3}  {state:<12}  {self.evidence}"


def drill(a, hosts, job: Job, out: str, tmpfs: str, faults: dict[str, Fault]) -> None:
    kills = draw_kill_steps(a.seed, a.steps, a.gap, a.join_gap)
    say(f"kill steps drawn with --seed {a.seed}: {kills} (of {a.steps}; a checkpoint every {SAVE_STEPS})")
    plan = [("node", 2, 3, False), ("worker", 1, None, True), ("node", 3, 4, False), ("worker", 4, None, True),
            ("node", 1, None, False)]  # (what is killed, on which host, replacement host started after, corrupt)
    for i in (0, 1, 2):
        job.start(i)
    job.wait_for(lambda: job.rounds(), "round 0", a.limit)
    if job.rounds()[0] != (3, None):
        raise DrillError(f"round 0 is {job.rounds()[0]}, not world size 3 from step 0 (a host started more than "
                         f"RDZV_LAST_CALL_TIMEOUT late?); see {job.log(0)}")
    say("round 0: world size 3 (hosts 0, 1, 2), from step 0")
    fresh = job.logged
    joins, corruptions = 0, 0
    for k, ((what, victim, replacement, corrupt), step) in enumerate(zip(plan, kills), 1):
        fault = faults[f"kill {k}"]
        seen = len(job.rounds())
        job.poll()
        logged = fresh  # the step lines logged when the current round began: the kill needs one of this round
        job.wait_for(lambda: job.logged > logged, f"a step of the round before kill {k}", a.limit)
        passed = job.step >= step  # the previous fault (a fallback, an admission) took the run past it already
        job.wait_for(lambda: job.step >= step, f"step {step} (kill {k})", a.limit)
        at = job.step
        if what == "node":
            n = job.kill_host(victim)
            how = f"host {victim} killed whole ({n} processes: launcher, agent, worker) at step {at}"
        else:
            pid = job.worker_pid(victim)
            if pid is None:
                raise DrillError(f"kill {k}: no training process found on host {victim}")
            os.kill(pid, signal.SIGKILL)
            how = f"host {victim}'s worker (pid {pid}) killed at step {at}, its launcher and agent left running"
        fault.tried = True
        late = "" if at == step else (f" (drawn: step {step}, passed while the previous fault settled)" if passed
                                      else f" (drawn: step {step}; the first step the log showed after it)")
        say(f"kill {k}: {how}{late}")
        time.sleep(0.5)  # a save whose all-gather finished just before the kill may still get its marker now
        expect = newest_verified(out)
        bad = None
        if corrupt:
            corruptions += 1
            cf = faults[f"corrupt {corruptions}"]
            bad, expect = expect, None
            cf.tried = True
            off = flip_a_byte(os.path.join(bad, "adapter_model.safetensors"))
            from sft.train.checkpoint import checkpoint_dirs, verify

            older = [p for s, p in checkpoint_dirs(out) if s < int(bad.rsplit("-", 1)[1])]
            expect = next((p for p in reversed(older) if os.path.exists(os.path.join(p, MARKER)) and verify(p) is None),
                          None)
            say(f"corrupt {corruptions}: flipped byte {off} of {bad}/adapter_model.safetensors; the restart should "
                f"fall back to {expect}")
        job.wait_for(lambda: len(job.rounds()) > seen, f"the restart after kill {k}", a.limit)
        fresh = job.logged
        world, resumed = job.rounds()[-1]
        say(f"  next round: world size {world}, resuming from {resumed}")
        ok = bool(resumed and expect and os.path.realpath(resumed) == os.path.realpath(expect))
        fault.ok = ok
        fault.evidence = (f"{how}{late}; next round at world size {world} resumed {resumed} "
                          f"({'= the newest verified checkpoint' if ok else f'expected {expect}'})")
        if bad:
            # global rank 0 says why it skipped the checkpoint, in whichever host's log it ran
            pattern = fallback_line(bad, str(expect))
            found = [i for i in job.procs if pattern.search(job.text(i))]
            cf.ok = bool(found) and ok
            cf.evidence = (f"byte {off} of {os.path.basename(bad)}/adapter_model.safetensors flipped after kill {k}; "
                           + (f"host {found[0]}'s log: 'not resuming from {os.path.basename(bad)}: "
                              "... checksum differs ...; resuming from the previous complete checkpoint "
                              f"{os.path.basename(str(expect))}'"
                              if found else "no fallback line in any log")
                           + f"; resumed {resumed}")
        if replacement is not None:
            joins += 1
            jf = faults[f"join {joins}"]
            seen = len(job.rounds())
            t = time.monotonic()
            job.start(replacement)
            jf.tried = True
            say(f"join {joins}: host {replacement} started (a replacement for host {victim})")
            job.wait_for(lambda: len(job.rounds()) > seen and job.rounds()[-1][0] == 3,
                         f"host {replacement}'s admission", a.limit)
            took = time.monotonic() - t
            fresh = job.logged
            world, resumed = job.rounds()[-1]
            m = re.search(rf"torchrun: rendezvous {RDZV_ID} round (\d+): this node is node rank (\d) of 3 nodes",
                          job.text(replacement))
            admitted = re.search(r"elastic: this round has world size 3", job.text(replacement))
            jf.ok = bool(m and admitted)
            jf.evidence = (f"host {replacement} started after host {victim}'s loss; admitted {took:.0f} s later in "
                           + (f"round {m.group(1)} as node rank {m.group(2)} of 3" if m else "no round")
                           + f", world size 3 resumed from {resumed}")
            say(f"  admitted after {took:.0f} s: world size {world}, resuming from {resumed}")

    # the full disk, in the round after kill 5, once it has written a checkpoint at world size 2: the restart then
    # resumes, at the world size it was written at, a checkpoint whose accumulation (3) is not the configured one (2)
    df = faults["full disk"]
    from sft.train.checkpoint import checkpoint_dirs

    resumed_step = int(resumed.rsplit("-", 1)[1]) if resumed else 0
    job.wait_for(lambda: any(s > resumed_step and os.path.exists(os.path.join(p, MARKER))
                             for s, p in checkpoint_dirs(out)), "a checkpoint of the round after kill 5", a.limit)
    start = job.step
    st = os.statvfs(tmpfs)
    free = st.f_bavail * st.f_frsize
    from sft.train.integrity import checkpoint_files

    kept = newest_verified(out)
    ck_bytes = sum(os.path.getsize(os.path.join(kept, r)) for r in checkpoint_files(kept, ()))
    filler = os.path.join(tmpfs, "filler")
    size = max(free - ck_bytes // 2, 0)
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)
    df.tried = True
    say(f"full disk: a filler of {size / 2 ** 20:.1f} MiB leaves {(free - size) / 2 ** 20:.1f} MiB on the output "
        f"tmpfs (one checkpoint: {ck_bytes / 2 ** 20:.1f} MiB) at step {job.step}")
    seen = len(job.rounds())
    def message():
        return next(((i, m) for i in job.procs for m in [OUT_OF_SPACE.search(job.text(i))] if m), None)

    job.wait_for(lambda: message() is not None, "the out-of-space message", a.limit)
    i, m = message()
    previous = m.group(2)
    from sft.train.checkpoint import verify

    intact = verify(previous)
    os.remove(filler)
    say(f"  host {i}: 'out of disk space while writing {m.group(1)}: ...'; {previous} verifies: {intact is None}; "
        "filler removed")
    job.wait_for(lambda: len(job.rounds()) > seen, "the restart after the full disk", a.limit)
    fresh = job.logged
    world, resumed = job.rounds()[-1]
    one_line = [ln for ln in job.text(i).splitlines() if "out of disk space" in ln]
    df.ok = bool(intact is None and resumed and os.path.realpath(resumed) == os.path.realpath(previous) and one_line)
    # sft.train.world_size's line when the checkpoint's own world size keeps its accumulation (not the configured 2)
    kept_shape = re.compile(rf"resuming {re.escape(previous)} at the world size 2 it was written at, with its gradient "
                            r"accumulation 3 \(set by an earlier resume at another world size\) "
                            r"instead of the configured 2")
    job.wait_for(lambda: any(kept_shape.search(job.text(h)) for h in job.procs) or job.logged > fresh,
                 "the resume line after the full disk", a.limit)
    shape = any(kept_shape.search(job.text(h)) for h in job.procs)
    df.evidence = (f"filler at step {start}; host {i}'s log: 'out of disk space while writing "
                   f"{os.path.relpath(m.group(1), out)} ... the previous complete checkpoint "
                   f"{os.path.basename(previous)} "
                   f"is intact'; it verified: {intact is None}{'' if intact is None else f' ({intact})'}; after the "
                   f"filler was deleted the next round (world size {world}) resumed {resumed}"
                   + (" with its gradient accumulation 3 (global batch 6), not the configured 2" if shape else
                      " (no line saying it kept the checkpoint's accumulation 3)"))
    say(f"  next round: world size {world}, resuming from {resumed}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1, help="draws the 5 kill steps (and is the training seed)")
    ap.add_argument("--steps", type=int, default=140, help="optimizer steps of the job (default 140)")
    ap.add_argument("--gap", type=int, default=10, help="at least this many steps after a worker kill (default 10)")
    ap.add_argument("--join_gap", type=int, default=45,
                    help="at least this many steps after a node kill, whose replacement is admitted meanwhile (45)")
    ap.add_argument("--limit", type=float, default=300, help="seconds any one wait may take before the drill gives up")
    ap.add_argument("--workdir", help="folder for the logs and the reference (default: a new one under /tmp)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("fault_drill: needs root (network namespaces and a tmpfs mount); run it as root", file=sys.stderr)
        return 2
    from tests.helpers import netns  # the namespace hosts of the cluster tests

    why = netns.unavailable()
    if why:
        print(f"fault_drill: cannot make namespace hosts here: {why}", file=sys.stderr)
        return 2
    from tests.helpers import assets

    model = assets.tiny_qwen2_dir()  # built once into SFT_TEST_ASSETS (default .cache/test-assets), as for the tests
    draw_kill_steps(a.seed, a.steps, a.gap, a.join_gap)  # a bad --steps/--gap ends here, before anything is made
    from tests.helpers.data import TOY, write_jsonl

    work = a.workdir or tempfile.mkdtemp(prefix="sft-fault-drill-")
    os.makedirs(work, exist_ok=True)
    print("load before:", uptime(), flush=True)
    t0 = time.monotonic()
    rows = [dict(r, id=f"{r['id']}-{k}") for k in range(3) for r in TOY]  # 24: a multiple of the global batch 6
    data = write_jsonl(os.path.join(work, "toy24.jsonl"), rows)
    tmpfs = os.path.join(work, "disk")
    os.makedirs(tmpfs, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m", "sft-drill", tmpfs],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"fault_drill: cannot mount a tmpfs on {tmpfs}: {r.stderr.strip()}", file=sys.stderr)
        return 2
    out = os.path.join(tmpfs, "out")
    faults = {n: Fault(n) for n in ["kill 1", "kill 2", "kill 3", "kill 4", "kill 5", "join 1", "join 2",
                                    "corrupt 1", "corrupt 2", "full disk"]}
    hosts = job = None
    stopped = None
    compare = "not reached"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        hosts = netns.Hosts(5, tag="fd")  # made after the tmpfs: every host's mount namespace sees it
        env = {k: v for k, v in os.environ.items()
               if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "PYTHON")}
        env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "NNODES": "2:3", "MASTER_ADDR": hosts.addrs[0],
                    "MASTER_PORT": str(PORT), "MAX_RESTARTS": "10", "RDZV_ID": RDZV_ID, "RDZV_TIMEOUT": "120",
                    # a last call of 10 s: round 0 waits for its third node however the start-ups spread under load
                    "RDZV_LAST_CALL_TIMEOUT": "10"})
        cache = os.path.join(work, "cache")  # the tokenized data, shared by the job and the reference
        argv = ["bash", PRESET, "-m", model, "-d", data, *train_flags(out, a.steps, 2, a.seed, cache)]
        job = Job(hosts, work, argv, env)
        try:
            drill(a, hosts, job, out, tmpfs, faults)
            left = [i for i, p in job.procs.items() if p.poll() is None]
            deadline = time.monotonic() + a.limit
            rcs = {}
            for i in left:
                try:
                    rcs[i] = job.procs[i].wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise DrillError(f"host {i}'s launcher still running {a.limit:.0f} s after the last fault")
            say(f"the job ended: exit codes {rcs} (hosts left)")
            if any(rc != 0 for rc in rcs.values()):
                raise DrillError(f"the job did not finish: exit codes {rcs}; logs in {work}")
        except DrillError as e:
            stopped = str(e)
        job_s = time.monotonic() - t0
        tracebacks = {i: job.text(i).count("Traceback") for i in job.procs}
        if stopped is None:
            # nothing lost: the same as one uninterrupted run with the same global batch
            ref_out = os.path.join(work, "reference")
            t = time.monotonic()
            with open(os.path.join(work, "reference.log"), "w") as log:
                rc = subprocess.run(["bash", PRESET, "-m", model, "-d", data,
                                     *train_flags(ref_out, a.steps, GLOBAL_BATCH, a.seed, cache)],
                                    env={**env, "NNODES": "1", "MASTER_ADDR": "127.0.0.1"}, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=work).returncode
            ref_s = time.monotonic() - t
            if rc != 0:
                stopped = f"the reference run failed (exit {rc}); see {work}/reference.log"
            else:

                step, losses, weights = results(out)
                ref_step, ref_losses, ref_weights = results(ref_out)
                dl = max((abs(x - y) for x, y in zip(losses, ref_losses)), default=float("inf"))
                dw = max(((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights if k in weights),
                         default=float("inf"))
                same = (step == ref_step == a.steps and len(losses) == len(ref_losses) == a.steps
                        and weights.keys() == ref_weights.keys() and dl <= ATOL_LOSS and dw <= ATOL_WEIGHTS)
                compare = (f"final step {step} of {a.steps}, {len(losses)} logged losses "
                           f"(reference {len(ref_losses)}); largest loss difference {dl:.2e} "
                           f"(tolerance {ATOL_LOSS:g}), largest adapter difference {dw:.2e} over {len(weights)} "
                           f"tensors (tolerance {ATOL_WEIGHTS:g}); reference: one process, "
                           f"micro batch 1 x accumulation 6, uninterrupted, {ref_s:.0f} s")
                if not same:
                    compare = "NO: " + compare
                    for f in faults.values():  # something was lost: no fault counts as survived
                        if f.ok:
                            f.ok, f.evidence = False, f.evidence + " (but the job's result is not the reference's: " \
                                                                   "see 'nothing lost')"
        else:
            for f in faults.values():
                if f.tried and f.ok:
                    f.ok, f.evidence = False, f.evidence + " (but the job did not finish)"
    finally:
        if job is not None:
            job.close()
        if hosts is not None:
            hosts.close()
        subprocess.run(["umount", "-l", tmpfs], capture_output=True)
    total = time.monotonic() - t0
    print()
    for f in faults.values():
        print(f.line())
    if stopped:
        print(f"drill stopped: {stopped}")
    print(f"nothing lost: {compare}")
    print(f"tracebacks in the hosts' logs: {sum(tracebacks.values()) if job else 'n/a'}")
    n = sum(f.ok for f in faults.values())
    print(f"faults survived: {n} of {len(faults)}")
    for f in faults.values():
        if not f.ok:
            print(f"  not survived: {f.name}: {f.evidence}")
    print(f"wall time {total:.0f} s (the faulted job {job_s:.0f} s); seed {a.seed}, {a.steps} steps")
    print("load after:", uptime())
    print(f"logs: {work}")
    return 0 if n == len(faults) else 1


if __name__ == "__main__":
    sys.exit(main())
