"""Ray launch path: scripts/ray_train.py and finetune/finetune_ray.sh (Ray Train's TorchTrainer).

Fast tests check the Ray flags, the placement rules and the stop request without Ray. The cluster tests start
a real two-node Ray cluster (``ray start --head`` and ``ray start --address`` in two network namespaces, each
node with its own address and host name, see tests/helpers/ray_cluster.py) and launch from the head as the README
says: losses and adapter equal the torchrun path's (the same 2-process reference as tests/test_multinode.py),
where each rank ran is read from Ray (node ids from ``ray.get_runtime_context()``), a SIGTERM to the driver
ends in a checkpoint and exit 75 and the same command resumes, and an unsatisfiable STRICT_SPREAD fails at once.
Every Ray process is killed with the namespaces after the module (also on failure).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.cluster import test_multinode as mn
from tests.helpers import netns
from tests.helpers.paths import ROOT
from tests.cluster.test_multinode import data, make_hosts  # noqa: F401 - fixtures shared with the torchrun reference

RAY_SH = os.path.join(ROOT, "finetune", "finetune_ray.sh")
RAY_PY = os.path.join(ROOT, "scripts", "ray_train.py")
RUN_LIMIT_S = 300  # one Ray job on a loaded 2-core machine (about 45 s when idle)


# ------------------------------------------------------------------------------------------- without Ray

def test_bad_placement_strategy_is_refused_before_ray_starts(tiny_model_dir, toy_data, tmp_path):
    r = subprocess.run([sys.executable, RAY_PY, "--placement_strategy", "STRICT_SPRED", "--num_workers", "-1",
                        "--model_name_or_path", tiny_model_dir, "--data_path", toy_data,
                        "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--placement_strategy STRICT_SPRED: not a Ray placement strategy (did you mean STRICT_SPREAD?)" in r.stderr
    assert "--num_workers -1: must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr and "ray:" not in r.stderr  # nothing of Ray was started
    assert not (tmp_path / "out").exists()


def test_ray_flags_check_and_normalise():
    from sft.errors import ConfigError
    from sft.ray_launch import RayArguments, check_ray_args

    r = RayArguments(placement_strategy="strict-pack")
    check_ray_args(r)
    assert r.placement_strategy == "STRICT_PACK"
    with pytest.raises(ConfigError) as e:
        check_ray_args(RayArguments(cpus_per_worker=0, gpus_per_worker=float("nan"), placement_timeout=-1,
                                    ray_address="  "))
    text = str(e.value)
    for flag in ("--cpus_per_worker 0", "--gpus_per_worker nan", "--placement_timeout -1", "--ray_address is empty"):
        assert flag in text, text
    with pytest.raises(ConfigError, match=r"--placement_timeout 1e\+308: at most 31536000 seconds"):
        check_ray_args(RayArguments(placement_timeout=1e308))  # Ray's own wait raised OverflowError (a traceback)
    check_ray_args(RayArguments(placement_timeout=31536000))
    with pytest.raises(ConfigError, match=r"--ray_address ray://head:10001: Ray Client \(ray://\) is not supported"):
        check_ray_args(RayArguments(ray_address="ray://head:10001"))


def _node(host, addr, cpus, gpus=0, alive=True):
    res = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}
    return {"NodeManagerHostname": host, "NodeManagerAddress": addr, "Resources": res, "Alive": alive}


def test_placement_rules_follow_ray_strategies():
    from sft.ray_launch import placement_problem

    two = [_node("node0", "10.0.0.1", 2), _node("node1", "10.0.0.2", 2), _node("gone", "10.0.0.3", 8, alive=False)]
    cpu = {"CPU": 1.0}
    assert placement_problem(two, "STRICT_SPREAD", 2, cpu) is None
    msg = placement_problem(two, "STRICT_SPREAD", 3, cpu)
    assert "STRICT_SPREAD" in msg and "only 2 alive node(s)" in msg and "node0 (10.0.0.1: CPU 2)" in msg
    assert "--num_workers 2" in msg and "gone" not in msg  # a dead node does not count
    assert placement_problem(two, "STRICT_PACK", 2, cpu) is None
    msg = placement_problem(two, "STRICT_PACK", 3, cpu)
    assert "all 3 workers on one node" in msg and "CPU 3" in msg
    assert placement_problem(two, "PACK", 4, cpu) is None and placement_problem(two, "SPREAD", 4, cpu) is None
    assert "hold at most 4" in placement_problem(two, "SPREAD", 5, cpu)
    gpu = {"CPU": 1.0, "GPU": 1.0}
    mixed = [_node("cpu-only", "10.0.0.1", 64), _node("gpu", "10.0.0.2", 8, gpus=2)]
    assert placement_problem(mixed, "PACK", 2, gpu) is None
    assert "hold at most 2" in placement_problem(mixed, "PACK", 3, gpu)
    assert "only 1 alive node(s)" in placement_problem(mixed, "STRICT_SPREAD", 2, gpu)


def test_gpu_workers_on_a_cluster_without_gpus_suggest_use_gpu_false():
    from sft.errors import ConfigError
    from sft.ray_launch import RayArguments, check_ray_args, placement_problem

    two = [_node("node0", "10.0.0.1", 2), _node("node1", "10.0.0.2", 2)]
    msg = placement_problem(two, "PACK", 1, {"CPU": 1.0, "GPU": 1.0})
    assert "--use_gpu True: each of the 1 worker(s) needs GPU 1, but no alive node of the cluster has a GPU" in msg
    assert "Fix: --use_gpu False" in msg and "--num_workers 1" not in msg
    assert placement_problem([_node("g", "10.0.0.3", 8, gpus=1)], "PACK", 2, {"CPU": 1.0, "GPU": 1.0}).startswith(
        "2 workers with CPU 1, GPU 1 each do not fit")  # GPUs exist, too few: the count is the fix
    with pytest.raises(ConfigError) as e:
        check_ray_args(RayArguments(cpus_per_worker=0, gpus_per_worker=-1))
    assert "positive number of CPUs" in str(e.value) and "positive number of GPUs" in str(e.value)
    with pytest.raises(ConfigError, match=r"--cpus_per_worker 1e-09: Ray counts CPUs in steps of 0.0001"):
        check_ray_args(RayArguments(cpus_per_worker=1e-9))  # was a controller traceback and exit 1 after Ray started
    check_ray_args(RayArguments(cpus_per_worker=0.0001, gpus_per_worker=0.25))


def test_yaml_config_holds_ray_and_training_flags(tmp_path, tiny_model_dir, toy_data):
    from sft.arguments import parse_args
    from sft.errors import ConfigError
    from sft.ray_launch import RayArguments

    cfg = tmp_path / "ray.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndata_path: {toy_data}\noutput_dir: {tmp_path / 'o'}\n"
                   "num_workers: 4\nplacement_strategy: SPREAD\nlearning_rate: 1.0e-4\n")
    model, data_args, training, lora, ray_args = parse_args(["--config", str(cfg), "--num_workers", "2"], (RayArguments,))
    assert (ray_args.num_workers, ray_args.placement_strategy, training.learning_rate) == (2, "SPREAD", 1e-4)
    with pytest.raises(ConfigError, match="unknown key 'num_workers'"):  # finetune.py alone has no Ray flags
        parse_args(["--config", str(cfg)])


def test_unreachable_ray_address_fails_at_once(tiny_model_dir, toy_data, tmp_path, monkeypatch):
    """ray.init retries an address nobody listens on for minutes (a warning every few seconds): refused at once."""
    import socket

    from sft.ray_launch import _gcs_unreachable

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    assert f"--ray_address 127.0.0.1:{port}: no Ray head answers at 127.0.0.1:{port}" in _gcs_unreachable(f"127.0.0.1:{port}")
    assert "--ray_address 10.0.0.1: not a Ray address; give HOST:PORT" in _gcs_unreachable("10.0.0.1")
    assert _gcs_unreachable("auto") is None and _gcs_unreachable("local") is None
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    assert "$RAY_ADDRESS 127.0.0.1:" in _gcs_unreachable(None)
    assert "$RAY_ADDRESS (which --ray_address auto uses) 127.0.0.1:" in _gcs_unreachable("auto")  # ray.init's rule
    assert _gcs_unreachable("local") is None  # a new Ray: the variable is not used
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert "$RAY_ADDRESS ray://head:10001: Ray Client (ray://) is not supported" in _gcs_unreachable(None)
    monkeypatch.delenv("RAY_ADDRESS")
    t = time.monotonic()
    r = subprocess.run([sys.executable, RAY_PY, "--ray_address", f"127.0.0.1:{port}", "--model_name_or_path",
                        tiny_model_dir, "--data_path", toy_data, "--output_dir", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"no Ray head answers at 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "gcs_client" not in r.stderr and time.monotonic() - t < 60


def test_request_stop_reaches_training_in_a_thread():
    """Ray Train runs the training function in a thread: no signal handlers there, request_stop instead."""
    from sft import preemption

    assert preemption.request_stop() is False  # no training in this process
    box = {}

    def training_thread():
        box["handler"] = preemption.PreemptionHandler(timeout_s=60).install()  # must not raise off the main thread

    t = threading.Thread(target=training_thread)
    t.start()
    t.join()
    handler = box["handler"]
    try:
        assert handler._previous == {}  # no signal handler was touched
        assert preemption.request_stop(signal.SIGTERM) is True
        assert handler.signum == signal.SIGTERM
        assert preemption.request_stop(signal.SIGINT) is True and handler.signum == signal.SIGTERM  # first wins
    finally:
        handler.uninstall()
    assert preemption.request_stop() is False


def test_launcher_help_and_bad_preset():
    r = subprocess.run(["bash", RAY_SH, "-h"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "--placement_strategy S" in r.stdout and "--preset NAME" in r.stdout
    r = subprocess.run(["bash", RAY_SH, "--preset", "lora", "-m", "x", "-d", "y"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--preset lora: not a preset; choose full_ds, lora_ds" in r.stderr, r.stderr


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
def test_sigterm_under_strict_spread_then_resume_under_strict_pack(cluster, tmp_path, tiny_model_dir, data):
    """STRICT_SPREAD: one worker per node; SIGTERM to the driver: checkpoint, exit 75. The same command with
    STRICT_PACK (both workers on one node) resumes from that checkpoint and finishes."""
    from sft.checkpoint import MARKER

    out, steps = tmp_path / "out", 24
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
    assert [h for h in state["log_history"] if h["step"] <= stopped and "loss" in h] == [h for h in first if "loss" in h]
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

    from sft.checkpoint import MARKER

    out, steps = tmp_path / "out", 100
    p, log = launch(cluster, tmp_path, tiny_model_dir, data, out, "--ray_address", cluster.address, "--num_workers", "2",
                    "--logging_steps", "1", steps=steps)  # --placement_strategy left at its default, PACK
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
