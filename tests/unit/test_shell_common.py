"""scripts/lib/common.sh, the shell helpers that the launch scripts source, run with bash in a temporary folder:
the interpreter that sft_python picks, and wait_child's exit code after a trapped SIGTERM (the child's own
code, not 143) or without a trap (128 + the signal that ended the child)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.helpers.paths import ROOT

LIB = os.path.join(ROOT, "scripts", "lib", "common.sh")


def bash(script: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{LIB}"; {script}'], env=env,
                          capture_output=True, text=True, timeout=30, **kw)


@pytest.mark.parametrize("python, venv, chosen", [
    ("/opt/py/bin/python3.12", "exe", "/opt/py/bin/python3.12"),  # $PYTHON wins over the .venv
    ("", "exe", "ROOT/.venv/bin/python"),                         # set but empty: as if unset
    (None, "exe", "ROOT/.venv/bin/python"),
    (None, "file", "python3"),                                    # there but not executable
    (None, None, "python3"),
])
def test_sft_python_picks_the_interpreter(tmp_path, python, venv, chosen):
    root = tmp_path / "repo"
    (root / ".venv" / "bin").mkdir(parents=True)
    if venv:
        exe = root / ".venv" / "bin" / "python"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755 if venv == "exe" else 0o644)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    if python is not None:
        env["PYTHON"] = python
    r = bash(f'sft_python "{root}"', env)
    assert r.returncode == 0 and r.stdout == chosen.replace("ROOT", str(root)) + "\n", r


# The parent forwards a trapped SIGTERM to its child, as launch.sh and slurm_train.sh do, and exits with the
# code wait_child returns; the child ends with CHILD_CODE a moment after its own SIGTERM (a checkpoint's save).
PARENT = """
bash -c 'trap "kill \\$s; sleep 0.3; exit $CHILD_CODE" TERM; sleep 30 >/dev/null 2>&1 & s=$!; touch "$READY"; wait' &
child=$!
TRAPPED=""
if [[ -n "$FORWARD" ]]; then trap 'TRAPPED=1; kill -TERM "$child"' TERM; fi
rc=0; wait_child "$child" || rc=$?
echo "rc=$rc"
exit "$rc"
"""


def run_parent(tmp_path, signal_to, **env_extra):
    ready = tmp_path / "ready"
    env = {**os.environ, "READY": str(ready), "CHILD_CODE": "75", "FORWARD": "1", **env_extra}
    p = subprocess.Popen(["bash", "-c", f'set -euo pipefail; source "{LIB}"; {PARENT}'], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
        if signal_to == "parent":
            p.send_signal(signal.SIGTERM)
        else:  # the child alone, by its process id (pgrep -P: the parent's only child)
            child = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            assert len(child) == 1, child
            os.kill(int(child[0]), signal.SIGKILL)
        out, err = p.communicate(timeout=20)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # also what is left of the group (the child's sleep)
        except ProcessLookupError:
            pass
        p.wait()
    return p.returncode, out, err


def test_wait_child_returns_the_childs_code_after_a_trapped_sigterm(tmp_path):
    code, out, err = run_parent(tmp_path, "parent")
    assert (code, out) == (75, "rc=75\n"), err  # bash's own wait returned 143 when the trap fired


def test_wait_child_returns_128_plus_the_signal_that_ended_the_child(tmp_path):
    code, out, err = run_parent(tmp_path, "child")
    assert (code, out) == (128 + signal.SIGKILL, f"rc={128 + signal.SIGKILL}\n"), err
