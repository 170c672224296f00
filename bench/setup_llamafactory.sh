#!/usr/bin/env bash
# Create (or update) .venv-llamafactory: LLaMA-Factory 0.9.5 from PyPI in its own virtual environment, for
# bench/compare.py's `llamafactory` system (a peer to compare with; never imported by sft).
#   bash bench/setup_llamafactory.sh          (PYTHON=python3.11 to pick the interpreter)
# Why each step (measured on the CPU project machine):
#  - torch is pinned to requirements.txt's 2.13.0 through a constraints file: otherwise pip swaps in a CUDA
#    torch to satisfy torchvision's pin;
#  - torchvision is removed: its compiled op fails to import against that torch, and LLaMA-Factory imports
#    it only for vision models when it is there;
#  - torchaudio stays (LLaMA-Factory imports it unconditionally), without its compiled libraries: the wheel
#    pip finds for torch 2.13 (2.11.x) is built against another torch and fails to load (`libc10.so: cannot
#    open shared object file`); without them torchaudio imports as pure Python (`_load_lib` finds no file),
#    and text training never calls its compiled ops.
# Idempotent: does nothing when this script and requirements.txt are unchanged since the last run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-llamafactory"
STAMP="$VENV/.sft-llamafactory.sha256"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,12p' "$0"
  exit 0
fi
if [[ $# -gt 0 ]]; then
  echo "usage: bash bench/setup_llamafactory.sh   (takes no arguments; got: $*)" >&2
  exit 2
fi
want="$(cat "$0" "$ROOT/requirements.txt" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
echo "setup: installing llamafactory==0.9.5 into $VENV (first time: several minutes)" >&2
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
grep -E '^torch==' "$ROOT/requirements.txt" > "$constraints"
pip_install() {
  "$VENV/bin/python" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install --upgrade pip
pip_install -c "$constraints" "$(grep -E '^torch==' "$ROOT/requirements.txt")" "llamafactory==0.9.5"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision 2>/dev/null || true
audio_lib="$("$VENV/bin/python" -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('torchaudio').origin), 'lib'))")"
rm -f "$audio_lib"/*.so
"$VENV/bin/python" -c "import torch, torchaudio, llamafactory.train.tuner, llamafactory; print('llamafactory', llamafactory.__version__, 'torch', torch.__version__)"
echo "$want" > "$STAMP"
