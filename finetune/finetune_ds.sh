#!/usr/bin/env bash
# Full fine-tuning with DeepSpeed ZeRO-3 (ds_config_zero3.json) on NNODES x GPUS_PER_NODE
# processes (NPROC_PER_NODE CPU processes on a machine without GPUs). Qwen's preset of the same name;
# hyperparameters in finetune/presets.sh; flags after -m/-d override them.
#
# Usage: finetune/finetune_ds.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/presets.sh"
run_preset full_ds "${BASH_SOURCE[0]}" "$@"
