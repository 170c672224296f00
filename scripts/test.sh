#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed). Extra arguments go to pytest.
# Usage: bash scripts/test.sh [pytest args...]
# Every tier by default, in the order unit, integration, cluster; one tier: bash scripts/test.sh tests/unit
# (the quick one), tests/integration or tests/cluster; or by marker: -m unit, -m "not cluster".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# As root, a run that includes the cluster tier (every tier, or tests/cluster named) gets its real daemons
# (SLURM, munge, sshd) from the Debian registry first when they are missing; without them it is skipped.
if (( EUID == 0 )) && { (( $# == 0 )) || [[ "$*" == *cluster* ]]; }; then
  bash "$ROOT/scripts/install_cluster_tools.sh" || echo "test.sh: the cluster tier will be skipped (see above)" >&2
fi
exec "$ROOT/.venv/bin/python" -m pytest "$@"
