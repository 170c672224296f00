#!/usr/bin/env bash
# Ray cluster launch: run once, on any node of a running Ray cluster (`ray start --head --port 6379` on
# one node, `ray start --address=HEAD:6379` on the others). Ray Train (TorchTrainer) starts one training
# process per worker, places them with a Ray placement group and sets up torch.distributed among them;
# each runs finetune.py's training. Hyperparameters: a preset of finetune/presets.sh (default lora_ds,
# Qwen's LoRA + ZeRO-2 preset); flags after -m/-d override them. See README "Ray cluster".
#
# Usage: finetune/finetune_ray.sh [--preset NAME] -m MODEL_DIR -d DATA_FILE [Ray flags] [finetune.py flags ...]
#   --preset NAME            full_ds | lora_ds (default) | qlora_ds | lora_single_gpu | qlora_single_gpu
#   --ray_address ADDR       auto | HOST:PORT of the head | local (a new Ray on this machine alone); unset:
#                            $RAY_ADDRESS, else the cluster started on this machine, else a new local Ray
#   --num_workers N          training processes (0 = one per GPU, or one per node without GPUs)
#   --placement_strategy S   PACK (default) | SPREAD | STRICT_PACK | STRICT_SPREAD
#   --use_gpu B  --cpus_per_worker C  --gpus_per_worker G  --placement_timeout SECONDS
# --output_dir must be on a filesystem shared by every node (rank 0 writes the adapter and checkpoints).
# Environment: PYTHON (default: the repository's .venv if present, else python3).
# Exit codes: 0 done, 2 a problem to fix (message on stderr), 75 preempted (the same command resumes).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
# shellcheck source=presets.sh
source "$HERE/presets.sh"
# shellcheck source=../scripts/lib/common.sh
source "$ROOT/scripts/lib/common.sh"  # sft_python

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; exit 2; }

NAME=lora_ds MODEL="" DATA=""
PASS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --preset) [[ $# -ge 2 && "$2" != -* ]] || die "$1 needs a value (a preset name)"; NAME="$2"; shift 2 ;;
    -m|--model) [[ $# -ge 2 && "$2" != -* ]] || die "$1 needs a value (the model folder)"; MODEL="$2"; shift 2 ;;
    -d|--data) [[ $# -ge 2 && "$2" != -* ]] || die "$1 needs a value (the data file)"; DATA="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
[[ -n "$MODEL" ]] || { usage >&2; die "-m/--model MODEL_DIR is required"; }
[[ -n "$DATA" ]] || { usage >&2; die "-d/--data DATA_FILE is required"; }
preset_flags "$NAME" 2>/dev/null || die "--preset $NAME: not a preset; choose full_ds, lora_ds, qlora_ds, lora_single_gpu or qlora_single_gpu"

PYTHON="$(sft_python "$ROOT")"
# No cd: relative paths in the flags are relative to the caller's working directory (the same path must
# exist on every node; the workers start in it).
exec "$PYTHON" "$ROOT/scripts/ray_train.py" --model_name_or_path "$MODEL" --data_path "$DATA" "${PRESET[@]}" "${PASS[@]}"
