"""The multi-node contract through real processes, all on this machine: the launcher's refusal of a loopback
master, gloo collectives bounded by --ddp_timeout under torchrun, and the SLURM/PBS scripts' node/rank logic
with stand-in presets and stand-in srun/scontrol/ssh. The in-process checks (contract, rendezvous on
127.0.0.1, fingerprints) are in tests/unit/test_multinode_contract.py; the real cross-host runs in
tests/cluster/test_multinode.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

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
from sft.arguments import parse_args
import torch, torch.distributed as dist
parse_args(["--output_dir", sys.argv[1], "--ddp_timeout", "3", "--report_to", "none"])
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
    """transformers/accelerate would start gloo with torch's 30-minute default; our process group has --ddp_timeout."""
    worker = tmp_path / "w.py"
    worker.write_text(DDP_TIMEOUT_WORKER)
    env = pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                             "127.0.0.1", "--master_port", str(free_port()), str(worker), str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
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
echo "node $NODE_RANK of $NNODES master $MASTER_ADDR:$MASTER_PORT host $(cat /proc/sys/kernel/hostname) args $*" >> "$SFT_NODES_LOG"
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
    r = subprocess.run(["bash", script, str(tmp_path / "preset.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "requeue" not in (tmp_path / "calls.log").read_text()


def test_slurm_node_failure_is_named_and_not_requeued_twice(tmp_path):
    """A node failure, as slurmctld shows it (the job's Restarts above SLURM_RESTART_COUNT: SLURM requeued it;
    the node DOWN, not responding): the log names the node and the script does not requeue the job again,
    also when a launcher exited 75. Without SLURM's requeue it says how to resume."""
    env, bin_dir = scheduler_env(tmp_path, SLURM_JOB_ID=1234, SLURM_NNODES=3, SLURM_JOB_NODELIST="a1,b2,c3",
                                 SFT_FAIL_RANK=1, SFT_FAIL_CODE=75, FAKE_DOWN="c3",
                                 FAKE_JOB="JobName=sft JobState=COMPLETING Reason=None Requeue=1 Restarts=1 BatchFlag=1")
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
    assert r.returncode == 2 and "preset nope.sh: no such file" in r.stderr and "finetune_lora_single_gpu.sh" in r.stderr
    r = subprocess.run(["bash", script, "-h"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "sbatch --nodes N" in r.stdout


def test_pbs_unique_hosts_distinct_ranks_and_failures(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("h1\nh1\nh2\nh1\nh3\nh2\nh3\nh3\n")
    env, bin_dir = scheduler_env(tmp_path, PBS_NODEFILE=nodefile, PBS_JOBID="31.server", PBS_O_WORKDIR=tmp_path,
                                 SFT_SOMETHING="kept", UNRELATED="dropped", SFT_FAIL_RANK=2, SFT_FAIL_CODE=3)
    fake_ssh(bin_dir)  # runs locally with a clean environment, like sshd
    (tmp_path / "preset.sh").write_text(FAKE_PRESET.replace("args $*", "args $* sft=${SFT_SOMETHING:-} other=${UNRELATED:-}"))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pbs_train.sh"), str(tmp_path / "preset.sh"), "-d", "my data.jsonl"], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    nodes = sorted((tmp_path / "nodes.log").read_text().splitlines())
    hostname = os.uname().nodename
    assert nodes == [f"node {i} of 3 master h1:10031 host {hostname} args -d my data.jsonl sft=kept other="
                     for i in range(3)]
    calls = sorted((tmp_path / "calls.log").read_text().splitlines())  # the ssh run in parallel
    assert [c.split()[1] for c in calls] == ["h1", "h2", "h3"]  # one per unique host
    assert all(f"NODE_RANK={i} " in c for i, c in enumerate(calls))
    assert r.returncode == 3 and "pbs: failed: node rank 2 (h3): exit 3" in r.stderr
