#!/usr/bin/env bash
# Lint the repository with ruff (pyflakes, import order, lines of at most 120 characters; pyproject.toml
# [tool.ruff]). Sets up .venv first if needed (ruff is pinned in requirements.txt). Extra arguments go to
# `ruff check`, e.g. `bash scripts/lint.sh --fix`. Exit code: ruff's (0 clean, 1 problems found).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/ruff" check "$@" .
