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
# every set variable named PYTHON, RDZV_TIMEOUT, MAX_RESTARTS, RDZV_ID, RDZV_LAST_CALL_TIMEOUT, PBS_JOBID,
# NPROC_PER_NODE, GPUS_PER_NODE, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, HF_*, TRANSFORMERS_*, NCCL_*, GLOO_*,
# TORCH_*, SFT_*.
# MASTER_PORT: default 10000 + (numeric part of PBS_JOBID) % 20000.
#
# Stopping: each node's launcher runs in its own process group, watched over its ssh connection. The first
# node that fails (an exit code other than 0 and 75) stops the others: each is sent a stop line on its
# ssh's stdin and its whole process group gets SIGTERM (a launcher in training saves a checkpoint). The
# same happens on SIGTERM/SIGINT to this script (qdel) and when an ssh connection drops (its stdin ends), so
# no remote process is left running (killing a local ssh alone would leave the remote command running).
# Exit code: the first failing node's (0 only if all succeeded), naming every node that failed; a node
# that exits 75 (preempted) makes the job exit 75: resubmit it (qrerun).
#
# Elastic job (docs/multi-node.md "PBS"): MIN_NODES=MIN (or NNODES=MIN:N, N the job's unique hosts) goes on
# with at least MIN of the N nodes: every launcher gets NNODES=MIN:N (torchrun's c10d rendezvous, id
# PBS_JOBID, its store on the first host, which must stay up), and MAX_RESTARTS, RDZV_ID and
# RDZV_LAST_CALL_TIMEOUT are sent too. A failing node other than the first (a lost host's ssh exits 255) does
# not stop the others: they restart from the last checkpoint without it. The exit code is the first host's
# (the store host, in every round): 0 when the job finished on the nodes left; the nodes lost on the way
# are named. Once the first host has ended, a node still running is stopped after 30 s (ELASTIC_GRACE_S;
# a crashed host's ssh may not notice for a long time) and its ssh ended 10 s later.
#PBS -N sft
#PBS -j oe
set -euo pipefail

usage() { sed -n '2,/^#PBS/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; exit 2; }
if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then usage; [[ $# -gt 0 ]]; exit $?; fi

cd "${PBS_O_WORKDIR:-$PWD}"
# PBS runs a stored copy of this job script, not this file: find the repository by content (the first of these
# with finetune/launch.sh), then source its shell helpers from there (scripts/lib/common.sh says why there).
ROOT=""
for c in "${SFT_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "$PWD"; do
  if [[ -n "$c" && -f "$c/finetune/launch.sh" ]]; then ROOT="$c"; break; fi
done
[[ -n "$ROOT" ]] || die "cannot find the repository (finetune/launch.sh): submit from the repository folder or set SFT_ROOT"
# shellcheck source=lib/common.sh
source "$ROOT/scripts/lib/common.sh"  # find_preset, job_nnodes

find_preset "$1"; shift
PRESET="$(cd "$(dirname "$PRESET")" && pwd)/$(basename "$PRESET")"

[[ -n "${PBS_NODEFILE:-}" && -r "${PBS_NODEFILE:-}" ]] || die "PBS_NODEFILE is not set or not readable: submit this script with qsub"
# Unique hosts, first-appearance order (the file repeats a host once per slot, not always adjacently).
mapfile -t HOSTS < <(awk 'NF && !seen[$1]++ {print $1}' "$PBS_NODEFILE")
ALLOCATED="${#HOSTS[@]}"
(( ALLOCATED > 0 )) || die "$PBS_NODEFILE lists no host"
# NNODES: the job's host count; MIN:count for an elastic job (validated in sft/distributed/contract.py).
job_nnodes "$ALLOCATED" "$ALLOCATED unique host(s) in PBS_NODEFILE $PBS_NODEFILE"
MASTER_ADDR="${HOSTS[0]}"
JOBNUM="${PBS_JOBID:-0}"; JOBNUM="${JOBNUM%%[!0-9]*}"; JOBNUM="${JOBNUM:-0}"
MASTER_PORT="${MASTER_PORT:-$((10000 + 10#$JOBNUM % 20000))}"
read -r -a RSH <<< "${PBS_RSH:-ssh}"
echo "pbs: job ${PBS_JOBID:-?}, $ALLOCATED node(s) (${HOSTS[*]}), master $MASTER_ADDR:$MASTER_PORT, preset $PRESET" >&2
if [[ -n "$ELASTIC" ]]; then
  echo "pbs: elastic job: NNODES=$NNODES on every node (store on $MASTER_ADDR, which must stay up): a node other than the first that fails or is lost does not stop the others" >&2
fi

# The remote command: cd to this folder, set the node's environment, run the preset; every word quoted.
FORWARD=()
for name in $(compgen -e); do
  if [[ "$name" =~ ^(PYTHON|RDZV_TIMEOUT|MAX_RESTARTS|RDZV_ID|RDZV_LAST_CALL_TIMEOUT|PBS_JOBID|NPROC_PER_NODE|GPUS_PER_NODE|CUDA_VISIBLE_DEVICES|OMP_NUM_THREADS|HF_[A-Z_]+|TRANSFORMERS_[A-Z_]+|NCCL_[A-Z_]+|GLOO_[A-Z_]+|TORCH_[A-Z_]+|SFT_[A-Z_]+)$ ]]; then
    FORWARD+=("$name=${!name}")
  fi
done
# On the node: the preset in its own process group (setsid), and a watcher that sends that group SIGTERM
# when a line or the end of its stdin (the ssh channel) arrives; the node's exit code is the preset's.
# shellcheck disable=SC2016  # expanded by the node's bash
NODE_TASK='setsid "$@" </dev/null &
p=$!
exec 3<&0
{ read -r _ <&3 || true; kill -TERM -- "-$p" 2>/dev/null; } &
w=$!
rc=0; wait "$p" || rc=$?
kill "$w" 2>/dev/null || true
exit "$rc"'
remote_command() {  # NODE_RANK [preset arguments ...]
  local rank="$1" q w
  shift
  q="cd $(printf '%q' "$PWD") && exec env"
  for w in NNODES="$NNODES" NODE_RANK="$rank" MASTER_ADDR="$MASTER_ADDR" MASTER_PORT="$MASTER_PORT" \
           "${FORWARD[@]}" bash -c "$NODE_TASK" sft-node bash "$PRESET" "$@"; do
    q+=" $(printf '%q' "$w")"
  done
  printf '%s\n' "$q"
}

# Each ssh reads its stdin from its own FIFO, held open (read-write) by this script: nothing arrives until
# a stop line is written, and it ends when this script is gone.
FIFO_DIR="$(mktemp -d "${TMPDIR:-/tmp}/sft-pbs.XXXXXX")"
PIDS=() FDS=()
for rank in "${!HOSTS[@]}"; do
  mkfifo -m 600 "$FIFO_DIR/$rank"
  exec {fd}<>"$FIFO_DIR/$rank"
  FDS+=("$fd")
done
rm -rf "$FIFO_DIR"
STOPPING=""
stop_nodes() {  # REASON
  [[ -n "$STOPPING" ]] && return 0
  STOPPING=1
  echo "pbs: $1: stopping every node" >&2
  for r in "${!PIDS[@]}"; do
    if kill -0 "${PIDS[$r]}" 2>/dev/null; then echo stop >&"${FDS[$r]}" || true; fi
  done
}
trap 'stop_nodes "SIGTERM"' TERM
trap 'stop_nodes "SIGINT"' INT
for rank in "${!HOSTS[@]}"; do
  "${RSH[@]}" "${HOSTS[$rank]}" "$(remote_command "$rank" "$@")" <&"${FDS[$rank]}" &
  PIDS+=("$!")
done
# Poll (portable to bash 4: no wait -n -p): record each node's exit as it comes.
declare -A RC=()
first=0 failed=() lost=()
GRACE_S="${ELASTIC_GRACE_S:-30}"
first_done=""
while (( ${#RC[@]} < ALLOCATED )); do
  for rank in "${!HOSTS[@]}"; do
    [[ -n "${RC[$rank]:-}" ]] && continue
    kill -0 "${PIDS[$rank]}" 2>/dev/null && continue
    rc=0
    wait "${PIDS[$rank]}" || rc=$?
    RC[$rank]=$rc
    if (( rank == 0 )); then first_done=$SECONDS; fi
    if [[ -n "$ELASTIC" && -z "$STOPPING" ]] && (( rank > 0 && rc != 0 )); then
      lost+=("node rank $rank (${HOSTS[$rank]}): exit $rc")
      echo "pbs: node rank $rank (${HOSTS[$rank]}) lost (exit $rc); elastic job: the other nodes go on without it" >&2
    elif (( rc != 0 )); then
      failed+=("node rank $rank (${HOSTS[$rank]}): exit $rc")
      if (( first == 0 )); then first=$rc; fi
      if (( rc != 75 )); then stop_nodes "node rank $rank (${HOSTS[$rank]}) failed (exit $rc)"; fi
    fi
  done
  # An elastic job is over when the first host (the store) has ended: stop what still runs, then end its ssh
  if [[ -n "$ELASTIC" && -n "$first_done" ]] && (( ${#RC[@]} < ALLOCATED )); then
    if (( SECONDS - first_done >= GRACE_S )); then stop_nodes "node rank 0 (${HOSTS[0]}) ended $GRACE_S s ago"; fi
    if (( SECONDS - first_done >= GRACE_S + 10 )); then
      for rank in "${!HOSTS[@]}"; do
        if [[ -z "${RC[$rank]:-}" ]]; then kill -TERM "${PIDS[$rank]}" 2>/dev/null || true; fi
      done
    fi
  fi
  (( ${#RC[@]} < ALLOCATED )) && sleep 0.5
done
if (( ${#failed[@]} > 0 )); then
  printf 'pbs: failed: %s\n' "${failed[@]}" >&2
fi
if [[ -n "$ELASTIC" ]]; then
  first="${RC[0]}"
  if (( ${#lost[@]} > 0 )); then
    printf 'pbs: lost: %s\n' "${lost[@]}" >&2
    if (( first == 0 )); then
      echo "pbs: elastic job ${PBS_JOBID:-?} finished on the nodes left (node rank 0, ${HOSTS[0]}, exit 0)" >&2
    fi
  fi
fi
exit "$first"
