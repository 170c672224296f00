#!/usr/bin/env bash
# Q-LoRA (4-bit NF4 base, bitsandbytes) with DeepSpeed ZeRO-2 on NNODES x GPUS_PER_NODE processes.
# ZeRO-3 is refused with Q-LoRA (4-bit weights cannot be partitioned). Qwen's preset of the same name;
# hyperparameters in finetune/presets.sh; flags after -m/-d override them.
#
# Usage: finetune/finetune_qlora_ds.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/presets.sh"
run_preset qlora_ds "${BASH_SOURCE[0]}" "$@"
