#!/usr/bin/env python
"""Merge a LoRA adapter into its base model; the result loads offline with plain from_pretrained.

Usage: python scripts/merge_adapter.py ADAPTER_DIR OUT_DIR [--base BASE_DIR] [--overwrite]   (= sft-merge)
"""
from _entry import run

if __name__ == "__main__":
    run("sft.cli", "merge_main", "sft-merge")
