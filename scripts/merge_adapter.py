#!/usr/bin/env python
"""Merge a LoRA adapter into its base model; the result loads offline with plain from_pretrained.

Usage: python scripts/merge_adapter.py ADAPTER_DIR OUT_DIR [--base BASE_DIR] [--overwrite]   (= sft-merge)
"""

import sys

try:
    from sft.cli import merge_main
except ModuleNotFoundError as e:  # a Python without the installed package (no sys.path edits: install it)
    if e.name != "sft":
        raise
    print(f"error: this Python ({sys.executable}) has no package 'sft'; run `bash scripts/setup_env.sh` in the "
          "repository once and use .venv/bin/python (or .venv/bin/sft-merge), or: pip install -e REPOSITORY", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(merge_main())
