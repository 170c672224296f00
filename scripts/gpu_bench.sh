#!/usr/bin/env bash
# The GPU benchmark rows (bf16 with per-document SDPA or flash-attn varlen, padded SDPA, Q-LoRA 4-bit, ZeRO-2 in
# one process) on one CUDA GPU in about 8 minutes: sets up .venv (scripts/setup_env.sh, as in the README), then
# runs bench/gpu_bench.py, which prepares the example model and data when missing and prints real tokens/s and
# MFU against the GPU's measured (and datasheet) bf16 peak. Refuses with exit 2 on a machine without CUDA.
#
# Usage: bash scripts/gpu_bench.sh [bench/gpu_bench.py flags ...]   (e.g. --rows bf16 zero2, --dry_run)
# On a GPU machine, install the CUDA build of torch 2.13.0 if setup_env.sh picked a CPU one; flash-attn is used
# when installed (pip install flash-attn), never required.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$ROOT"
bash scripts/setup_env.sh
exec "$ROOT/.venv/bin/python" bench/gpu_bench.py "$@"
