#!/usr/bin/env python
"""Print a model folder's greedy reply to one user message (rendered with its chat template).

Usage: python scripts/generate.py MODEL_DIR "your message" [--max_new_tokens 48]   (= sft-generate)
"""
import os
import sys

# this checkout's sft, as finetune.py (next to it) gets: the scripts work without installing the package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sft.cli import generate_main  # noqa: E402  (stdlib only; a missing dependency is reported by the CLI policy)

if __name__ == "__main__":
    sys.exit(generate_main())
