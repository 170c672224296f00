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
# Preemption: SIGUSR1 or SIGTERM to this batch shell (#SBATCH --signal=B:USR1@120 below: SLURM sends USR1
# 120 s, or up to 60 s more, before the time limit; `scancel --batch --signal=USR1|TERM JOB`) is passed as
# one SIGTERM to every node's launcher through srun: each rank finishes its step and saves a checkpoint.
# A SIGTERM to every step process (`scancel --signal=TERM JOB`) does the same; a SIGUSR1 to them is turned
# into that SIGTERM by each node's task. Not `scancel --full --signal=TERM`: srun answers a SIGTERM of its
# own by SIGKILLing every task (no checkpoint). Why B:USR1: it reaches only this shell, which then stops
# the nodes once and in order, and USR1 is sent by nothing else, so it always means "the time is up".
# Requeue: a run that exits with 75 (preempted; it saved a checkpoint) is put back in the queue with
# `scontrol requeue` and resumes from that checkpoint when it runs again (after SLURM's requeue hold, the
# job credential's lifetime: 120 s by default, AuthInfo=...,cred_expire=S in slurm.conf); the output file
# is appended to, not replaced.
#SBATCH --job-name=sft
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
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
# ends the others now instead of after their timeouts. The task runs the preset with SIGUSR1 ignored (so a
# SIGUSR1 sent to every step process does not kill the launcher, torchrun and the workers) and sends the
# launcher one SIGTERM on the first SIGUSR1 or SIGTERM it gets itself; it exits with the launcher's code.
# shellcheck disable=SC2016  # expanded by the task's bash
TASK='export NODE_RANK="$SLURM_NODEID"
stopped=""
stop() { if [[ -z "$stopped" ]]; then stopped=1; kill -TERM "$child" 2>/dev/null || true; fi; }
trap stop TERM USR1
(trap "" USR1; exec bash "$0" "$@") &
child=$!
while :; do rc=0; wait "$child" || rc=$?; if (( rc > 128 )) && kill -0 "$child" 2>/dev/null; then continue; fi; break; done
exit "$rc"'
# A signal to this shell: SIGUSR1 to srun, which passes it on to every process of the step (SIGUSR1 is
# passed as is; a SIGTERM would be answered with SIGKILL), and each task turns it into one SIGTERM to its
# launcher. Bash defers traps while a foreground command runs, hence srun in the background and wait.
STOPPED="" SRUN=""
stop_nodes() {
  if [[ -z "$STOPPED" ]]; then
    STOPPED="$1"
    echo "slurm: SIG$1: asking every node to save a checkpoint and stop" >&2
    if [[ -n "$SRUN" ]]; then kill -USR1 "$SRUN" 2>/dev/null || true; fi
  fi
}
trap 'stop_nodes USR1' USR1
trap 'stop_nodes TERM' TERM
srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL \
  bash -c "$TASK" "$PRESET" "$@" &
SRUN=$!
while :; do
  rc=0; wait "$SRUN" || rc=$?
  if (( rc > 128 )) && kill -0 "$SRUN" 2>/dev/null; then continue; fi
  break
done
if (( rc == PREEMPTED_EXIT_CODE )); then
  echo "slurm: preempted (exit $rc): requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
