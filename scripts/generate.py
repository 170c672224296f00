#!/usr/bin/env python
"""Print a model folder's greedy reply to one user message (rendered with its chat template).

Usage: python scripts/generate.py MODEL_DIR "your message" [--max_new_tokens 48]   (= sft-generate)
"""

import sys

try:
    from sft.cli import generate_main
except ModuleNotFoundError as e:  # a Python without the installed package (no sys.path edits: install it)
    if e.name != "sft":
        raise
    print(f"error: this Python ({sys.executable}) has no package 'sft'; run `bash scripts/setup_env.sh` in the "
          "repository once and use .venv/bin/python (or .venv/bin/sft-generate), or: pip install -e REPOSITORY", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(generate_main())
