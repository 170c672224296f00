#!/usr/bin/env bash
# LoRA fine-tuning on one node: one GPU, or on a machine without GPUs NPROC_PER_NODE CPU processes
# (default 1). Qwen's preset of the same name; hyperparameters are the defaults below, and any
# finetune.py flag given after -m/-d overrides them.
#
# Usage: finetune/finetune_lora_single_gpu.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  echo "Launcher (environment variables, shared flags):"
  exec "$HERE/launch.sh" -h
fi
export SFT_PRESET_FLAGS="--use_lora True --output_dir output_lora --num_train_epochs 5 \
--per_device_train_batch_size 2 --gradient_accumulation_steps 8 --learning_rate 3e-4 --weight_decay 0.1 \
--adam_beta2 0.95 --warmup_ratio 0.01 --lr_scheduler_type cosine --model_max_length 512 --logging_steps 1 \
--save_strategy steps --save_steps 1000 --save_total_limit 10 --report_to none --gradient_checkpointing True"
if [[ -z "${NPROC_PER_NODE:-}" && -z "${GPUS_PER_NODE:-}" ]]; then export GPUS_PER_NODE=1; fi
exec "$HERE/launch.sh" "$@"
