"""Ray launch path as processes, without a Ray cluster: scripts/ray_train.py refuses bad flags and an address
nobody answers at before Ray starts, and finetune/finetune_ray.sh's help and preset check. The in-process rules
are in tests/unit/ray/test_ray.py; a real two-node Ray cluster in tests/cluster/test_ray.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.helpers.paths import ROOT

RAY_SH = os.path.join(ROOT, "finetune", "finetune_ray.sh")
RAY_PY = os.path.join(ROOT, "scripts", "ray_train.py")


def test_bad_placement_strategy_is_refused_before_ray_starts(tiny_model_dir, toy_data, tmp_path):
    r = subprocess.run([sys.executable, RAY_PY, "--placement_strategy", "STRICT_SPRED", "--num_workers", "-1",
                        "--model_name_or_path", tiny_model_dir, "--data_path", toy_data,
                        "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--placement_strategy STRICT_SPRED: not a Ray placement strategy (did you mean STRICT_SPREAD?)" in r.stderr
    assert "--num_workers -1: must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr and "ray:" not in r.stderr  # nothing of Ray was started
    assert not (tmp_path / "out").exists()


def test_unreachable_ray_address_fails_at_once(tiny_model_dir, toy_data, tmp_path, monkeypatch):
    """ray.init retries an address nobody listens on for minutes (a warning every few seconds): refused at once."""
    import socket

    from sft.ray.driver import _gcs_unreachable

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    assert f"--ray_address 127.0.0.1:{port}: no Ray head answers at 127.0.0.1:{port}" in \
        _gcs_unreachable(f"127.0.0.1:{port}")
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


def test_launcher_help_and_bad_preset():
    r = subprocess.run(["bash", RAY_SH, "-h"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "--placement_strategy S" in r.stdout and "--preset NAME" in r.stdout
    r = subprocess.run(["bash", RAY_SH, "--preset", "lora", "-m", "x", "-d", "y"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "--preset lora: not a preset; choose full_ds, lora_ds" in r.stderr, r.stderr
