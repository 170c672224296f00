"""An elastic job (``NNODES=MIN:MAX``) across network-namespace hosts: lost nodes and a spare.

Four hosts run the real launcher with ``NNODES=2:3`` (torchrun's c10d rendezvous, served by host 0's
launcher); everything on a lost host is killed at once (launcher, agent and worker, as in a crash). The
survivors restart from the newest verified checkpoint by themselves, a spare waiting at the full
rendezvous is admitted at the next restart, and the job finishes at the minimum world size.

Needs root (CI runs as root); skipped with the reason otherwise. Shares the hosts and job helpers of
tests/cluster/test_multinode.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.cluster.test_multinode import RUN_LIMIT_S, TRAIN, data, job, make_hosts, node_env  # noqa: F401 (fixtures)
from tests.helpers import netns
from tests.helpers.paths import ROOT

_WHY = netns.unavailable()
pytestmark = [pytest.mark.multinode, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

PRESET = os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh")  # DDP LoRA
MAX_STEPS = 100  # round 0 must outlast the spare's start (~25 s, ~60 steps here on a loaded machine)
SAVE_STEPS = 4


def _flags(out) -> list[str]:
    flags = list(TRAIN)
    flags[flags.index("--max_steps") + 1] = str(MAX_STEPS)
    flags[flags.index("--save_strategy") + 1] = "steps"
    return ["--output_dir", str(out), *flags, "--save_steps", str(SAVE_STEPS), "--ddp_timeout", "30"]


def _complete(out) -> list[int]:
    if not os.path.isdir(out):
        return []
    return sorted(int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("checkpoint-")
                  and os.path.isfile(os.path.join(out, d, "sft_checkpoint_complete.json")))


def _wait_for(cond, job, what, limit=RUN_LIMIT_S):
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {limit} s:\n" + job.tails()
        assert job.procs[0].poll() is None, f"the store host's launcher ended before {what}:\n" + job.tails()
        time.sleep(0.3)


def _connected_to_store(ns: str) -> bool:
    """A process in namespace ``ns`` holds a TCP connection to the store's port (its agent joined as a spare)."""
    r = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Htn", "state", "established", "dport", "= :6001"],
                       capture_output=True, text=True)
    return bool(r.stdout.strip())


def _kill_host(hosts, i) -> None:
    for pid in hosts.pids(i):  # everything on the host dies at once: its launcher, agent and worker
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_lost_nodes_a_spare_is_admitted_and_the_survivors_finish(make_hosts, job, tmp_path, tiny_model_dir, data):
    """Hosts 0-2 start NNODES=2:3 (round 0, world size 3); host 3 starts later as a spare (the rendezvous is full:
    it waits). Host 2 is killed after a checkpoint: round 1 admits the spare (world size 3 again). Host 1 is killed
    after a later checkpoint: round 2 has the two left (world size 2, MIN), which finish."""
    hosts = make_hosts(4)
    out = tmp_path / "out"

    def start(i):
        env = node_env(NNODES="2:3", MASTER_ADDR=hosts.addrs[0], MASTER_PORT=6001, MAX_RESTARTS=2,
                       RDZV_ID="elastic-test", RDZV_TIMEOUT=120)
        return job.start(hosts.cmd(i, ["bash", PRESET, "-m", tiny_model_dir, "-d", data, *_flags(out)]), env, f"node{i}")

    t0 = time.monotonic()
    for i in range(3):
        start(i)
    _wait_for(lambda: "this round has world size 3" in job.text(0), job, "round 0 at world size 3")
    start(3)  # the spare
    _wait_for(lambda: _connected_to_store(hosts.names[3]), job, "the spare's agent at the store", 120)
    time.sleep(3)  # its first join (onto the rendezvous' redundancy list) follows the connection at once
    _wait_for(lambda: _complete(out), job, "a complete checkpoint of round 0")
    first_kill = _complete(out)[-1]
    _kill_host(hosts, 2)
    _wait_for(lambda: "round 1: this node is" in job.text(3), job, "the spare admitted in round 1", 120)
    _wait_for(lambda: [s for s in _complete(out) if s > first_kill + SAVE_STEPS], job, "a checkpoint of round 1")
    second_kill = _complete(out)[-1]
    _kill_host(hosts, 1)
    rcs = job.wait()
    took = time.monotonic() - t0

    assert rcs[0] == 0 and rcs[3] == 0, job.tails()
    node0, spare = job.text(0), job.text(3)
    for text in (node0, spare):
        assert "Traceback" not in text, job.tails()
    # round 1: the survivors of host 2's loss and the spare, world size 3, from the checkpoint before the kill
    assert "torchrun: restart 1 of 2: the worker group FAILED" in node0, job.tails()
    m = re.search(r"elastic: this round has world size 3 \(3 node\(s\)\); failures restarted so far on this node: "
                  r"1 of 2; resuming from \S+/checkpoint-(\d+)", node0)
    assert m and int(m.group(1)) >= first_kill, job.tails()
    assert re.search(r"torchrun: rendezvous elastic-test round 1: this node is node rank \d of 3 nodes", spare), job.tails()
    # round 2: host 1 lost too; the two left (MIN) finish
    assert "torchrun: restart 2 of 2: the worker group FAILED" in node0, job.tails()
    m = re.search(r"elastic: this round has world size 2 \(2 node\(s\)\); failures restarted so far on this node: "
                  r"2 of 2; resuming from \S+/checkpoint-(\d+)", node0)
    assert m and int(m.group(1)) >= second_kill, job.tails()
    state = json.load(open(out / "trainer_state.json"))
    assert state["global_step"] == MAX_STEPS and (out / "adapter_model.safetensors").is_file()
    print(f"elastic job with two lost nodes and a spare: {took:.0f} s in all")
