"""Ray launch path on a real cluster: scripts/ray_train.py and finetune/finetune_ray.sh (Ray Train's TorchTrainer).

The tests start a real two-node Ray cluster (``ray start --head`` and ``ray start --address`` in two network
namespaces, each node with its own address and host name, see tests/helpers/ray_cluster.py) and launch from the
head as the README says: losses and adapter equal the torchrun path's (the same 2-process reference as
tests/cluster/test_multinode.py), where each rank ran is read from Ray (node ids from
``ray.get_runtime_context()``), a SIGTERM to the driver ends in a checkpoint and exit 75 and the same command
resumes, an unsatisfiable STRICT_SPREAD fails at once, and a node drain ends in a checkpoint.
Every Ray process is killed with the namespaces after the module (also on failure). The Ray flags, the placement
rules and the stop request without Ray are in tests/unit/ray/test_ray.py; the launcher's refusals before Ray starts
in tests/integration/ray/test_ray.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.cluster import test_multinode as mn
from tests.cluster.test_multinode import data, make_hosts  # noqa: F401 - fixtures shared with the torchrun reference
from tests.helpers import netns
from tests.helpers.paths import ROOT

RAY_SH = os.path.join(ROOT, "finetune", "finetune_ray.sh")
RUN_LIMIT_S = 300  # one Ray job on a loaded 2-core machine (about 45 s when idle)


# ------------------------------------------------------------------------------------- a two-node cluster

_WHY = netns.unavailable()
needs_namespaces = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


@pytest.fixture(scope="module")
def cluster():
    from tests.helpers.ray_cluster import RayCluster

    hosts = netns.Hosts(2, tag="ray")
    c = RayCluster(hosts, cpus=[2, 2])  # closes the hosts itself if a node fails to start
    try:
        assert c.processes(), "no Ray daemon found for the cluster just started"  # the check below can see them
        yield c
    finally:
        c.close()
        assert not hosts.leftovers(), f"namespaces left behind: {hosts.leftovers()}"
        assert not c.processes(), f"Ray processes left running: {c.processes()}"


def launch(cluster, tmp_path, model, data_file, out, *flags, steps=None, name="driver"):
    """finetune_ray.sh on the head (host 0) with the multi-node tests' flags, in the background.
    Returns (process, log path); the process is the driver itself (every wrapper execs)."""
    train = list(mn.TRAIN)
    if steps is not None:
        train[train.index("--max_steps") + 1] = str(steps)
    log = tmp_path / f"{name}.log"
    argv = ["bash", RAY_SH, "-m", model, "-d", data_file, "--output_dir", str(out), *train, *flags]
    p = subprocess.Popen(cluster.hosts.cmd(0, argv), env=cluster.env(), stdout=open(log, "w"),
                         stderr=subprocess.STDOUT, cwd=str(tmp_path), start_new_session=True)
    return p, log


def finish(p, log, limit=RUN_LIMIT_S) -> int:
    try:
        return p.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        pytest.fail(f"Ray job still running after {limit} s:\n{log.read_text(errors='replace')[-4000:]}")


def placement(out) -> dict:
    """Where each rank ran, as the workers read it from Ray (written by the driver)."""
    with open(os.path.join(out, "ray_placement.json")) as f:
        return json.load(f)


@pytest.mark.multinode
@needs_namespaces
def test_spread_over_two_nodes_equals_torchrun(cluster, make_hosts, tmp_path, tmp_path_factory, tiny_model_dir, data):
    ref = mn.reference(2, make_hosts, tmp_path_factory, tiny_model_dir, data)  # torchrun, 2 processes, one host
    out = tmp_path / "out"
    p, log = launch(cluster, tmp_path, tiny_model_dir, data, out, "--ray_address", "auto", "--num_workers", "2",
                    "--placement_strategy", "SPREAD")
    rc = finish(p, log)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert "world size 2 (device cpu, backend gloo)" in text
    mn.assert_same_training(str(out), ref)  # per-step losses and adapter tensors
    where = placement(out)
    assert where["placement_strategy"] == "SPREAD" and where["nodes"] == 2
    assert sorted(w["node_ip"] for w in where["workers"]) == cluster.hosts.addrs
    assert len({w["node_id"] for w in where["workers"]}) == 2


def _wait_for(log, needle, p, limit=RUN_LIMIT_S):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if needle in log.read_text(errors="replace"):
            return
        if p.poll() is not None:
            pytest.fail(f"driver exited ({p.returncode}) before '{needle}':\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"no '{needle}' after {limit} s:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.mark.multinode
@needs_namespaces
@pytest.mark.budget(280, reason="a Ray job stopped by SIGTERM, then its resume under another placement strategy: two "
                          "Ray Train runs on namespace hosts, 140 s in CI")
def test_sigterm_under_strict_spread_then_resume_under_strict_pack(cluster, tmp_path, tiny_model_dir, data):
    """STRICT_SPREAD: one worker per node; SIGTERM to the driver: checkpoint, exit 75. The same command with
    STRICT_PACK (both workers on one node) resumes from that checkpoint and finishes."""
    from sft.train.checkpoint import MARKER

    # the stop reaches the workers some steps after the SIGTERM (sent at step 2): at step 11 on a 2-core machine, after
    # 24 steps on a fast CI machine; every step not trained before the stop is trained by the resumed run
    out, steps = tmp_path / "out", 40
    flags = ["--ray_address", cluster.address, "--num_workers", "2", "--logging_steps", "1"]
    p, log = launch(cluster, tmp_path, tiny_model_dir, data, out, *flags, "--placement_strategy", "STRICT_SPREAD",
                    steps=steps, name="first")
    _wait_for(log, f"step 2/{steps}", p)
    p.send_signal(signal.SIGTERM)
    rc = finish(p, log)
    text = log.read_text(errors="replace")
    assert rc == 75, text[-4000:]
    assert "received SIGTERM: asking every worker" in text and "run the same command again to resume" in text
    ckpts = sorted((d for d in out.glob("checkpoint-*") if (d / MARKER).exists()), key=lambda d: int(d.name[11:]))
    assert ckpts, text[-4000:]
    stopped = int(ckpts[-1].name[11:])
    assert 2 <= stopped < steps
    where = placement(out)
    assert where["nodes"] == 2 and len({w["node_id"] for w in where["workers"]}) == 2

    p, log = launch(cluster, tmp_path, tiny_model_dir, data, out, *flags, "--placement_strategy", "STRICT_PACK",
                    steps=steps, name="second")
    rc = finish(p, log)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert f"resuming from {ckpts[-1]}" in text
    state = json.load(open(out / "trainer_state.json"))
    assert state["global_step"] == steps
    first = json.load(open(ckpts[-1] / "trainer_state.json"))["log_history"]
    logged = [h["step"] for h in state["log_history"] if "loss" in h]
    assert logged == list(range(1, steps + 1))  # steps before the stop kept, the rest trained once each
    assert [h for h in state["log_history"] if h["step"] <= stopped and "loss" in h] == \
        [h for h in first if "loss" in h]
    where = placement(out)
    assert where["placement_strategy"] == "STRICT_PACK" and where["nodes"] == 1
    assert len({w["node_id"] for w in where["workers"]}) == 1


@pytest.mark.multinode
@needs_namespaces
def test_unsatisfiable_strict_spread_fails_fast(cluster, tmp_path, tiny_model_dir, data):
    out = tmp_path / "out"
    t0 = time.monotonic()
    p, log = launch(cluster, tmp_path, tiny_model_dir, data, out, "--ray_address", cluster.address,
                    "--num_workers", "3", "--placement_strategy", "STRICT_SPREAD")
    rc = finish(p, log, limit=90)  # about 10 s idle: the driver's check, connecting, the placement check
    took = time.monotonic() - t0
    text = log.read_text(errors="replace")
    assert rc == 2, text[-4000:]
    assert ("error: --placement_strategy STRICT_SPREAD puts each of the 3 workers on a different node, each with "
            "CPU 1, but only 2 alive node(s) can hold one") in text
    assert "node0 (10.213.0.1: CPU 2)" in text and "node1 (10.213.0.2: CPU 2)" in text
    assert "Traceback" not in text and "world size" not in text  # no worker started
    assert took < 90


@pytest.mark.multinode
@needs_namespaces
def test_ray_node_drain_ends_in_a_checkpoint(cluster, tmp_path, tiny_model_dir, data):
    """PACK (the default strategy) puts both workers on one node; Ray draining that node (what its autoscaler does
    when a spot instance is reclaimed) is a preemption: the workers agree on a step, save a checkpoint and the
    launcher exits 75. Last in this module: the drained node stays draining."""
    import re

    from sft.train.checkpoint import MARKER

    # The drain reaches the workers seconds after the test asks for it (the `ray drain-node` CLI starts, the GCS tells
    # Ray Train): 100 steps (~7 s on a fast CI machine) ended first. The run must outlast the notice, never the limit.
    out, steps = tmp_path / "out", 3000
    # --placement_strategy left at its default, PACK
    p, log = launch(cluster, tmp_path, tiny_model_dir, data, out, "--ray_address", cluster.address,
                    "--num_workers", "2", "--logging_steps", "1", steps=steps)
    _wait_for(log, f"step 2/{steps}", p)
    ips = re.findall(r"\(ip=([0-9.]+), pid=\d+\) world_rank=\d", log.read_text(errors="replace"))  # Ray Train's report
    assert len(ips) == 2 and len(set(ips)) == 1, ips
    cluster.drain(cluster.hosts.addrs.index(ips[0]))
    rc = finish(p, log)
    text = log.read_text(errors="replace")
    assert rc == 75, text[-4000:]
    assert "preemption notice (rank 0): Ray is draining node(s)" in text
    assert "stopped by Ray is draining node(s)" in text and "run the same command again to resume" in text
    ckpts = [d for d in out.glob("checkpoint-*") if (d / MARKER).exists()]
    assert len(ckpts) == 1 and 2 <= int(ckpts[0].name[11:]) < steps, text[-4000:]
    where = placement(out)
    assert where["placement_strategy"] == "PACK" and where["nodes"] == 1
    assert {w["node_ip"] for w in where["workers"]} == {ips[0]}
