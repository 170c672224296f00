#!/usr/bin/env python
"""Print one rendered training sample with its supervised tokens marked «like this».

Usage: python scripts/show_sample.py MODEL_DIR DATA_FILE [--index 0] [--model_max_length N] [--system_message S]   (= sft-show-sample)
"""

import sys

try:
    from sft.cli import show_sample_main
except ModuleNotFoundError as e:  # a Python without the installed package (no sys.path edits: install it)
    if e.name != "sft":
        raise
    print(f"error: this Python ({sys.executable}) has no package 'sft'; run `bash scripts/setup_env.sh` in the "
          "repository once and use .venv/bin/python (or .venv/bin/sft-show-sample), or: pip install -e REPOSITORY", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(show_sample_main())
