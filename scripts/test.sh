#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed). Extra arguments go to pytest.
# Usage: bash scripts/test.sh [pytest args...]
# Every tier by default, in the order unit, integration, cluster; one tier: bash scripts/test.sh tests/unit
# (the quick one), tests/integration or tests/cluster; or by marker: -m unit, -m "not cluster".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
