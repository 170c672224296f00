#!/usr/bin/env bash
# LoRA with PyTorch FSDP2 (fsdp_config_full_shard.json: the frozen base and the adapter sharded; the
# adapter is saved alone) on NNODES x GPUS_PER_NODE GPU processes, or NPROC_PER_NODE CPU processes (gloo)
# on a machine without GPUs (what runs on CPU: docs/fsdp.md). Hyperparameters (Qwen's LoRA
# ones, as finetune_lora_ds.sh) in finetune/presets.sh; flags after -m/-d override them.
#
# Usage: finetune/finetune_lora_fsdp.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/presets.sh"
run_preset lora_fsdp "${BASH_SOURCE[0]}" "$@"
