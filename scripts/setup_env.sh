#!/usr/bin/env bash
# Create (or update) the repository's .venv from requirements.txt, requirements-assets.txt and
# requirements-gptq.txt, and install this repository's package `sft` into it (editable: pip install -e .,
# which also puts the sft-* commands in .venv/bin). Idempotent: does nothing when those files and
# pyproject.toml are unchanged since the last run.
# Usage: bash scripts/setup_env.sh        (PYTHON=python3.11 to pick the interpreter)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.sft-requirements.sha256"
# tcmalloc, which finetune/launch.sh preloads on CPU (sft/distributed/allocator.py: 1.25-1.36x at 2,048 tokens):
# installed from the distribution as root when apt-get is there; otherwise only a hint (never fatal).
have_tcmalloc() {  # the search of sft/distributed/allocator.py itself (stdlib only: any python3 runs it)
  PYTHONPATH="$ROOT" "${PYTHON:-python3}" -c 'import os, sys
from sft.distributed.allocator import find_tcmalloc
sys.exit(find_tcmalloc(os.environ) is None)' 2>/dev/null
}
if [[ "${SFT_ALLOCATOR:-auto}" != glibc ]] && ! have_tcmalloc; then
  if (( EUID == 0 )) && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing tcmalloc (apt-get install libtcmalloc-minimal4)" >&2
    { apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 \
           >/dev/null 2>&1; }; } || echo "setup: apt-get could not install libtcmalloc-minimal4; training uses glibc malloc" >&2
  else
    echo "setup: no tcmalloc on this machine; CPU training is faster with it (Debian/Ubuntu: apt-get install" \
         "libtcmalloc-minimal4; RHEL: dnf install gperftools-libs); SFT_ALLOCATOR=glibc silences this" >&2
  fi
fi
# this script itself counts too: a .venv set up by an earlier version (e.g. without the bytecode step) is redone
want="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-assets.txt" "$ROOT/requirements-gptq.txt" "$ROOT/pyproject.toml" \
  "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
echo "setup: installing requirements into $VENV (first time: a few minutes)" >&2
pip_install() {
  # drop pip's warnings about extra index folders that this machine's global pip config names but lacks;
  # --no-compile: pip would compile each package as it installs it, on one core; compileall below uses all cores
  "$VENV/bin/python" -m pip install --quiet --no-compile "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install --upgrade pip
pip_install -r "$ROOT/requirements.txt"
pip_install --no-deps -r "$ROOT/requirements-assets.txt"
pip_install --no-deps -r "$ROOT/requirements-gptq.txt"   # why without dependencies: see the file
# the package itself; its dependencies are the pinned ones above (--no-deps: no second resolution);
# PYTHONWARNINGS: setuptools' build backend warns about editable installs in general (a banner, not a problem)
PYTHONWARNINGS=ignore pip_install --no-deps -e "$ROOT"
# The bytecode of every installed module, written now on every core: where PYTHONDONTWRITEBYTECODE is set (container
# images often set it; this machine does), Python never writes it at import, and without it every process compiles
# torch, transformers and peft from source again (importing sft.model.export: 20.6 s instead of 9-11 s; docs/testing.md).
# Test folders of the installed packages are left out; a file that does not compile under this Python (torch's
# Python 3.12-only test helper) is skipped, as pip skips it.
echo "setup: compiling the installed packages' bytecode (all cores)" >&2
"$VENV/bin/python" -m compileall -q -j 0 -x '/tests?/|/torch/testing/_internal/' "$VENV"/lib/python3*/site-packages \
  "$ROOT/sft" >/dev/null 2>&1 || true
echo "$want" > "$STAMP"
