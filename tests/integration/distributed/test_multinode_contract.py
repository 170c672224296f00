"""The multi-node contract through real processes, all on this machine: the launcher's refusal of a loopback
master, gloo collectives bounded by --ddp_timeout under torchrun, and the SLURM/PBS scripts' node/rank logic
with stand-in presets and stand-in srun/scontrol/ssh. The in-process checks (contract, rendezvous on
127.0.0.1, fingerprints) are in tests/unit/distributed/test_multinode_contract.py; the real cross-host runs in
tests/cluster/test_multinode.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.helpers.cluster_fakes import fake_slurm, fake_ssh, write_tool
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port


def test_launcher_rejects_a_loopback_master_for_several_nodes():
    env = {**os.environ, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "localhost"}
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "launch.sh"), "-m", "m", "-d", "d"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "MASTER_ADDR=localhost: a loopback address" in r.stderr and "with NNODES=2" in r.stderr


DDP_TIMEOUT_WORKER = r"""
import os, sys, time
from sft.config.arguments import parse_args
from sft.distributed.process_group import start_runtime
import torch, torch.distributed as dist
args = parse_args(["--output_dir", sys.argv[1], "--ddp_timeout", "3", "--report_to", "none"])
assert not dist.is_initialized()  # parsing starts nothing; the runtime step starts the group
start_runtime(args[2])
assert dist.is_initialized() and dist.get_backend() == "gloo"
if dist.get_rank() == 1:
    time.sleep(60)  # never joins the all-reduce
    sys.exit(0)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except Exception as e:
    print(f"rank0 failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}", flush=True)
    os._exit(3)
"""


def test_ddp_timeout_bounds_gloo_collectives_on_cpu(tmp_path):
    """transformers/accelerate would start gloo with torch's 30-minute default; our process group (started by the
    runtime step after parsing: sft.distributed.process_group.start_runtime) has --ddp_timeout."""
    worker = tmp_path / "w.py"
    worker.write_text(DDP_TIMEOUT_WORKER)
    env = pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                             "127.0.0.1", "--master_port", str(free_port()), str(worker), str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    line = next((x for x in out.splitlines() if "rank0 failed after" in x), None)
    assert line, out[-3000:]
    assert float(line.split("after ")[1].split(" s")[0]) < 15, line


# ------------------------------------------------------------------------------------ scheduler scripts, locally

FAKE_PRESET = """#!/usr/bin/env bash
echo "node $NODE_RANK of $NNODES master $MASTER_ADDR:$MASTER_PORT host $(cat /proc/sys/kernel/hostname) \
args $*" >> "$SFT_NODES_LOG"
if [[ "$NODE_RANK" == "${SFT_FAIL_RANK:-none}" ]]; then exit "${SFT_FAIL_CODE:-1}"; fi
"""


def scheduler_env(tmp_path, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "calls.log"),
           "SFT_NODES_LOG": str(tmp_path / "nodes.log")}
    for k in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    write_tool(tmp_path, "preset.sh", FAKE_PRESET)
    return env, bin_dir


def test_slurm_ranks_master_and_requeue_on_preemption(tmp_path):
    env, bin_dir = scheduler_env(tmp_path, SLURM_JOB_ID=1234, SLURM_NNODES=3, SLURM_JOB_NODELIST="a1,b2,c3",
                                 SFT_FAIL_RANK=1, SFT_FAIL_CODE=75)
    fake_slurm(bin_dir)
    script = os.path.join(ROOT, "scripts", "slurm_train.sh")
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh"), "-m", "M", "--x", "a b"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 75, r.stderr
    nodes = sorted((tmp_path / "nodes.log").read_text().splitlines())
    assert nodes == [f"node {i} of 3 master a1:11234 host {os.uname().nodename} args -m M --x a b" for i in range(3)]
    calls = (tmp_path / "calls.log").read_text()
    assert "scontrol requeue 1234" in calls and "preempted (exit 75): requeueing job 1234" in r.stderr
    # an ordinary failure is not requeued
    (tmp_path / "calls.log").unlink()
    env["SFT_FAIL_CODE"] = "1"
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "requeue" not in (tmp_path / "calls.log").read_text()


def test_slurm_node_failure_is_named_and_not_requeued_twice(tmp_path):
    """A node failure, as slurmctld shows it (the job's Restarts above SLURM_RESTART_COUNT: SLURM requeued it;
    the node DOWN, not responding): the log names the node and the script does not requeue the job again,
    also when a launcher exited 75. Without SLURM's requeue it says how to resume."""
    env, bin_dir = scheduler_env(tmp_path, SLURM_JOB_ID=1234, SLURM_NNODES=3, SLURM_JOB_NODELIST="a1,b2,c3",
                                 SFT_FAIL_RANK=1, SFT_FAIL_CODE=75, FAKE_DOWN="c3",
                                 FAKE_JOB="JobName=sft JobState=COMPLETING Reason=None Requeue=1 Restarts=1 "
                                          "BatchFlag=1")
    fake_slurm(bin_dir)
    script = os.path.join(ROOT, "scripts", "slurm_train.sh")
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 75, r.stderr
    assert ("slurm: node failure: c3 (DOWN+NOT_RESPONDING: Not responding) lost; SLURM has ended this run and "
            "requeued job 1234 itself (JobState=COMPLETING, Restarts=1)") in r.stderr, r.stderr
    assert "scontrol requeue" not in (tmp_path / "calls.log").read_text() and "preempted" not in r.stderr, r.stderr
    env.update(FAKE_JOB="JobName=sft JobState=NODE_FAIL Reason=NodeDown Requeue=0 Restarts=0", SFT_FAIL_CODE="1")
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, r.stderr
    assert ("slurm: node failure: c3 (DOWN+NOT_RESPONDING: Not responding) lost; SLURM has ended this run "
            "(JobState=NODE_FAIL) and does not requeue it") in r.stderr, r.stderr
    assert "submit the same command again to resume" in r.stderr, r.stderr


def test_slurm_script_outside_slurm_and_bad_preset(tmp_path):
    env, _ = scheduler_env(tmp_path)
    for k in [k for k in env if k.startswith("SLURM_")]:
        env.pop(k)
    script = os.path.join(ROOT, "scripts", "slurm_train.sh")
    r = subprocess.run(["bash", script, "finetune_lora_single_gpu.sh"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "SLURM_JOB_ID is not set: submit this script with sbatch" in r.stderr
    r = subprocess.run(["bash", script, "nope.sh"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "preset nope.sh: no such file" in r.stderr \
        and "finetune_lora_single_gpu.sh" in r.stderr
    r = subprocess.run(["bash", script, "-h"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "sbatch --nodes N" in r.stdout


def test_pbs_unique_hosts_distinct_ranks_and_failures(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("h1\nh1\nh2\nh1\nh3\nh2\nh3\nh3\n")
    env, bin_dir = scheduler_env(tmp_path, PBS_NODEFILE=nodefile, PBS_JOBID="31.server", PBS_O_WORKDIR=tmp_path,
                                 SFT_SOMETHING="kept", UNRELATED="dropped", SFT_FAIL_RANK=2, SFT_FAIL_CODE=3)
    fake_ssh(bin_dir)  # runs locally with a clean environment, like sshd
    (tmp_path / "preset.sh").write_text(FAKE_PRESET.replace("args $*",
                                                            "args $* sft=${SFT_SOMETHING:-} other=${UNRELATED:-}"))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pbs_train.sh"), str(tmp_path / "preset.sh"), "-d",
                        "my data.jsonl"], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    nodes = sorted((tmp_path / "nodes.log").read_text().splitlines())
    hostname = os.uname().nodename
    assert nodes == [f"node {i} of 3 master h1:10031 host {hostname} args -d my data.jsonl sft=kept other="
                     for i in range(3)]
    calls = sorted((tmp_path / "calls.log").read_text().splitlines())  # the ssh run in parallel
    assert [c.split()[1] for c in calls] == ["h1", "h2", "h3"]  # one per unique host
    assert all(f"NODE_RANK={i} " in c for i, c in enumerate(calls))
    assert r.returncode == 3 and "pbs: failed: node rank 2 (h3): exit 3" in r.stderr


# ------------------------------------------------------------------------ elastic jobs through the scheduler scripts

ELASTIC_PRESET = """#!/usr/bin/env bash
if [[ "$NODE_RANK" == "${SFT_FAIL_RANK:-none}" ]]; then sleep "${SFT_FAIL_AFTER:-0}"; exit "${SFT_FAIL_CODE:-1}"; fi
if [[ "$NODE_RANK" == "${SFT_SLOW_RANK:-none}" ]]; then sleep 30; fi
sleep "${SFT_RUN_S:-1}"
echo "node $NODE_RANK of $NNODES rdzv=${RDZV_ID:-} job=${SLURM_JOB_ID:-}${PBS_JOBID:-} \
restarts ${MAX_RESTARTS:-} finished" >> "$SFT_NODES_LOG"
"""


def test_slurm_elastic_job_keeps_going_without_a_failed_node(tmp_path):
    """MIN_NODES=2 with 3 nodes: every task gets NNODES=2:3, srun runs with --no-kill and without
    --kill-on-bad-exit, a node whose launcher fails does not stop the others, and the job's exit code is the first
    node's (the rendezvous store host's): 0, with the failed code and the lost node (DOWN in scontrol) named."""
    env, bin_dir = scheduler_env(tmp_path, SLURM_JOB_ID=1234, SLURM_NNODES=3, SLURM_JOB_NODELIST="a1,b2,c3",
                                 MIN_NODES=2, SFT_FAIL_RANK=2, SFT_FAIL_CODE=9, FAKE_DOWN="c3", MAX_RESTARTS=4)
    fake_slurm(bin_dir)
    (tmp_path / "preset.sh").write_text(ELASTIC_PRESET)
    script = os.path.join(ROOT, "scripts", "slurm_train.sh")
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted((tmp_path / "nodes.log").read_text().splitlines()) == [
        f"node {i} of 2:3 rdzv= job=1234 restarts 4 finished" for i in (0, 1)]  # RDZV_ID: the contract's default
    srun = [c for c in (tmp_path / "calls.log").read_text().splitlines() if c.startswith("srun")]
    assert len(srun) == 1 and "--no-kill --kill-on-bad-exit=0" in srun[0] and "--kill-on-bad-exit=1" not in srun[0]
    assert "slurm: elastic job: NNODES=2:3 on every node (rendezvous 1234, store on a1" in r.stderr, r.stderr
    assert ("slurm: elastic job: srun exit 9 (a node's launcher failed while its host stayed up: its lines are above); "
            "the job's exit code is a1's, the rendezvous store host's: 0") in r.stderr, r.stderr
    assert "slurm: elastic job 1234 finished on the nodes left; lost on the way: c3 (DOWN+NOT_RESPONDING: Not " \
           "responding)" in r.stderr, r.stderr
    # the first node failing is the job failing; preempted (75): requeued
    for code in (3, 75):
        (tmp_path / "calls.log").unlink()
        env.update(SFT_FAIL_RANK="0", SFT_FAIL_CODE=str(code), FAKE_DOWN="")
        r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == code, r.stderr
        assert ("scontrol requeue 1234" in (tmp_path / "calls.log").read_text()) == (code == 75), r.stderr


def test_slurm_and_pbs_refuse_a_bad_node_range(tmp_path):
    """One line naming the variable, the allocation and the fix; exit 2; nothing started."""
    env, bin_dir = scheduler_env(tmp_path, SLURM_JOB_ID=7, SLURM_NNODES=3, SLURM_JOB_NODELIST="a1,b2,c3", MIN_NODES=4)
    fake_slurm(bin_dir)
    fake_ssh(bin_dir)
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_train.sh"), str(tmp_path / "preset.sh")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: MIN_NODES=4: the fewest nodes the elastic job goes on with must be a whole number in 1..3 (this job "
        "has 3 node(s): SLURM_NNODES=3), or submit the job with at least 4 nodes"), r.stderr
    assert "Traceback" not in r.stderr and "srun" not in (tmp_path / "calls.log").read_text()
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("h1\nh2\nh2\n")
    env.pop("MIN_NODES")
    env.update(PBS_NODEFILE=str(nodefile), PBS_JOBID="5.server", NNODES="1:3")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pbs_train.sh"), str(tmp_path / "preset.sh")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: NNODES=1:3: MAX must be the job's node count, 2 (2 unique host(s) in PBS_NODEFILE {nodefile}): give "
        "NNODES=1:2, or MIN_NODES=1 alone"), r.stderr
    assert "ssh" not in (tmp_path / "calls.log").read_text()


def test_pbs_elastic_job_keeps_going_without_a_failed_node(tmp_path):
    """MIN_NODES=2 over 3 hosts: node rank 2 failing (a lost host's ssh exits 255) does not stop the others, which
    finish; the job exits 0 naming it. A node still running ELASTIC_GRACE_S after the first host ended is stopped.
    The first host failing stops every node within seconds."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("h1\nh2\nh1\nh3\n")
    env, bin_dir = scheduler_env(tmp_path, PBS_NODEFILE=nodefile, PBS_JOBID="31.server", PBS_O_WORKDIR=tmp_path,
                                 MIN_NODES=2, MAX_RESTARTS=5, SFT_FAIL_RANK=2, SFT_FAIL_CODE=255)
    fake_ssh(bin_dir)
    (tmp_path / "preset.sh").write_text(ELASTIC_PRESET)
    script = os.path.join(ROOT, "scripts", "pbs_train.sh")
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env=env, capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert sorted((tmp_path / "nodes.log").read_text().splitlines()) == [
        f"node {i} of 2:3 rdzv= job=31.server restarts 5 finished" for i in (0, 1)]  # sent over ssh
    assert "pbs: node rank 2 (h3) lost (exit 255); elastic job: the other nodes go on without it" in r.stderr, r.stderr
    assert "pbs: lost: node rank 2 (h3): exit 255" in r.stderr, r.stderr
    assert "pbs: elastic job 31.server finished on the nodes left (node rank 0, h1, exit 0)" in r.stderr, r.stderr
    assert "stopping every node" not in r.stderr, r.stderr
    # a node still running once the first host has ended (a hung ssh to a crashed host) is stopped after the grace
    t0 = time.monotonic()
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env={**env, "SFT_SLOW_RANK": "1",
                       "ELASTIC_GRACE_S": "1"}, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0 and time.monotonic() - t0 < 15, r.stderr
    assert "pbs: node rank 0 (h1) ended 1 s ago: stopping every node" in r.stderr, r.stderr
    (tmp_path / "nodes.log").unlink()
    env.update(SFT_FAIL_RANK="0", SFT_FAIL_CODE="4", SFT_FAIL_AFTER="1", SFT_RUN_S="30")
    t0 = time.monotonic()
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env=env, capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert r.returncode == 4 and time.monotonic() - t0 < 15, r.stderr
    assert "pbs: node rank 0 (h1) failed (exit 4): stopping every node" in r.stderr, r.stderr
    assert not (tmp_path / "nodes.log").exists()
