#!/usr/bin/env bash
# LoRA with DeepSpeed ZeRO-2 (ds_config_zero2.json; --deepspeed finetune/ds_config_zero3.json to
# shard the frozen base too) on NNODES x GPUS_PER_NODE processes. Qwen's preset of the same name;
# hyperparameters in finetune/presets.sh; flags after -m/-d override them.
#
# Usage: finetune/finetune_lora_ds.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/presets.sh"
run_preset lora_ds "${BASH_SOURCE[0]}" "$@"
