#!/usr/bin/env python
"""Merge a LoRA adapter into its base model; the result loads offline with plain from_pretrained.

Usage: python scripts/merge_adapter.py ADAPTER_DIR OUT_DIR [--base BASE_DIR] [--overwrite]   (= sft-merge)
"""
import os
import sys

# this checkout's sft, as finetune.py (next to it) gets: the scripts work without installing the package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sft.cli import merge_main  # noqa: E402  (stdlib only; a missing dependency is reported by the CLI policy)

if __name__ == "__main__":
    sys.exit(merge_main())
