#!/usr/bin/env bash
# Full fine-tuning with PyTorch FSDP2 (fsdp_config_full_shard.json: parameters, gradients and optimizer
# state sharded; --fsdp_config finetune/fsdp_config_full_shard_offload.json keeps them in CPU memory, GPUs
# only) on NNODES x GPUS_PER_NODE GPU processes, or NPROC_PER_NODE CPU processes (gloo) on a machine without
# GPUs (what runs on CPU: docs/fsdp.md). Hyperparameters (Qwen's full fine-tuning ones, as
# finetune_ds.sh) in finetune/presets.sh; flags after -m/-d override them.
#
# Usage: finetune/finetune_fsdp.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/presets.sh"
run_preset full_fsdp "${BASH_SOURCE[0]}" "$@"
