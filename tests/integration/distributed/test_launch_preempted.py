"""finetune/launch.sh's verdict after a signal: "preempted" (exit 75) only when the run stopped for it.

torchrun is replaced by a stand-in (``PYTHON`` names a wrapper that runs the real interpreter for everything
else) that waits for the launcher's SIGTERM and then ends the way the real one can: 128 + 15 (the signal
ended it) or 1 (a failed worker's code, e.g. a lost peer's: the signal came after it, as a node failure under
SLURM ends the other nodes' steps), with or without a worker's code in SFT_EXIT_CODE_FILE (75: it saved a
checkpoint; 1: it failed on its own)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import ROOT

FAKE_PYTHON = """#!/usr/bin/env bash
if [[ "$1 $2" == "-m sft.distributed.torchrun" && -n "${{FAKE_SIGNAL_THEN_FAIL:-}}" ]]; then
  # a worker failed: torchrun ends with its code 1 (a late signal does not change it) as the launcher gets SIGTERM
  trap "" TERM; sleep 0.5; kill -TERM "$PPID"; echo "torchrun 1" >> "$SFT_EXIT_CODE_FILE"; exit 1
fi
if [[ "$1 $2" == "-m sft.distributed.torchrun" ]]; then
  trap 'kill "$nap"; if [[ -n "$FAKE_WORKER_CODE" ]]; then echo "$FAKE_WORKER_CODE" >> "$SFT_EXIT_CODE_FILE"; fi; \
exit "$FAKE_ON_TERM"' TERM
  sleep 60 >/dev/null 2>&1 & nap=$!
  touch "$FAKE_STARTED"; wait; exit 0
fi
if [[ "$1 $2 $3" == "-m sft check" ]]; then exit 0; fi
exec {python} "$@"
"""


@pytest.mark.parametrize("on_term, worker_code, code, preempted", [
    (143, "", 75, True),    # the signal ended torchrun
    (1, "", 1, False),      # torchrun returned a failed worker's code: not a preemption
    (1, "75", 75, True),    # a worker saved a checkpoint and said so
    (143, "1", 1, False),   # the signal ended torchrun while a worker was failing on its own (it wrote 1)
])
def test_preempted_only_when_the_run_stopped_for_the_signal(tmp_path, on_term, worker_code, code, preempted):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    started = tmp_path / "started"
    # MASTER_PORT: the worker's
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    env.update(PYTHON=str(fake), NPROC_PER_NODE="2", SFT_PREFLIGHT="0", FAKE_ON_TERM=str(on_term),
               FAKE_WORKER_CODE=worker_code, FAKE_STARTED=str(started))
    p = subprocess.Popen(["bash", os.path.join(ROOT, "finetune", "launch.sh"), "-m", "M", "-d", "D"], env=env,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err
    assert ("launch: preempted" in err) == preempted, err


def test_a_signal_just_after_a_failure_keeps_the_failure(tmp_path):
    """torchrun ends with 1 while the launcher's SIGTERM arrives (either order): the launcher waits again for
    torchrun's real code after its trap interrupted the wait, and exits 1, not 143 or "preempted"."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    # MASTER_PORT: the worker's
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    env.update(PYTHON=str(fake), NPROC_PER_NODE="2", SFT_PREFLIGHT="0", FAKE_SIGNAL_THEN_FAIL="1")
    for _ in range(5):
        r = subprocess.run(["bash", os.path.join(ROOT, "finetune", "launch.sh"), "-m", "M", "-d", "D"], env=env,
                           capture_output=True, text=True, cwd=str(tmp_path), timeout=60)
        assert r.returncode == 1 and "launch: preempted" not in r.stderr, (r.returncode, r.stderr)
