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
# A node that fails: SLURM ends the job (the other nodes stop at once: their peer went away) and, as the job
# is requeue-able, requeues it itself; it runs again when enough nodes are up and resumes from the last
# complete checkpoint. The SIGTERM that SLURM's end of the job then sends is no preemption: the log says
# "slurm: ... node failure: NODE (DOWN...) lost; SLURM has ... requeued job ID itself", and this script does
# not requeue the job a second time (nor after SLURM's own preemption by requeue).
#
# Elastic job (docs/multi-node.md "SLURM"): MIN_NODES=MIN (or NNODES=MIN:N, N the job's node count) goes on
# with at least MIN of the job's N nodes: every node's launcher gets NNODES=MIN:N (torchrun's c10d rendezvous,
# id SLURM_JOB_ID, its store on the first node, which must stay up), srun runs with --no-kill and without
# --kill-on-bad-exit, and a lost node's task ends alone; the others restart from the last checkpoint at the
# smaller world size. Submit it with `sbatch --no-kill` as well, or SLURM itself ends (and requeues) the whole
# job when a node fails. The exit code is the first node's launcher's (the store host, in every round): 0
# when the job finished on the nodes left; the log names the nodes lost on the way.
#   e.g. MIN_NODES=2 sbatch --nodes 3 --no-kill scripts/slurm_train.sh finetune_lora_single_gpu.sh -m ... -d ...
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

# sbatch runs a copy of this file from its spool folder: find the repository by content (the first of these
# with finetune/launch.sh), then source its shell helpers from there (scripts/lib/common.sh says why there).
ROOT=""
for c in "${SFT_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "${SLURM_SUBMIT_DIR:-}" "$PWD"; do
  if [[ -n "$c" && -f "$c/finetune/launch.sh" ]]; then ROOT="$c"; break; fi
done
[[ -n "$ROOT" ]] || die "cannot find the repository (finetune/launch.sh): submit from the repository folder or set SFT_ROOT"
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"  # find_preset, job_nnodes, wait_child

find_preset "$1"; shift

[[ -n "${SLURM_JOB_ID:-}" ]] || die "SLURM_JOB_ID is not set: submit this script with sbatch"
[[ -n "${SLURM_JOB_NODELIST:-}" ]] || die "SLURM_JOB_NODELIST is not set: submit this script with sbatch"
ALLOCATED="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}"
[[ -n "$ALLOCATED" ]] || die "SLURM_NNODES is not set: submit this script with sbatch"
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
[[ -n "$MASTER_ADDR" ]] || die "scontrol show hostnames $SLURM_JOB_NODELIST printed no host"
MASTER_PORT="${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}"
# NNODES: the job's node count; MIN:count for an elastic job (validated in sft/distributed/contract.py).
job_nnodes "$ALLOCATED" "SLURM_NNODES=$ALLOCATED"
export NNODES MASTER_ADDR MASTER_PORT
echo "slurm: job $SLURM_JOB_ID, $ALLOCATED node(s) ($SLURM_JOB_NODELIST), master $MASTER_ADDR:$MASTER_PORT, preset $PRESET" >&2
if [[ -n "$ELASTIC" ]]; then
  echo "slurm: elastic job: NNODES=$NNODES on every node (rendezvous ${RDZV_ID:-$SLURM_JOB_ID}, store on $MASTER_ADDR, which must stay up); srun --no-kill: a lost node's task ends alone and the others go on. Submitted without sbatch --no-kill, SLURM still ends the whole job when a node fails" >&2
fi

# One task per node; each sets its NODE_RANK from SLURM_NODEID. --kill-on-bad-exit: a node that fails
# ends the others now instead of after their timeouts (an elastic job instead: --no-kill, so that SLURM does
# not end the step when a node fails, and --kill-on-bad-exit=0: a lost node's launcher ends alone; the first
# node's task writes its code to SFT_SLURM_RC_DIR, on this host, for the verdict). The task runs the preset with SIGUSR1 ignored (so a
# SIGUSR1 sent to every step process does not kill the launcher, torchrun and the workers) and sends the
# launcher one SIGTERM on the first SIGUSR1 or SIGTERM it gets itself; it exits with the launcher's code
# (wait_child: its text goes with the task, so the node needs no file but the preset).
# shellcheck disable=SC2016  # expanded by the task's bash
TASK="$(declare -f wait_child)"'
export NODE_RANK="$SLURM_NODEID"
stopped="" TRAPPED=""
stop() { TRAPPED=1; if [[ -z "$stopped" ]]; then stopped=1; kill -TERM "$child" 2>/dev/null || true; fi; }
trap stop TERM USR1
(trap "" USR1; exec bash "$0" "$@") &
child=$!
rc=0; wait_child "$child" || rc=$?
if [[ -n "${SFT_SLURM_RC_DIR:-}" && "$SLURM_NODEID" == 0 ]]; then echo "$rc" > "$SFT_SLURM_RC_DIR/node0" || true; fi
exit "$rc"'
# A signal to this shell: SIGUSR1 to srun, which passes it on to every process of the step (SIGUSR1 is
# passed as is; a SIGTERM would be answered with SIGKILL), and each task turns it into one SIGTERM to its
# launcher. Bash defers traps while a foreground command runs, hence srun in the background and wait.
# What SLURM did, from its own records (scontrol answers from slurmctld, which decided it): the job's Restarts
# above this run's SLURM_RESTART_COUNT (SLURM has requeued it already: after a node failure, or its own
# preemption) and nodes of the job DOWN / FAIL / NOT_RESPONDING (a node failure). slurm_ended prints what
# happened, nothing when neither is so.
# Nodes of the job that slurmctld shows DOWN / FAIL / NOT_RESPONDING, with their state and reason, comma-separated.
lost_nodes() {
  local n info lost=""
  for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    info="$(scontrol -o show node "$n" 2>/dev/null)" || continue
    if [[ "$info" =~ State=([A-Z_+]*(DOWN|FAIL|NOT_RESPONDING)[A-Z_+]*) ]]; then
      lost+="${lost:+, }$n (${BASH_REMATCH[1]}$([[ "$info" =~ Reason=([^[]*) ]] && echo ": ${BASH_REMATCH[1]% }"))"
    fi
  done
  echo "$lost"
}
slurm_ended() {
  local job restarts state lost
  job="$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null)" || return 0
  restarts="$(sed -n 's/.*\bRestarts=\([0-9]*\).*/\1/p' <<<"$job")"
  state="$(sed -n 's/.*\bJobState=\([A-Z_]*\).*/\1/p' <<<"$job")"
  lost="$(lost_nodes)"
  local hint=""
  if [[ -n "$ELASTIC" ]]; then hint=" (an elastic job goes on without a lost node only when submitted with sbatch --no-kill)"; fi
  if (( ${restarts:-0} > ${SLURM_RESTART_COUNT:-0} )) && [[ -n "$lost" ]]; then
    echo "node failure: $lost lost; SLURM has ended this run and requeued job $SLURM_JOB_ID itself (JobState=$state, Restarts=$restarts)$hint; it runs again when enough nodes are up and resumes from the last complete checkpoint in --output_dir"
  elif (( ${restarts:-0} > ${SLURM_RESTART_COUNT:-0} )); then
    echo "SLURM has requeued job $SLURM_JOB_ID itself (JobState=$state, Restarts=$restarts: preempted by SLURM or scontrol requeue); it resumes from the last complete checkpoint in --output_dir when it runs again"
  elif [[ -n "$lost" || "$state" == NODE_FAIL ]]; then
    echo "node failure: ${lost:-a node of the job} lost; SLURM has ended this run (JobState=$state)$hint and does not requeue it (submitted with --no-requeue, or JobRequeue=0 in slurm.conf): submit the same command again to resume from the last complete checkpoint in --output_dir"
  fi
}
STOPPED="" SRUN="" ENDED="" TOLD="" TRAPPED=""
stop_nodes() {
  TRAPPED=1
  if [[ -z "$STOPPED" ]]; then
    STOPPED="$1"
    if [[ "$1" == TERM ]]; then ENDED="$(slurm_ended)" || true; fi
    if [[ -n "$ENDED" ]]; then
      TOLD=1
      echo "slurm: SIGTERM from SLURM ending the job: $ENDED" >&2
    else
      echo "slurm: SIG$1: asking every node to save a checkpoint and stop" >&2
    fi
    if [[ -n "$SRUN" ]]; then kill -USR1 "$SRUN" 2>/dev/null || true; fi
  fi
}
trap 'stop_nodes USR1' USR1
trap 'stop_nodes TERM' TERM
# A rerun (SLURM_RESTART_COUNT >= 1) first runs one empty step on every node, so the training step is step 1,
# not 0. Step numbers start again at 0 in a requeued job, and after a node failure slurmctld can deliver a
# signal meant for the previous run's step 0 (srun --kill-on-bad-exit's "terminate step JOB.0", queued while
# the node was down and retried 60 s later: slurmd logs `_rpc_signal_tasks: sending signal 991 to
# StepId=JOB.0`) to the node once it is back, where it would SIGTERM the rerun's step 0 (SLURM 22.05).
if (( ${SLURM_RESTART_COUNT:-0} > 0 )); then
  echo "slurm: rerun $SLURM_RESTART_COUNT of job $SLURM_JOB_ID: an empty step 0 first (a late signal for the previous run's step 0 then reaches no launcher)" >&2
  srun --nodes="$ALLOCATED" --ntasks="$ALLOCATED" --ntasks-per-node=1 true || true
fi
KILL=(--kill-on-bad-exit=1)
if [[ -n "$ELASTIC" ]]; then
  KILL=(--no-kill --kill-on-bad-exit=0)
  SFT_SLURM_RC_DIR="$(mktemp -d "${TMPDIR:-/tmp}/sft-slurm.XXXXXX")"
  export SFT_SLURM_RC_DIR
  trap 'rm -rf "$SFT_SLURM_RC_DIR"' EXIT
fi
srun --nodes="$ALLOCATED" --ntasks="$ALLOCATED" --ntasks-per-node=1 "${KILL[@]}" --export=ALL \
  bash -c "$TASK" "$PRESET" "$@" &
SRUN=$!
rc=0; wait_child "$SRUN" || rc=$?  # srun's own exit code, also when a trapped signal interrupted the wait
# An elastic job's verdict is the first node's launcher's (the rendezvous store host takes part in every round
# and, after the final save's barrier, exits 0 only when the job finished); srun's is the highest code of any
# task, also of a node that dropped out while its host stayed up (a lost host's task counts for nothing).
if [[ -n "$ELASTIC" ]]; then
  first_rc="$(cat "$SFT_SLURM_RC_DIR/node0" 2>/dev/null)" || true
  lost="$(lost_nodes)" || true
  if [[ "$first_rc" =~ ^[0-9]+$ ]] && (( first_rc != rc )); then
    if [[ -z "$STOPPED" ]] && (( rc > first_rc )); then  # no signal (SLURM's end of the job, a preemption) came
      echo "slurm: elastic job: srun exit $rc (a node's launcher failed while its host stayed up: its lines are above); the job's exit code is $MASTER_ADDR's, the rendezvous store host's: $first_rc" >&2
    fi
    rc="$first_rc"
  fi
  if [[ -n "$lost" ]]; then
    if (( rc == 0 )); then
      echo "slurm: elastic job $SLURM_JOB_ID finished on the nodes left; lost on the way: $lost (taken out of the job by SLURM: sbatch --no-kill)" >&2
    else
      echo "slurm: elastic job $SLURM_JOB_ID: lost on the way: $lost" >&2
    fi
  fi
fi
# Asked to stop, every node saves and exits 75; --kill-on-bad-exit then ends a node still closing down (its
# launcher exits 128 + SIGTERM) as soon as the first one has exited 75, and srun reports the highest code: after
# the stop, that 143 is the same preemption (a node cut short in its save leaves no completion marker: the resume
# takes the previous checkpoint). So is 255: the SIGTERM reached the node's task shell just as its launcher exited
# 75, and bash's wait lost the launcher's code (it returns -1; seen in the suite: "launch: preempted ... (exit 75)",
# then "srun: error: node2: task 2: Exited with exit code 255").
if [[ -n "$STOPPED" && -z "$ELASTIC" ]] && (( rc == 143 || rc == 255 )); then rc="$PREEMPTED_EXIT_CODE"; fi
# Asked twice: SLURM's end of the job SIGTERMs every process of the batch step, the first scontrol too.
for _ in 1 2; do
  if (( rc == 0 )) || [[ -n "$ENDED" ]]; then break; fi
  found="$(slurm_ended)" || true
  if [[ -n "$found" ]]; then ENDED="$found"; fi
done
if [[ -n "$ENDED" ]]; then
  # SLURM decided (and requeued a requeue-able job); a second `scontrol requeue` would count a second restart
  if [[ -z "$TOLD" ]]; then echo "slurm: $ENDED" >&2; fi
elif (( rc == PREEMPTED_EXIT_CODE )); then
  echo "slurm: preempted (exit $rc): requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
