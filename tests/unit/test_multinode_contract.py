"""Fast tests of the multi-node contract (sft/distributed.py) and the SLURM/PBS scripts' node/rank logic.

Everything here stays on this machine: rendezvous tests use 127.0.0.1, the scheduler scripts run
stand-in presets through stand-in srun/scontrol/ssh. The real cross-host runs are in test_multinode.py.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from sft import distributed as D
from tests.helpers.cluster_fakes import fake_slurm, fake_ssh, write_tool
from tests.helpers.paths import ROOT, pythonpath_env
from tests.helpers.ports import free_port


# ------------------------------------------------------------------------------------------------ the contract

def test_defaults():
    c = D.read_contract({})
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port, c.nproc_per_node, c.world_size, c.backend,
            c.rdzv_timeout) == (1, 0, "localhost", 6001, 1, 1, "gloo", 600)
    g = D.read_contract({}, gpus=4)
    assert (g.nproc_per_node, g.world_size, g.backend, g.device) == (4, 4, "nccl", "cuda")


@pytest.mark.parametrize("env,fragment", [
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: must be in [0, NNODES=2)"),
    ({"NNODES": "0"}, "NNODES=0: must be a whole number >= 1"),
    ({"NNODES": "010"}, "NNODES=010"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0: must be in 1-65535"),
    ({"MASTER_PORT": "65536"}, "MASTER_PORT=65536: must be in 1-65535"),
    ({"NPROC_PER_NODE": "0"}, "processes per node: must be a whole number >= 1"),
    ({"RDZV_TIMEOUT": "soon"}, "RDZV_TIMEOUT=soon"),
    ({"NNODES": "2", "MASTER_ADDR": "localhost"}, "MASTER_ADDR=localhost: a loopback address"),
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.5"}, "MASTER_ADDR=127.0.0.5: a loopback address"),
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never a local address; nothing is sent (bind only)
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "192.0.2.7"}, "is not an address of this host: node rank 0 must run on MASTER_ADDR"),
    ({"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR=no-such-host.invalid: does not resolve"),
])
def test_contract_errors(env, fragment):
    with pytest.raises(D.ContractError) as e:
        D.read_contract(env)
    assert fragment in str(e.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(D.ContractError) as e:
        D.read_contract({"NNODES": "x", "MASTER_PORT": "99999", "NPROC_PER_NODE": "-1"})
    assert len(e.value.problems) == 3 and "3 problems" in str(e.value)


def test_more_gpus_than_visible():
    with pytest.raises(D.ContractError, match="GPUS_PER_NODE=8: only 2 GPU"):
        D.read_contract({"GPUS_PER_NODE": "8"}, gpus=2)


def test_non_master_on_the_masters_host():
    own = D.route_source("192.0.2.7", 9)  # the address this host would use on its default route (no packet sent)
    if own is None or own.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    with pytest.raises(D.ContractError, match=f"NODE_RANK=1, but MASTER_ADDR={own} is this host"):
        D.read_contract({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": own})
    assert D.read_contract({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": own}).node_rank == 0


def test_launcher_rejects_a_loopback_master_for_several_nodes():
    env = {**os.environ, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "localhost"}
    r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "launch.sh"), "-m", "m", "-d", "d"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "MASTER_ADDR=localhost: a loopback address" in r.stderr and "with NNODES=2" in r.stderr


def test_gloo_interface_must_exist():
    c = D.read_contract({})
    with pytest.raises(D.ContractError, match="GLOO_SOCKET_IFNAME=nosuch0: no interface nosuch0"):
        D.choose_interface(c, {"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert D.choose_interface(c, {"GLOO_SOCKET_IFNAME": "lo"})[0] == "lo (GLOO_SOCKET_IFNAME)"


# ------------------------------------------------------------------------------------ the node rendezvous (loopback)

def contract(rank, n, port, timeout=5, **kw):
    fields = dict(nnodes=n, node_rank=rank, master_addr="127.0.0.1", master_port=port, nproc_per_node=1,
                  device="cpu", rdzv_timeout=timeout)
    fields.update(kw)
    return D.Contract(**fields)


def run_nodes(contracts):
    """node_rendezvous for each contract in its own thread; returns (error or None per node, seconds)."""
    errors = [None] * len(contracts)

    def one(i):
        try:
            D.node_rendezvous(contracts[i], log=lambda m: None)
        except D.PreflightError as e:
            errors[i] = str(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(contracts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors, time.monotonic() - t0


def test_rendezvous_all_join_then_the_port_is_free_for_torchrun():
    port = free_port()
    errors, _ = run_nodes([contract(r, 3, port) for r in range(3)])
    assert errors == [None, None, None]
    with socket.socket() as s:  # torchrun binds the same port next (SO_REUSEADDR, as TCPStore does)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))


def test_rendezvous_missing_node_ends_every_started_node_within_the_timeout():
    port = free_port()
    errors, seconds = run_nodes([contract(0, 3, port, timeout=2), contract(1, 3, port, timeout=2)])
    assert seconds < 10
    for e in errors:
        assert e and "only 2 of 3 nodes joined within RDZV_TIMEOUT=2 s" in e and "missing: node rank 2)" in e


def test_rendezvous_duplicate_node_rank():
    port = free_port()
    errors, _ = run_nodes([contract(0, 3, port), contract(1, 3, port), contract(1, 3, port)])
    assert all(e and "two nodes were started with NODE_RANK=1" in e for e in errors), errors


def test_rendezvous_disagreeing_nnodes_and_process_counts():
    port = free_port()
    errors, _ = run_nodes([contract(0, 2, port), contract(1, 3, port, nproc_per_node=2)])
    assert all(e and "started with NNODES=3, node rank 0 with NNODES=2" in e and "runs 2 process(es)" in e
               for e in errors), errors


def test_unreachable_master_is_reported_within_the_timeout():
    errors, seconds = run_nodes([contract(1, 2, free_port(), timeout=1)])
    assert seconds < 8
    assert "cannot reach the master at 127.0.0.1:" in errors[0] and "within RDZV_TIMEOUT=1 s" in errors[0]
    assert "Connection refused" in errors[0]


def test_master_port_in_use():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(1)
        port = s.getsockname()[1]
        errors, _ = run_nodes([contract(0, 1, port)])
    assert "MASTER_PORT=%d is already in use on this node" % port in errors[0]


def test_something_else_on_the_master_port():
    with socket.socket() as s:  # accepts and closes without answering, like a foreign service
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        threading.Thread(target=lambda: s.accept()[0].close(), daemon=True).start()
        errors, _ = run_nodes([contract(1, 2, port, timeout=3)])
    assert "closed the connection without an answer" in errors[0]


# ------------------------------------------------------------------------------------ fingerprints, lost peers

def info(rank, node, host, **fp):
    base = {"--data_path file": "a" * 64, "model config (config.json)": "c" * 64, "sft version": "0.1.0"}
    base.update(fp)
    return {"rank": rank, "node_rank": node, "host": host, "addr": f"10.0.0.{node + 1}", "fp": base}


def test_fingerprints_name_the_differing_nodes():
    same = [info(0, 0, "a"), info(1, 0, "a"), info(2, 1, "b")]
    assert D.compare_fingerprints(same) == []
    bad = same + [info(3, 2, "c", **{"--data_path file": "f" * 64}), info(4, 3, "d", **{"sft version": "0.2.0"})]
    problems = D.compare_fingerprints(bad)
    assert len(problems) == 2
    assert problems[0] == ("--data_path file differs between nodes: node rank 0 (a), node rank 1 (b), "
                           "node rank 3 (d): aaaaaaaaaaaa...; node rank 2 (c): ffffffffffff...")
    bad[3]["where"] = {"--data_path file": "/other/d.jsonl"}
    assert "node rank 2 (c): ffffffffffff... (/other/d.jsonl)" in D.compare_fingerprints(bad)[0]
    assert "sft version differs between nodes" in problems[1] and "node rank 3 (d): 0.2.0" in problems[1]


def test_input_fingerprint_covers_data_config_and_tokenizer(tiny_model_dir, toy_data, tmp_path):
    import shutil

    fp = D.input_fingerprint(tiny_model_dir, {"--data_path": toy_data})
    assert set(fp) == {"--data_path file", "model config (config.json)", "tokenizer files", "sft version",
                       "world view"}
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    assert D.input_fingerprint(str(copy), {"--data_path": toy_data})["tokenizer files"] == fp["tokenizer files"]
    with open(copy / "tokenizer_config.json", "a") as f:
        f.write("\n")
    assert D.input_fingerprint(str(copy), {"--data_path": toy_data})["tokenizer files"] != fp["tokenizer files"]


def test_lost_peer_is_named(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setitem(D._PEERS, "10.213.0.3", {"node_rank": 2, "host": "node2", "ranks": [2]})
    err = dist.DistBackendError("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
                                "[10.213.0.3]:41234")
    msg = D.explain_collective_failure(err, 600)
    assert msg.startswith("training stopped: another process of the job went away; the peer at 10.213.0.3 is node "
                          "rank 2 (node2, global rank(s) 2)")
    reset = D.explain_collective_failure(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                                                      "error [10.213.0.3]:49827: Connection reset by peer."), 600)
    assert "the peer at 10.213.0.3 is node rank 2 (node2, global rank(s) 2)" in reset
    timeout = D.explain_collective_failure(RuntimeError("[gloo] Timed out waiting 3000ms for recv operation"), 3)
    assert "no answer within --ddp_timeout 3 s" in timeout
    assert D.explain_collective_failure(ValueError("unrelated")) is None


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
