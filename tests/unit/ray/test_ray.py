"""Ray launch path without Ray running: the Ray flags, the placement rules (sft/ray/flags.py, sft/ray/placement.py), a
YAML config holding Ray and training flags, and the stop request that reaches training in a thread. The launcher and
scripts/ray_train.py as processes are in tests/integration/ray/test_ray.py; a real two-node Ray cluster in
tests/cluster/test_ray.py.
"""
from __future__ import annotations

import signal
import threading

import pytest


def test_ray_flags_check_and_normalise():
    from sft.errors import ConfigError
    from sft.ray.flags import RayArguments, check_ray_args

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
    from sft.ray.placement import placement_problem

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
    from sft.ray.flags import RayArguments, check_ray_args
    from sft.ray.placement import placement_problem

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
    from sft.config.arguments import parse_args
    from sft.errors import ConfigError
    from sft.ray.flags import RayArguments

    cfg = tmp_path / "ray.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndata_path: {toy_data}\noutput_dir: {tmp_path / 'o'}\n"
                   "num_workers: 4\nplacement_strategy: SPREAD\nlearning_rate: 1.0e-4\n")
    model, data_args, training, lora, ray_args = parse_args(["--config", str(cfg), "--num_workers", "2"],
                                                            (RayArguments,))
    assert (ray_args.num_workers, ray_args.placement_strategy, training.learning_rate) == (2, "SPREAD", 1e-4)
    with pytest.raises(ConfigError, match="unknown key 'num_workers'"):  # finetune.py alone has no Ray flags
        parse_args(["--config", str(cfg)])


def test_request_stop_reaches_training_in_a_thread():
    """Ray Train runs the training function in a thread: no signal handlers there, request_stop instead."""
    from sft.train import preemption

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
