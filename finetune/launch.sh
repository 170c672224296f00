#!/usr/bin/env bash
# Shared launcher behind every preset in this folder: strict mode, the node/process environment,
# then finetune.py (directly for one process, through torchrun otherwise).
#
# Usage: finetune/launch.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
#
# Environment (all optional):
#   NNODES (1)  NODE_RANK (0)  MASTER_ADDR (localhost; required when NNODES > 1)  MASTER_PORT (6001)
#   GPUS_PER_NODE  processes per node on a GPU machine (default: every visible GPU)
#   NPROC_PER_NODE processes per node on a machine without GPUs (default 1)
#   PYTHON       interpreter (default: the repository's .venv if present, else python3)
#   SFT_PROGRAM  Python file run in each process (default: finetune.py next to this folder; the tests
#                use a worker that also reports what each rank computed)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun waits for workers after SIGTERM (default here 360)
#
# Exit code 75: preempted (SIGTERM/SIGINT); a checkpoint was saved and the same command resumes.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
die() { echo "error: $*" >&2; exit 2; }

MODEL="" DATA=""
PASS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -m|--model) [[ $# -ge 2 ]] || die "$1 needs a value (the model folder)"; MODEL="$2"; shift 2 ;;
    -d|--data) [[ $# -ge 2 ]] || die "$1 needs a value (the data file)"; DATA="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
[[ -n "$MODEL" ]] || { usage >&2; die "-m/--model MODEL_DIR is required"; }
[[ -n "$DATA" ]] || { usage >&2; die "-d/--data DATA_FILE is required"; }

# decimal, no leading zeros (bash would read 010 as octal), at most 9 digits (no arithmetic overflow)
is_uint() { [[ "$1" =~ ^(0|[1-9][0-9]{0,8})$ ]]; }
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR_GIVEN="${MASTER_ADDR:-}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6001}"
is_uint "$NNODES" && (( NNODES >= 1 )) || die "NNODES=$NNODES: must be a whole number >= 1"
is_uint "$NODE_RANK" && (( NODE_RANK < NNODES )) || die "NODE_RANK=$NODE_RANK: must be in [0, NNODES=$NNODES)"
is_uint "$MASTER_PORT" && (( MASTER_PORT >= 1 && MASTER_PORT <= 65535 )) || die "MASTER_PORT=$MASTER_PORT: must be in 1-65535"
if (( NNODES > 1 )) && [[ -z "$MASTER_ADDR_GIVEN" ]]; then
  die "MASTER_ADDR is not set: with NNODES=$NNODES every node must be given the address of node rank 0 (localhost would make each node train alone)"
fi

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then NGPU="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
PREC=()
if (( NGPU > 0 )); then
  NPROC="${GPUS_PER_NODE:-$NGPU}"
  PREC=(--bf16 True)
  DEVICE="cuda"
else
  NPROC="${NPROC_PER_NODE:-1}"
  DEVICE="cpu"
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"  # DeepSpeed's choice anyway, without its warning per process
fi
is_uint "$NPROC" && (( NPROC >= 1 )) || die "processes per node=$NPROC: must be a whole number >= 1"

PROGRAM="${SFT_PROGRAM:-$ROOT/finetune.py}"
ARGS=(--model_name_or_path "$MODEL" --data_path "$DATA" "${PREC[@]}" "${PASS[@]}")
echo "launch: node rank $NODE_RANK of $NNODES nodes, $NPROC process(es) per node, world size $((NNODES * NPROC)), device $DEVICE, master $MASTER_ADDR:$MASTER_PORT" >&2

# No cd: relative paths in the flags are relative to the caller's working directory.
if (( NNODES == 1 && NPROC == 1 )); then
  exec "$PYTHON" "$PROGRAM" "${ARGS[@]}"
fi
# Several processes: check flags and data once, in one process, so a mistake is reported once and
# cleanly instead of by every rank and then by torchrun.
SFT_CHECK_ONLY=1 "$PYTHON" "$PROGRAM" "${ARGS[@]}" || exit $?

# Preemption (README "Resume and preemption"): SIGTERM/SIGINT to this script is passed to torchrun, whose
# agent passes it to every worker and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds before SIGKILL (torch's
# default, 30 s, is raised here to cover --preemption_timeout). torchrun itself then fails with its own
# code, so the workers report theirs in SFT_EXIT_CODE_FILE and this script exits 75 when any rank was
# preempted (also when the signal reached only the workers, e.g. SLURM signalling every process).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-360}"
SFT_EXIT_CODE_FILE="$(mktemp "${TMPDIR:-/tmp}/sft-exit.XXXXXX")"
export SFT_EXIT_CODE_FILE
trap 'rm -f "$SFT_EXIT_CODE_FILE"' EXIT
"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$PROGRAM" "${ARGS[@]}" &
CHILD=$!
SIGNALLED=""
forward() { if [[ -z "$SIGNALLED" ]]; then SIGNALLED="$1"; kill -s "$1" "$CHILD" 2>/dev/null || true; fi; }
trap 'forward TERM' TERM
trap 'forward INT' INT
while :; do
  rc=0; wait "$CHILD" || rc=$?
  # a trapped signal interrupts wait (rc > 128) while torchrun still runs: wait again for its real exit
  if (( rc > 128 )) && kill -0 "$CHILD" 2>/dev/null; then continue; fi
  break
done
if (( rc != 0 )) && { [[ -n "$SIGNALLED" ]] || grep -qx 75 "$SFT_EXIT_CODE_FILE"; }; then
  echo "launch: preempted; the checkpoint is in --output_dir; run the same command again to resume (exit 75)" >&2
  exit 75
fi
exit "$rc"
