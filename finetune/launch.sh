#!/usr/bin/env bash
# Shared launcher behind every preset in this folder: strict mode, the node/process environment,
# then finetune.py (directly for one process, through torchrun otherwise).
#
# Usage: finetune/launch.sh -m MODEL_DIR -d DATA_FILE [finetune.py flags ...]
#
# Environment (all optional):
#   NNODES (1)  NODE_RANK (0)  MASTER_ADDR (localhost)  MASTER_PORT (6001)
#   GPUS_PER_NODE  processes per node on a GPU machine (default: every visible GPU)
#   NPROC_PER_NODE processes per node on a machine without GPUs (default 1)
#   PYTHON       interpreter (default: the repository's .venv if present, else python3)
#   SFT_PROGRAM  Python file run in each process (default: finetune.py next to this folder; the tests
#                use a worker that also reports what each rank computed)
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
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6001}"
is_uint "$NNODES" && (( NNODES >= 1 )) || die "NNODES=$NNODES: must be a whole number >= 1"
is_uint "$NODE_RANK" && (( NODE_RANK < NNODES )) || die "NODE_RANK=$NODE_RANK: must be in [0, NNODES=$NNODES)"
is_uint "$MASTER_PORT" && (( MASTER_PORT >= 1 && MASTER_PORT <= 65535 )) || die "MASTER_PORT=$MASTER_PORT: must be in 1-65535"

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
exec "$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$PROGRAM" "${ARGS[@]}"
