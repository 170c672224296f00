"""scripts/slurm_train.sh under a real SLURM cluster and scripts/pbs_train.sh over real sshd.

The session's cluster (tests/cluster/conftest.py, tests/helpers/slurm.py) is 3 namespace hosts node0..node2,
each with its own address, host name and /etc/hosts, running slurmd and sshd; slurmctld runs on node0 and
one munged serves them all. Jobs are submitted with sbatch as a user would; their per-step losses and saved
adapter must equal one host with the same world size, global batch and seed (the uninterrupted run below, 3
processes on one host, for the sbatch and PBS jobs). Preemption goes the way SLURM sends it before a time limit
(``#SBATCH --signal=B:USR1@120``: SIGUSR1 to the batch shell) -> checkpoint -> exit 75 -> requeue -> the
rerun resumes and ends where an uninterrupted run ends; its job log has to read cleanly.
A host that dies mid-run (its slurmd and job processes SIGKILLed; kept last, it brings the host back)
ends the run within SlurmdTimeout + KillWait + 30 s, SLURM requeues the job (the log names the node and
says it was no preemption), and once the host's slurmd is back the rerun resumes from the last complete
checkpoint and ends where an uninterrupted run ends. An elastic job (``MIN_NODES=2 sbatch --no-kill``) that
loses node2 the same way goes on without it: the other two resume from the checkpoint at world size 2 and the
job completes.
"""
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from sft.train import checkpoint as ckpt
from tests.cluster import test_multinode as mn
from tests.cluster.test_multinode import data  # noqa: F401 - the fixture of the one-host references
from tests.helpers import netns
from tests.helpers.paths import ROOT

_WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

SLURM_SH = os.path.join(ROOT, "scripts", "slurm_train.sh")
PBS_SH = os.path.join(ROOT, "scripts", "pbs_train.sh")
PRESET = os.path.basename(mn.PRESET)
JOB_LIMIT_S = 300  # one training job on a loaded 2-core machine


def job_env(cluster, **extra) -> dict:
    return cluster.env(**{**mn.node_env(), **extra})


def submit(cluster, tmp_path, flags, out, sbatch=("--nodes", "3")) -> tuple[int, str]:
    """sbatch [sbatch options] scripts/slurm_train.sh PRESET -m MODEL -d DATA --output_dir OUT FLAGS from the
    repository folder; (job id, job log path)."""
    log = str(tmp_path / "slurm-%j.out")
    jid = cluster.sbatch([*sbatch, "--output", log, SLURM_SH, PRESET, *flags, "--output_dir", str(out)],
                         job_env(cluster), cwd=ROOT)
    return jid, log.replace("%j", str(jid))


def read(path) -> str:
    """The file's text, carriage returns kept (a progress bar's redraws); empty while it does not exist."""
    return open(path, errors="replace", newline="").read() if os.path.exists(path) else ""


def train_flags(model, data_file, steps=None, tqdm=True):
    flags = list(mn.TRAIN)
    if steps is not None:
        flags[flags.index("--max_steps") + 1] = str(steps)
    if not tqdm:  # the preset's default progress bar setting
        i = flags.index("--disable_tqdm")
        del flags[i:i + 2]
    return ["-m", model, "-d", data_file, *flags]


def test_daemons_are_real_and_each_on_its_host(cluster):
    d = cluster.daemons()
    assert len(d.get("slurmctld", [])) == 1 and len(d.get("munged", [])) == 1, d
    assert len(d.get("slurmd", [])) == 3 and len(d.get("sshd", [])) >= 3, d
    where = {pid: subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()
             for pid in d["slurmd"] + d["sshd"]}
    assert sorted(where[p] for p in d["slurmd"]) == cluster.hosts.names, where
    assert set(cluster.hosts.names) <= {where[p] for p in d["sshd"]}, where
    r = cluster.run(["srun", "--nodes", "3", "--ntasks-per-node", "1", "--label", "bash", "-c",
                     'echo "$(hostname) $SLURM_NODEID $(getent hosts node2)"'])
    lines = sorted(r.stdout.split("\n"))[-3:]
    assert [ln.split()[1:3] for ln in lines] == [["node0", "0"], ["node1", "1"], ["node2", "2"]], r.stdout
    assert all("10.213.0.3" in ln for ln in lines), r.stdout


_PREEMPT_STEPS = 16  # long enough that the signal, sent after the first logged loss, lands before the end (~1 s a step)


@pytest.fixture(scope="module")
def preempted(cluster, tmp_path_factory, tiny_model_dir, data):
    """One job stopped by SIGUSR1 to its batch shell (what ``#SBATCH --signal=B:USR1@120`` sends before the time
    limit) after its first logged loss, requeued and finished; (job id, log text, output folder, requeue s)."""
    tmp = tmp_path_factory.mktemp("preempted")
    out = tmp / "out"
    jid, log = submit(cluster, tmp, train_flags(tiny_model_dir, data, steps=_PREEMPT_STEPS, tqdm=False), out)
    deadline = time.monotonic() + JOB_LIMIT_S
    while "'loss'" not in read(log):
        state = cluster.job(jid).get("JobState")
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (state, read(log)[-3000:])
        time.sleep(0.3)
    cluster.run(["scancel", "--batch", "--signal=USR1", str(jid)])
    info = cluster.wait_job(jid, ("PENDING", "COMPLETED", "FAILED", "CANCELLED"), JOB_LIMIT_S)
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", (info, read(log)[-3000:])
    requeued = time.monotonic()
    info = cluster.wait_job(jid, ("RUNNING", "COMPLETED", "FAILED", "CANCELLED"), 120)
    hold = time.monotonic() - requeued
    info = cluster.wait_job(jid, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), JOB_LIMIT_S)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, read(log)[-3000:])
    return jid, read(log), out, hold


def test_preempted_job_is_requeued_and_resumes_to_the_uninterrupted_result(preempted, uninterrupted):
    """sbatch over 3 nodes, stopped by SIGUSR1, requeued, resumed: each node's launcher ran on its own host (its own
    address) and every step's loss and the adapter equal one host with the same world size (the uninterrupted
    run), so this is also the test that an sbatch job equals one host."""
    jid, text, out, hold = preempted
    first, rerun = text.split(f"slurm: preempted (exit 75): requeueing job {jid}")
    port = 10000 + jid % 20000
    assert f"slurm: job {jid}, 3 node(s) (node[0-2]), master node0:{port}" in first, first[-3000:]
    for i in range(3):  # each node's launcher ran on its own host, with its own address
        assert re.search(rf"launch: node rank {i} of 3 nodes, 1 process\(es\) per node, world size 3, "
                         rf"master node0:{port}, interface eth0 10\.213\.0\.{i + 1}\b", first), first[-3000:]
    assert "slurm: SIGUSR1: asking every node to save a checkpoint and stop" in first, first[-3000:]
    assert first.count("launch: preempted; the checkpoint is in --output_dir") == 3, first[-3000:]
    saved = re.search(r"preemption: saving a checkpoint at step (\d+) and stopping", first)
    assert saved and 0 < int(saved.group(1)) < _PREEMPT_STEPS, first[-3000:]
    assert re.search(rf"resuming from \S*checkpoint-{saved.group(1)}\b", rerun), rerun[-3000:]
    assert hold < 60, f"the requeued job waited {hold:.0f} s (cred_expire=10 should make it ~10 s)"
    assert_uninterrupted_result(out, uninterrupted)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir, data):  # noqa: F811
    """The uninterrupted run that a requeued job, and the PBS job, must end equal to: one host, 3 processes, the
    same flags (``_PREEMPT_STEPS`` steps); its output folder."""
    ref_dir = tmp_path_factory.mktemp("uninterrupted")
    hosts = netns.Hosts(1, tag="ref")
    j = mn.Job(ref_dir)
    try:
        j.start(hosts.cmd(0, ["bash", mn.PRESET, *train_flags(tiny_model_dir, data, steps=_PREEMPT_STEPS, tqdm=False),
                              "--output_dir", str(ref_dir / "out")]),
                mn.node_env(NPROC_PER_NODE=3, MASTER_ADDR="127.0.0.1", MASTER_PORT=6001,
                            PYTHON=mn.without_check(ref_dir)), "ref")  # the jobs compared with it run the check
        assert j.wait() == [0], j.tails()
    finally:
        j.close()
        hosts.close()
    return ref_dir / "out"


def assert_uninterrupted_result(out, ref_out) -> None:
    """Per-step losses within ATOL_LOSS and the adapter within ATOL_WEIGHTS of the uninterrupted run's."""
    losses, weights = mn.results(out)
    ref_losses, ref_weights = mn.results(ref_out)
    assert len(losses) == len(ref_losses) == _PREEMPT_STEPS
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= mn.ATOL_LOSS, (losses, ref_losses)
    import torch

    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], atol=mn.ATOL_WEIGHTS, rtol=0)


# Lines a preempted job's log must not have: tracebacks (ours, torchrun's "Received 15 death signal"), library
# notices unrelated to the run, progress bars redrawn with carriage returns.
UNREADABLE = {
    "a Python traceback": "Traceback (most recent call last)",
    "torchrun's signal report": "death signal",
    "torchrun's SignalException": "SignalException",
    "bitsandbytes' kernel notice": "gemm_4bit_forward",
    "c10d's reverse-lookup warning": "hostname of the client socket cannot be retrieved",
    "a progress bar": "\r",
}


def test_preempted_job_log_is_readable(preempted):
    _, text, _, _ = preempted
    found = {what: s for what, s in UNREADABLE.items() if s in text}
    context = {what: text[max(0, text.find(s) - 400):text.find(s) + 400] for what, s in found.items()}
    assert not found, context
    assert not re.search(r"\d+%\|[^\n]*\|", text), "a tqdm bar in the job log"


# ------------------------------------------------------------------------------------------ PBS over real sshd

def pbs_env(cluster, tmp_path, **extra) -> dict:
    """What PBS gives the job script: PBS_NODEFILE with one line per slot (hosts not always adjacent),
    PBS_JOBID, PBS_O_WORKDIR; PBS_RSH points ssh at the cluster's key and config."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("node0\nnode0\nnode1\nnode0\nnode1\nnode2\nnode2\nnode1\n")
    return mn.node_env(PBS_NODEFILE=nodefile, PBS_JOBID="777.pbs-server", PBS_O_WORKDIR=tmp_path,
                       PBS_RSH=f"ssh -F {cluster.ssh_config}", **extra)


def stray_processes(cluster) -> dict[str, list[str]]:
    """Processes in each host's namespace other than the cluster's daemons (sshd, slurmd, slurmctld and its
    slurmscriptd)."""
    daemons = set(sum(cluster.daemons().values(), []))
    stray = {}
    for i, name in enumerate(cluster.hosts.hostnames):
        for pid in set(cluster.hosts.pids(i)) - daemons:
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if not cmd.startswith("slurmctld: slurmscriptd"):  # slurmctld's own helper (renames itself)
                stray.setdefault(name, []).append(f"{pid} {cmd[:120]}")
    return stray


def test_pbs_over_real_sshd_equals_one_host(cluster, tmp_path, tiny_model_dir, data, uninterrupted):  # noqa: F811
    """scripts/pbs_train.sh starts each node's launcher over ssh with the env contract (NNODES, NODE_RANK,
    MASTER_ADDR), the way a user starts nodes by hand: 3 hosts, one process each, the ZeRO-2 LoRA preset; the
    same per-step losses and adapter as one host running 3 processes (the uninterrupted run of the preemption tests:
    the same flags and steps, so no reference of its own). (Also the test of a 3-node launch by hand against one
    host: tests/cluster/test_multinode.py's by-hand runs are the FSDP2 presets, sequence parallelism and the faults.)"""
    job = mn.Job(tmp_path)
    flags = train_flags(tiny_model_dir, data, steps=_PREEMPT_STEPS, tqdm=False)
    try:  # the job script runs on the first host of the node file, as PBS starts it
        job.start(cluster.hosts.cmd(0, ["bash", PBS_SH, PRESET, *flags, "--output_dir", "out"]),
                  pbs_env(cluster, tmp_path), "qsub")
        assert job.wait() == [0], job.tails()
    finally:
        job.close()
    text = job.text(0)
    assert "pbs: job 777.pbs-server, 3 node(s) (node0 node1 node2), master node0:10777" in text, text
    for i in range(3):  # each launcher ran on its own host (its own address): started there by sshd
        assert re.search(rf"launch: node rank {i} of 3 nodes, 1 process\(es\) per node, world size 3, "
                         rf"master node0:10777, interface eth0 10\.213\.0\.{i + 1}\b[^\n]*backend gloo", text), text
    # the rendezvous of the env contract (NNODES, NODE_RANK, MASTER_ADDR per node, as by hand): node rank 0 saw
    # the other two join, each from its own host and address
    assert all(f"rendezvous: node rank {i} (node{i}, 10.213.0.{i + 1}) joined" in text for i in (1, 2)), text
    assert "joined; 3 of 3 nodes" in text, text
    assert_uninterrupted_result(tmp_path / "out", uninterrupted)  # --output_dir out: relative to PBS_O_WORKDIR


def test_pbs_failing_node_stops_the_others_and_leaves_nothing_running(cluster, tmp_path, tiny_model_dir, data):
    # node rank 2 fails after 15 s; the others wait for it in the preflight rendezvous (RDZV_TIMEOUT=120)
    preset = tmp_path / "preset.sh"
    preset.write_text(f'if [[ "$NODE_RANK" == 2 ]]; then sleep 15; echo "node 2 gives up" >&2; exit 3; fi\n'
                      f'exec bash {mn.PRESET} "$@"\n')
    job = mn.Job(tmp_path)
    try:
        job.start(cluster.hosts.cmd(0, ["bash", PBS_SH, str(preset), *train_flags(tiny_model_dir, data),
                                        "--output_dir", "out"]), pbs_env(cluster, tmp_path), "qsub")
        rc = job.wait(limit=90)
    finally:
        job.close()
    elapsed = time.monotonic() - job.t0
    text = job.text(0)
    assert rc == [3], text
    assert elapsed < 60, f"the other nodes were not stopped: {elapsed:.0f} s ({text[-2000:]})"
    assert "pbs: node rank 2 (node2) failed (exit 3): stopping every node" in text, text
    assert re.search(r"pbs: failed: node rank 2 \(node2\): exit 3", text), text
    deadline = time.monotonic() + 10
    while stray_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not stray_processes(cluster), stray_processes(cluster)


# ------------------------------------------------------------------------------------ an elastic job under SLURM

_ELASTIC_STEPS = 12
_ELASTIC_SAVE_STEPS = 2


def test_elastic_job_loses_a_node_and_finishes_on_the_others(cluster, tmp_path, tiny_model_dir, data):  # noqa: F811
    """``MIN_NODES=2 sbatch --no-kill --nodes 3``: node2 crashes (its slurmd and every job process SIGKILLed) after
    the first complete checkpoint; node0 and node1 restart from it at world size 2 (global batch 6 kept:
    accumulation 2 -> 3) and the job completes with exit 0, not requeued, the adapter written, and the log names
    node2; SLURM takes node2 out of the job instead of ending it."""
    out = tmp_path / "out"
    flags = train_flags(tiny_model_dir, data, steps=_ELASTIC_STEPS, tqdm=False)
    flags[flags.index("--save_strategy") + 1] = "steps"
    flags[flags.index("--gradient_accumulation_steps") + 1] = "2"  # global batch 6: world sizes 3 and 2 divide it
    flags += ["--save_steps", str(_ELASTIC_SAVE_STEPS), "--ddp_timeout", "30"]
    log = str(tmp_path / "slurm-%j.out")
    # the DDP preset (a ZeRO-2 resume at another world size converts a universal checkpoint first: slower);
    # a last call of 5 s: round 0 waits for the third node (the preflight has them meet within ~1 s) and round 1,
    # after the loss, starts 5 s after the survivors' restart
    env = job_env(cluster, MIN_NODES=2, MAX_RESTARTS=1, RDZV_LAST_CALL_TIMEOUT=5)
    jid = cluster.sbatch(["--no-kill", "--nodes", "3", "--output", log, SLURM_SH, "finetune_lora_single_gpu.sh",
                          *flags, "--output_dir", str(out)], env, cwd=ROOT)
    log = log.replace("%j", str(jid))
    killed = []
    try:
        deadline = time.monotonic() + JOB_LIMIT_S
        while ckpt.latest_complete(str(out)) is None:
            state = cluster.job(jid).get("JobState")
            assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (state, read(log)[-3000:])
            time.sleep(0.3)
        saved = int(ckpt.latest_complete(str(out)).rsplit("-", 1)[1])
        assert cluster.job(jid)["NodeList"] == "node[0-2]"
        killed = cluster.crash(2)  # slurmd, slurmstepd, node2's launcher, torchrun and worker
        t_kill = time.monotonic()
        assert killed, "nothing ran on node2"
        info = cluster.wait_job(jid, ("COMPLETED", "FAILED", "NODE_FAIL", "CANCELLED", "PENDING"), JOB_LIMIT_S)
        ended = time.monotonic() - t_kill
        text = read(log)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:])
        assert info["Restarts"] == "0" and info["NodeList"] == "node[0-1]", info  # node2 removed, not requeued
        assert "slurm: elastic job: NNODES=2:3 on every node" in text, text[-3000:]
        assert text.count(f"launch: elastic job {jid}: 2 to 3 nodes") == 3, text[-3000:]
        m = re.search(r"elastic: this round has world size 2 \(2 node\(s\)\); failures restarted so far on this node: "
                      r"1 of 1; resuming from \S*checkpoint-(\d+)", text)
        assert m and saved <= int(m.group(1)) < _ELASTIC_STEPS, text[-4000:]
        assert "gradient accumulation 2 -> 3" in text, text[-4000:]
        assert "srun: error: Node failure on node2" in text, text[-3000:]
        assert re.search(rf"slurm: elastic job {jid} finished on the nodes left; lost on the way: node2 \(DOWN\S*: "
                         r"Not responding\)", text), text[-3000:]
        assert "slurm: preempted" not in text and "launch: preempted" not in text, text[-4000:]
        assert "Traceback (most recent call last)" not in text, text[-4000:]
        losses, weights = mn.results(out)  # the adapter and every step's loss
        assert len(losses) == _ELASTIC_STEPS and weights, losses
        print(f"\nelastic job: node2 killed after checkpoint-{saved}; the job completed {ended:.0f} s later")
    finally:
        cluster.run(["scancel", str(jid)], check=False)
        if killed:
            cluster.restart_slurmd(2)


# ------------------------------------------------------------------------- a node lost under SLURM (kept last)

# The bound on ending the job after a host dies, from tests/helpers/slurm.py's slurm.conf: SlurmdTimeout (the
# node is marked down ~15 s after the kill with 10) + KillWait (the other nodes' step is SIGKILLed at most this
# long after its SIGTERM) + 30 s for a loaded 2-core machine (measured 23-41 s from the kill to the requeue).
_SLURMD_TIMEOUT_S, _KILL_WAIT_S = 10, 30
_LOST_NODE_BOUND_S = _SLURMD_TIMEOUT_S + _KILL_WAIT_S + 30
_LOST_NODE_SAVE_STEPS = 4


@pytest.mark.budget(330, reason="SLURM notices the lost host only after SlurmdTimeout + KillWait, requeues the job "
                          "and reruns it once the host is back: 163 s in CI")
def test_lost_node_requeues_the_job_and_the_rerun_resumes_to_the_uninterrupted_result(
        cluster, tmp_path, tiny_model_dir, data, uninterrupted):  # noqa: F811
    """SIGKILL to every SLURM and job process of node2 after the first complete checkpoint: the job ends within
    the bound and SLURM requeues it (a node failure, not a preemption: the log says so, names node2 and has no
    traceback); once node2's slurmd is back the rerun resumes from the last complete checkpoint and ends equal
    to the uninterrupted run."""
    out = tmp_path / "out"
    flags = train_flags(tiny_model_dir, data, steps=_PREEMPT_STEPS, tqdm=False)
    flags[flags.index("--save_strategy") + 1] = "steps"
    flags += ["--save_steps", str(_LOST_NODE_SAVE_STEPS)]
    jid, log = submit(cluster, tmp_path, flags, out, sbatch=("--requeue", "--nodes", "3"))
    killed = []
    try:
        deadline = time.monotonic() + JOB_LIMIT_S
        while ckpt.latest_complete(str(out)) is None:
            state = cluster.job(jid).get("JobState")
            assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (state, read(log)[-3000:])
            time.sleep(0.3)
        assert cluster.job(jid)["NodeList"] == "node[0-2]"
        killed = cluster.crash(2)  # slurmd, slurmstepd, node2's launcher, torchrun and worker
        t_kill = time.monotonic()
        assert killed, "nothing ran on node2"
        info = cluster.wait_job(jid, ("PENDING", "COMPLETED", "FAILED", "NODE_FAIL", "CANCELLED"), JOB_LIMIT_S)
        ended = time.monotonic() - t_kill
        first = read(log)
        assert info["JobState"] == "PENDING" and info["Restarts"] == "1", (info, first[-3000:])
        assert ended < _LOST_NODE_BOUND_S, f"the job ended {ended:.0f} s after node2 died"
        resume_from = ckpt.latest_complete(str(out))
        assert resume_from is not None
        # the log names the lost node (the survivors' message, SLURM's own line, the script's) and reads cleanly
        assert "the peer at 10.213.0.3 is node rank 2 (node2, global rank(s) 2)" in first, first[-3000:]
        assert "srun: error: Node failure on node2" in first, first[-3000:]
        assert re.search(r"slurm: (SIGTERM from SLURM ending the job: )?node failure: node2 "
                         rf"\(DOWN\S*: Not responding\) lost; SLURM has ended this run and requeued job {jid} itself",
                         first), first[-3000:]
        assert "slurm: preempted" not in first and "launch: preempted" not in first, first[-3000:]
        assert "Traceback (most recent call last)" not in first and "ChildFailedError" not in first, first[-3000:]
        assert re.search(r"torchrun: global rank [01] \(local rank 0 on this node, pid \d+\) exited with code 1; ",
                         first), first[-3000:]
        cluster.restart_slurmd(2)
        killed = []
        t_back = time.monotonic()
        info = cluster.wait_job(jid, ("COMPLETED", "FAILED", "NODE_FAIL", "CANCELLED", "TIMEOUT"), JOB_LIMIT_S)
        text = read(log)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
        print(f"\nlost node: requeued {ended:.1f} s after node2 died; the rerun ended "
              f"{time.monotonic() - t_back:.0f} s after node2's slurmd was back")
        rerun = text[len(first):]
        assert f"slurm: rerun 1 of job {jid}: an empty step 0 first" in rerun, rerun[-3000:]
        assert re.search(rf"resuming from \S*{re.escape(os.path.basename(resume_from))}\b", rerun), rerun[-3000:]
        assert "Traceback (most recent call last)" not in rerun, rerun[-3000:]
        assert_uninterrupted_result(out, uninterrupted)
    finally:
        cluster.run(["scancel", str(jid)], check=False)
        if killed:
            cluster.restart_slurmd(2)
