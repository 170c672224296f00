#!/usr/bin/env bash
# Q-LoRA (4-bit NF4 base, bitsandbytes) on one node without DeepSpeed: one GPU, or on a machine
# without GPUs NPROC_PER_NODE CPU processes (default 1; more run DDP). Qwen's preset of the same name;
# hyperparameters in finetune/presets.sh; flags after -m/-d override them.
#
# Usage: finetune/finetune_qlora_single_gpu.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/presets.sh"
run_preset qlora_single_gpu "${BASH_SOURCE[0]}" "$@"
