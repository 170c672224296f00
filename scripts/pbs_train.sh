#!/usr/bin/env bash
# Multi-node fine-tuning under PBS (PBS Pro / OpenPBS / Torque): one launcher per unique host of
# PBS_NODEFILE (which lists a host once per CPU/GPU slot), started over ssh, each with its own
# NODE_RANK (its position in the file's unique-host order); master = the first host.
#
# Usage: qsub -l select=N:ngpus=G [options] -- scripts/pbs_train.sh PRESET -m MODEL_DIR -d DATA_FILE [flags ...]
#        (Torque: qsub -l nodes=N:ppn=G -F "PRESET -m ... -d ..." scripts/pbs_train.sh)
#   PRESET: a preset of finetune/ by name (finetune_lora_single_gpu.sh) or path; the flags after it go to
#           the preset unchanged. Relative paths are relative to the submit folder (PBS_O_WORKDIR).
#
# Why ssh and not pbsdsh: ssh gives each node an explicit NODE_RANK and environment on every PBS flavour;
# pbsdsh passes no environment and numbers tasks differently between PBS Pro and Torque. It needs
# passwordless ssh between the job's nodes (usual on clusters; PBS_RSH names another command, e.g.
# "ssh -p 2222"). The node's environment is sent explicitly: NNODES NODE_RANK MASTER_ADDR MASTER_PORT and
# every set variable named PYTHON, RDZV_TIMEOUT, NPROC_PER_NODE, GPUS_PER_NODE, CUDA_VISIBLE_DEVICES,
# OMP_NUM_THREADS, HF_*, TRANSFORMERS_*, NCCL_*, GLOO_*, TORCH_*, SFT_*.
# MASTER_PORT: default 10000 + (numeric part of PBS_JOBID) % 20000.
#
# Waits for every node; exits with the highest node exit code (0 only if all succeeded) and names the
# nodes that failed. A node that exits 75 (preempted) makes the job exit 75: resubmit it (qrerun).
#PBS -N sft
#PBS -j oe
set -euo pipefail

usage() { sed -n '2,/^#PBS/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; exit 2; }
if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then usage; [[ $# -gt 0 ]]; exit $?; fi

cd "${PBS_O_WORKDIR:-$PWD}"
repo_root() {
  local c
  for c in "${SFT_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "$PWD"; do
    if [[ -n "$c" && -f "$c/finetune/launch.sh" ]]; then echo "$c"; return 0; fi
  done
  die "cannot find the repository (finetune/launch.sh): submit from the repository folder or set SFT_ROOT"
}
ROOT="$(repo_root)"

PRESET="$1"; shift
if [[ "$PRESET" != */* && -f "$ROOT/finetune/$PRESET" ]]; then PRESET="$ROOT/finetune/$PRESET"; fi
[[ -f "$PRESET" ]] || die "preset $PRESET: no such file; give one of: $(cd "$ROOT/finetune" && ls ./*.sh | tr '\n' ' ')"
PRESET="$(cd "$(dirname "$PRESET")" && pwd)/$(basename "$PRESET")"

[[ -n "${PBS_NODEFILE:-}" && -r "${PBS_NODEFILE:-}" ]] || die "PBS_NODEFILE is not set or not readable: submit this script with qsub"
# Unique hosts, first-appearance order (the file repeats a host once per slot, not always adjacently).
mapfile -t HOSTS < <(awk 'NF && !seen[$1]++ {print $1}' "$PBS_NODEFILE")
NNODES="${#HOSTS[@]}"
(( NNODES > 0 )) || die "$PBS_NODEFILE lists no host"
MASTER_ADDR="${HOSTS[0]}"
JOBNUM="${PBS_JOBID:-0}"; JOBNUM="${JOBNUM%%[!0-9]*}"; JOBNUM="${JOBNUM:-0}"
MASTER_PORT="${MASTER_PORT:-$((10000 + 10#$JOBNUM % 20000))}"
read -r -a RSH <<< "${PBS_RSH:-ssh}"
echo "pbs: job ${PBS_JOBID:-?}, $NNODES node(s) (${HOSTS[*]}), master $MASTER_ADDR:$MASTER_PORT, preset $PRESET" >&2

# The remote command: cd to this folder, set the node's environment, run the preset; every word quoted.
FORWARD=()
for name in $(compgen -e); do
  if [[ "$name" =~ ^(PYTHON|RDZV_TIMEOUT|NPROC_PER_NODE|GPUS_PER_NODE|CUDA_VISIBLE_DEVICES|OMP_NUM_THREADS|HF_[A-Z_]+|TRANSFORMERS_[A-Z_]+|NCCL_[A-Z_]+|GLOO_[A-Z_]+|TORCH_[A-Z_]+|SFT_[A-Z_]+)$ ]]; then
    FORWARD+=("$name=${!name}")
  fi
done
remote_command() {  # NODE_RANK [preset arguments ...]
  local rank="$1" q w
  shift
  q="cd $(printf '%q' "$PWD") && env"
  for w in NNODES="$NNODES" NODE_RANK="$rank" MASTER_ADDR="$MASTER_ADDR" MASTER_PORT="$MASTER_PORT" \
           "${FORWARD[@]}" bash "$PRESET" "$@"; do
    q+=" $(printf '%q' "$w")"
  done
  printf '%s\n' "$q"
}

PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' INT TERM
for rank in "${!HOSTS[@]}"; do
  "${RSH[@]}" -n "${HOSTS[$rank]}" "$(remote_command "$rank" "$@")" &
  PIDS+=("$!")
done
worst=0 failed=()
for rank in "${!HOSTS[@]}"; do
  rc=0
  wait "${PIDS[$rank]}" || rc=$?
  if (( rc != 0 )); then failed+=("node rank $rank (${HOSTS[$rank]}): exit $rc"); fi
  if (( rc > worst )); then worst=$rc; fi
done
if (( ${#failed[@]} > 0 )); then
  printf 'pbs: failed: %s\n' "${failed[@]}" >&2
fi
exit "$worst"
