#!/usr/bin/env bash
# Multi-node fine-tuning under SLURM: one launcher per node (srun, one task per node), each with its
# own NODE_RANK (= SLURM_NODEID); master = the first host of the job's node list.
#
# Usage: sbatch --nodes N [sbatch options] scripts/slurm_train.sh PRESET -m MODEL_DIR -d DATA_FILE [flags ...]
#   PRESET: a preset of finetune/ by name (finetune_lora_single_gpu.sh) or path; the flags after it go to
#           the preset unchanged (finetune.py flags override the preset's).
#   e.g. sbatch --nodes 2 --gres gpu:8 scripts/slurm_train.sh finetune_lora_single_gpu.sh \
#          -m /shared/models/Qwen-7B-Chat -d /shared/data/chat.jsonl --output_dir /shared/runs/qwen-lora
#
# Environment: MASTER_PORT (default 10000 + SLURM_JOB_ID % 20000, so two jobs sharing a node do not
# collide), RDZV_TIMEOUT, NPROC_PER_NODE / GPUS_PER_NODE and the rest of finetune/launch.sh's contract
# reach every node (srun exports the environment). SFT_ROOT: the repository, when sbatch copied this
# script away from it and it was not submitted from the repository folder.
#
# Requeue: a run that exits with 75 (preempted; it saved a checkpoint) is put back in the queue with
# `scontrol requeue`; the output file is appended to, not replaced.
#SBATCH --job-name=sft
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

PREEMPTED_EXIT_CODE=75  # sft/errors.py PREEMPTED_EXIT_CODE (sysexits EX_TEMPFAIL)

usage() { sed -n '2,/^#SBATCH/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; exit 2; }
if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then usage; [[ $# -gt 0 ]]; exit $?; fi

# sbatch runs a copy of this file from its spool folder: find the repository by content.
repo_root() {
  local c
  for c in "${SFT_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "${SLURM_SUBMIT_DIR:-}" "$PWD"; do
    if [[ -n "$c" && -f "$c/finetune/launch.sh" ]]; then echo "$c"; return 0; fi
  done
  die "cannot find the repository (finetune/launch.sh): submit from the repository folder or set SFT_ROOT"
}
ROOT="$(repo_root)"

PRESET="$1"; shift
if [[ "$PRESET" != */* && -f "$ROOT/finetune/$PRESET" ]]; then PRESET="$ROOT/finetune/$PRESET"; fi
[[ -f "$PRESET" ]] || die "preset $PRESET: no such file; give one of: $(cd "$ROOT/finetune" && ls ./*.sh | tr '\n' ' ')"

[[ -n "${SLURM_JOB_ID:-}" ]] || die "SLURM_JOB_ID is not set: submit this script with sbatch"
[[ -n "${SLURM_JOB_NODELIST:-}" ]] || die "SLURM_JOB_NODELIST is not set: submit this script with sbatch"
NNODES="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}"
[[ -n "$NNODES" ]] || die "SLURM_NNODES is not set: submit this script with sbatch"
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
[[ -n "$MASTER_ADDR" ]] || die "scontrol show hostnames $SLURM_JOB_NODELIST printed no host"
MASTER_PORT="${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}"
export NNODES MASTER_ADDR MASTER_PORT
echo "slurm: job $SLURM_JOB_ID, $NNODES node(s) ($SLURM_JOB_NODELIST), master $MASTER_ADDR:$MASTER_PORT, preset $PRESET" >&2

# One task per node; each sets its NODE_RANK from SLURM_NODEID. --kill-on-bad-exit: a node that fails
# ends the others now instead of after their timeouts.
set +e
srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL \
  bash -c 'export NODE_RANK="$SLURM_NODEID"; exec bash "$0" "$@"' "$PRESET" "$@"
rc=$?
set -e
if (( rc == PREEMPTED_EXIT_CODE )); then
  echo "slurm: preempted (exit $rc): requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
