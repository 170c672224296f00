#!/usr/bin/env python
"""Print a model folder's greedy reply to one user message (rendered with its chat template).

Usage: python scripts/generate.py MODEL_DIR "your message" [--max_new_tokens 48]   (= sft-generate)
"""
from _entry import run

if __name__ == "__main__":
    run("sft.cli", "generate_main", "sft-generate")
