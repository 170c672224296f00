# Shell helpers shared by the launch scripts (sourced; it only defines functions): sft_python (the interpreter
# choice of finetune/launch.sh, finetune/finetune_ray.sh and, for an elastic job, scripts/slurm_train.sh and
# scripts/pbs_train.sh), wait_child (the wait after a trapped signal: launch.sh, slurm_train.sh and its task on
# every node), find_preset and job_nnodes (the two scheduler scripts).
#
# Why this place: every script that sources it knows the repository root first and finds this file from the
# root, never as a sibling of its own path. finetune/launch.sh and finetune/finetune_ray.sh run in place (the
# presets exec launch.sh by its path), so the root is their folder's parent. sbatch runs a copy of
# slurm_train.sh from slurmd's spool folder, and PBS also runs a stored copy of the job script, so those two
# look for the root by content first (SFT_ROOT, their folder's parent, the submit folder, the working folder:
# the first that holds finetune/launch.sh) and then source ROOT/scripts/lib/common.sh. Not in finetune/: the
# scheduler scripts list that folder's *.sh as the presets to choose from. slurm_train.sh's task on each node
# (bash -c through srun) gets wait_child's text with `declare -f` instead of reading this file there.
# shellcheck shell=bash

# sft_python ROOT: print the interpreter that runs the sft package: $PYTHON when set and not empty, else
# ROOT's .venv/bin/python when it is there (scripts/setup_env.sh makes it), else python3 from PATH.
sft_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"
  elif [[ -x "$1/.venv/bin/python" ]]; then echo "$1/.venv/bin/python"
  else echo python3
  fi
}

# wait_child PID: wait for the background child PID and return its exit code. The trap handlers of the
# caller set TRAPPED=1: a trapped signal interrupts bash's wait (it returns 128 + the signal), and the child
# is then waited for again, for its own code (bash keeps a child's code until it is waited for, also when the
# child has already exited). A code above 128 with no trap in between is the child's own.
wait_child() {
  local rc
  while :; do
    TRAPPED=""; rc=0; wait "$1" || rc=$?
    if (( rc > 128 )) && [[ -n "$TRAPPED" ]]; then continue; fi
    return "$rc"
  done
}

# find_preset NAME_OR_PATH: set PRESET to the preset's file: a name of ROOT/finetune/ (e.g.
# finetune_lora_single_gpu.sh) or a path; the caller's die (exit 2) names the presets when there is none.
find_preset() {
  PRESET="$1"
  if [[ "$PRESET" != */* && -f "$ROOT/finetune/$PRESET" ]]; then PRESET="$ROOT/finetune/$PRESET"; fi
  [[ -f "$PRESET" ]] || die "preset $PRESET: no such file; give one of: $(cd "$ROOT/finetune" && ls ./*.sh | tr '\n' ' ')"
}

# job_nnodes ALLOCATED SOURCE: set NNODES and ELASTIC for a scheduler's job of ALLOCATED nodes: NNODES the
# node count and ELASTIC empty, or, for an elastic job (MIN_NODES set, or NNODES=MIN:count), NNODES=MIN:count
# as sft.distributed validates it (SOURCE: where ALLOCATED came from, for its messages; its exit code ends
# the script on a problem) and ELASTIC=1.
job_nnodes() {
  ELASTIC=""
  if [[ -n "${MIN_NODES:-}" || "${NNODES:-}" == *:* ]]; then
    NNODES="$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$(sft_python "$ROOT")" -m sft.distributed nodes \
              --allocated "$1" --source "$2")" || exit $?
    ELASTIC=1
  else
    NNODES="$1"
  fi
}
