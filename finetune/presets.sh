# Hyperparameters of every named preset, in one place (sourced by the finetune_*.sh scripts).
# Values follow Qwen's finetune/*.sh. A flag given on the command line after -m/-d is passed later
# and wins (e.g. --deepspeed finetune/ds_config_zero3.json, --fsdp_config finetune/fsdp_config_full_shard_offload.json,
# --num_train_epochs 1, --output_dir out).
# shellcheck shell=bash

# Flags shared by all presets.
PRESET_COMMON=(--num_train_epochs 5 --per_device_eval_batch_size 1 --eval_strategy no
  --save_strategy steps --save_steps 1000 --save_total_limit 10 --weight_decay 0.1 --adam_beta2 0.95
  --warmup_ratio 0.01 --lr_scheduler_type cosine --logging_steps 1 --report_to none --model_max_length 512
  --gradient_checkpointing True)

# preset_flags NAME: fill the array PRESET with NAME's flags (HERE = this folder).
preset_flags() {
  local lora=(--use_lora True --per_device_train_batch_size 2 --gradient_accumulation_steps 8 --learning_rate 3e-4)
  case "$1" in
    full_ds)          PRESET=(--output_dir output_qwen --per_device_train_batch_size 1 --gradient_accumulation_steps 16
                              --learning_rate 1e-5 --lazy_preprocess True --deepspeed "$HERE/ds_config_zero3.json") ;;
    lora_ds)          PRESET=(--output_dir output_qwen "${lora[@]}" --deepspeed "$HERE/ds_config_zero2.json") ;;
    qlora_ds)         PRESET=(--output_dir output_qwen "${lora[@]}" --q_lora True --deepspeed "$HERE/ds_config_zero2.json") ;;
    full_fsdp)        PRESET=(--output_dir output_qwen --per_device_train_batch_size 1 --gradient_accumulation_steps 16
                              --learning_rate 1e-5 --lazy_preprocess True --fsdp --fsdp_config "$HERE/fsdp_config_full_shard.json") ;;
    lora_fsdp)        PRESET=(--output_dir output_qwen "${lora[@]}" --fsdp --fsdp_config "$HERE/fsdp_config_full_shard.json") ;;
    lora_single_gpu)  PRESET=(--output_dir output_qwen "${lora[@]}") ;;
    qlora_single_gpu) PRESET=(--output_dir output_qwen "${lora[@]}" --q_lora True) ;;
    *) echo "error: unknown preset $1" >&2; return 2 ;;
  esac
  PRESET=("${PRESET_COMMON[@]}" "${PRESET[@]}")
}

# run_preset NAME SCRIPT [ARGS...]: -h prints SCRIPT's header and the launcher's help; otherwise runs
# finetune/launch.sh with NAME's flags first and the user's arguments after them.
# *_single_gpu presets default to one process (GPUS_PER_NODE=1) unless NPROC_PER_NODE/GPUS_PER_NODE is set.
run_preset() {
  local name="$1" script="$2"
  shift 2
  if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set -euo/p' "$script" | sed '$d' | sed 's/^# \{0,1\}//'
    echo "Preset flags (finetune/presets.sh, $name); yours after -m/-d win:"
    preset_flags "$name"
    echo "  ${PRESET[*]}"
    echo "Launcher (environment variables, shared flags):"
    exec "$HERE/launch.sh" -h
  fi
  preset_flags "$name"
  if [[ "$name" == *_single_gpu && -z "${NPROC_PER_NODE:-}" && -z "${GPUS_PER_NODE:-}" ]]; then
    export GPUS_PER_NODE=1
  fi
  exec "$HERE/launch.sh" "${PRESET[@]}" "$@"
}
