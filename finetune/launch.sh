#!/usr/bin/env bash
# Shared launcher behind every preset in this folder: strict mode, the node/process environment,
# then finetune.py (directly for one process, through torchrun otherwise).
#
# Usage: finetune/launch.sh -m MODEL_DIR -d DATA_FILE [--no_preflight] [finetune.py flags ...]
#
# Environment (all optional; the same on every node except NODE_RANK):
#   NNODES (1)  NODE_RANK (0, each node its own in [0, NNODES))  MASTER_ADDR (localhost: node rank 0's
#   address, not loopback when NNODES > 1)  MASTER_PORT (6001)
#   GPUS_PER_NODE  processes per node on a GPU machine (default: every visible GPU)
#   NPROC_PER_NODE processes per node on a machine without GPUs (default 1)
#   RDZV_TIMEOUT   seconds to wait for all nodes to join (600); a lost node during training is waited
#                  for --ddp_timeout seconds (600 here for several processes)
#   Elastic job (docs/multi-node.md "Elastic jobs"): NNODES=MIN:MAX, e.g. 2:3, on every node; NODE_RANK is
#   then given by the rendezvous, and the host that owns MASTER_ADDR serves it (it must not be lost).
#   MAX_RESTARTS   restarts of the worker group after a failure (3); each resumes from the newest
#                  verified checkpoint, at the world size of the nodes still there
#   RDZV_ID        the job's rendezvous id, the same on every node (SLURM_JOB_ID or PBS_JOBID, else sft)
#   RDZV_LAST_CALL_TIMEOUT  seconds a round waits for more nodes once MIN have joined (3)
#   GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME  network interface (default for gloo: the route to MASTER_ADDR)
#   SFT_ALLOCATOR  auto (default: tcmalloc preloaded into CPU training processes when installed), tcmalloc
#                  (required), glibc (nothing preloaded); docs/packing-and-throughput.md "The allocator"
#   SFT_PREFLIGHT=0 (or --no_preflight) skips the node rendezvous and the cross-node input comparison
#   PYTHON       interpreter with the sft package installed (default: the repository's .venv if present,
#                else python3; scripts/setup_env.sh installs it)
#   SFT_PROGRAM  Python file run in each process (default: finetune.py next to this folder; the tests
#                use a worker that also reports what each rank computed)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun waits for workers after SIGTERM (default here 360)
#   TORCH_CPP_LOG_LEVEL  torch C++ log level (default here ERROR: c10d's per-connection warnings off)
#
# Exit code 75: preempted (SIGTERM/SIGINT); a checkpoint was saved and the same command resumes.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
# shellcheck source=../scripts/lib/common.sh
source "$ROOT/scripts/lib/common.sh"  # sft_python, wait_child

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
die() { echo "error: $*" >&2; exit 2; }

MODEL="" DATA=""
PASS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -m|--model) [[ $# -ge 2 && "$2" != -* ]] || die "$1 needs a value (the model folder)"; MODEL="$2"; shift 2 ;;
    -d|--data) [[ $# -ge 2 && "$2" != -* ]] || die "$1 needs a value (the data file)"; DATA="$2"; shift 2 ;;
    --no_preflight) export SFT_PREFLIGHT=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
[[ -n "$MODEL" ]] || { usage >&2; die "-m/--model MODEL_DIR is required"; }
[[ -n "$DATA" ]] || { usage >&2; die "-d/--data DATA_FILE is required"; }

PYTHON="$(sft_python "$ROOT")"
command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON: no such program; give the interpreter with the sft package installed (bash $ROOT/scripts/setup_env.sh makes $ROOT/.venv/bin/python), or unset PYTHON"
"$PYTHON" -c 'import sft' 2>/dev/null || die "PYTHON=$PYTHON cannot import the sft package; run bash $ROOT/scripts/setup_env.sh (it installs it into $ROOT/.venv) or: $PYTHON -m pip install -e $ROOT"

NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then NGPU="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
# The env contract is parsed and checked in one place, sft/distributed/contract.py (shared with the training
# processes; stdlib only); it prints this node's start line on stderr and shell assignments on stdout:
# NNODES NODE_RANK MASTER_ADDR MASTER_PORT NPROC DEVICE RDZV_TIMEOUT WORLD ELASTIC MIN_NODES MAX_NODES
# MAX_RESTARTS RDZV_ID RDZV_CONF (+ export GLOO_SOCKET_IFNAME).
PLAN="$("$PYTHON" -m sft.distributed plan --gpus "$NGPU")" || exit $?
eval "$PLAN"
PREC=()
if [[ "$DEVICE" == cuda ]]; then PREC=(--bf16 True); fi
if [[ "$DEVICE" == cpu ]]; then export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"; fi  # DeepSpeed's choice anyway, without its warning per process
# Bounded waits: a lost node stops the others after --ddp_timeout seconds, not torch's 30 minutes
# (the preset's or the user's --ddp_timeout, given later, wins).
TIMEOUTS=()
if (( WORLD > 1 )); then TIMEOUTS=(--ddp_timeout 600); fi

PROGRAM="${SFT_PROGRAM:-$ROOT/finetune.py}"
ARGS=(--model_name_or_path "$MODEL" --data_path "$DATA" "${TIMEOUTS[@]}" "${PREC[@]}" "${PASS[@]}")

# No cd: relative paths in the flags are relative to the caller's working directory.
if (( ! ELASTIC && NNODES == 1 && NPROC == 1 )); then
  exec "$PYTHON" "$PROGRAM" "${ARGS[@]}"
fi
# Several processes: check flags and data once, in one process, so a mistake is reported once and
# cleanly instead of by every rank and then by torchrun.
# The check is told the world sizes the job may run at (an elastic job's at every node count from MIN_NODES to
# MAX_NODES), so that what every rank would refuse about them (--sequence_parallel_size) is refused here, once.
WORLDS="$(for ((n = MIN_NODES; n <= MAX_NODES; n++)); do printf '%s ' "$((n * NPROC))"; done)"
SFT_WORLD_SIZES="$WORLDS" "$PYTHON" -m sft check "${ARGS[@]}" || exit $?
# Preflight: node rank 0 checks that MASTER_PORT is free and waits for every node to say hello on it;
# the others wait (up to RDZV_TIMEOUT) for it to accept connections. Any problem ends every node here.
if [[ "${SFT_PREFLIGHT:-1}" != 0 ]]; then "$PYTHON" -m sft.distributed rendezvous --gpus "$NGPU" || exit $?; fi

# Preemption (README "Resume and preemption"): SIGTERM/SIGINT to this script is passed to torchrun, whose
# agent passes it to every worker and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds before SIGKILL (torch's
# default, 30 s, is raised here to cover --preemption_timeout). torchrun itself then fails with its own
# code, so the workers report theirs in SFT_EXIT_CODE_FILE and this script exits 75 when any rank was
# preempted (also when the signal reached only the workers, e.g. SLURM signalling every process).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-360}"
# c10d's C++ warnings, chiefly "The hostname of the client socket cannot be retrieved" for every connection
# to the master when the nodes' addresses have no reverse name (hosts files: c10d asks for the IPv4-mapped
# IPv6 address). Errors still show; TORCH_CPP_LOG_LEVEL=WARNING (or INFO) brings the warnings back.
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
SFT_EXIT_CODE_FILE="$(mktemp "${TMPDIR:-/tmp}/sft-exit.XXXXXX")"
export SFT_EXIT_CODE_FILE
trap 'rm -f "$SFT_EXIT_CODE_FILE"' EXIT
# torchrun's static rendezvous (a TCPStore on MASTER_ADDR:MASTER_PORT) gives up after RDZV_TIMEOUT too.
# An elastic job uses the c10d rendezvous instead (RDZV_CONF: join timeout RDZV_TIMEOUT, fast detection of a
# lost node, is_host on the host of MASTER_ADDR), and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.13's
# shared store a node that joins after the first round makes every agent fail 60 s later (a key only the
# first round writes).
# sft.distributed.torchrun is torchrun, without its traceback when a signal stops it (exit 128 + signal).
if (( ELASTIC )); then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 SFT_ELASTIC=1
  RDZV=(--nnodes "$MIN_NODES:$MAX_NODES" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
        --rdzv_id "$RDZV_ID" --max_restarts "$MAX_RESTARTS" --rdzv_conf "$RDZV_CONF")
else
  RDZV=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
        --rdzv_conf "$RDZV_CONF")
fi
"$PYTHON" -m sft.distributed.torchrun --nproc_per_node "$NPROC" "${RDZV[@]}" "$PROGRAM" "${ARGS[@]}" &
CHILD=$!
SIGNALLED="" TRAPPED=""
forward() { TRAPPED=1; if [[ -z "$SIGNALLED" ]]; then SIGNALLED="$1"; kill -s "$1" "$CHILD" 2>/dev/null || true; fi; }
trap 'forward TERM' TERM
trap 'forward INT' INT
# torchrun's real exit code, also when a trapped signal interrupted the wait (scripts/lib/common.sh)
rc=0; wait_child "$CHILD" || rc=$?
# torchrun's own record of its code (sft.distributed.torchrun writes it): bash's wait can lose a child's code
# when a trapped signal arrives as the child exits (it then returns 143, or -1)
if reported="$(grep -x 'torchrun [0-9]*' "$SFT_EXIT_CODE_FILE" | tail -n 1)" && [[ -n "$reported" ]]; then
  rc="${reported#torchrun }"
fi
# Preempted: a worker saved a checkpoint and said so (75), or the signal ended torchrun (128 + N). Not when a
# worker failed on its own (it wrote its code, e.g. 1 for a lost peer; torchrun returns it) and a signal came
# as it did: a node failure ends the others' steps that way, and that run did not stop for the signal.
FAILED_RANK_CODE="$(grep -x '[0-9]*' "$SFT_EXIT_CODE_FILE" | grep -vx 75 | head -n 1)" || true
if (( rc > 128 )) && [[ -n "$FAILED_RANK_CODE" ]] && ! grep -qx 75 "$SFT_EXIT_CODE_FILE"; then rc="$FAILED_RANK_CODE"; fi
if (( rc != 0 )) && { grep -qx 75 "$SFT_EXIT_CODE_FILE" || { [[ -n "$SIGNALLED" ]] && (( rc > 128 )); }; }; then
  echo "launch: preempted; the checkpoint is in --output_dir; run the same command again to resume (exit 75)" >&2
  exit 75
fi
exit "$rc"
