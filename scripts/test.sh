#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed). Extra arguments go to pytest.
# Usage: bash scripts/test.sh [pytest args...]
# Every tier by default, in the order unit, integration, cluster; one tier: bash scripts/test.sh tests/unit
# (the quick one), tests/integration or tests/cluster; or by marker: -m unit, -m "not cluster".
# Two pytest-xdist workers run tests side by side (--dist loadfile: tests that share a fixture built once per
# module, or the one SLURM cluster, stay in one worker; tests/helpers/budget.py); SFT_TEST_WORKERS=N for N workers,
# 0 (or -n 0 among the arguments) for one process. pytest ends with a line per tier: its tests and wall time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
t0=$SECONDS
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# As root, a run that includes the cluster tier (every tier, or tests/cluster named) gets its real daemons
# (SLURM, munge, sshd) from the Debian registry first when they are missing; without them it is skipped.
if (( EUID == 0 )) && { (( $# == 0 )) || [[ "$*" == *cluster* ]]; }; then
  bash "$ROOT/scripts/install_cluster_tools.sh" || echo "test.sh: the cluster tier will be skipped (see above)" >&2
fi
# the bytecode of this checkout's own modules (the installed packages' is written by setup_env.sh): where
# PYTHONDONTWRITEBYTECODE is set, each test's processes would otherwise compile them again (~0.1 s when up to date)
"$ROOT/.venv/bin/python" -m compileall -q -j 0 sft tests scripts bench finetune.py >/dev/null || true
WORKERS=(-n "${SFT_TEST_WORKERS:-2}" --dist loadfile)
for arg in "$@"; do  # the caller chose: -n N, --numprocesses N, --dist ..., -p no:xdist
  case "$arg" in -n|-n[0-9]*|--numprocesses*|--dist*|no:xdist) WORKERS=() ;; esac
done
[[ "${SFT_TEST_WORKERS:-2}" =~ ^[0-9]+$ ]] || { echo "test.sh: SFT_TEST_WORKERS=${SFT_TEST_WORKERS}: a number of workers (0: one process)" >&2; exit 2; }
how="${WORKERS[*]:-the worker settings given}"
echo "test.sh: setup took $((SECONDS - t0)) s; pytest with $how" >&2
exec "$ROOT/.venv/bin/python" -m pytest ${WORKERS[@]+"${WORKERS[@]}"} "$@"
