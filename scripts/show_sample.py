#!/usr/bin/env python
"""Print one rendered training sample with its supervised tokens marked «like this».

Usage: python scripts/show_sample.py MODEL_DIR DATA_FILE [--index 0] [--model_max_length N] [--system_message S]   (= sft-show-sample)
"""
import os
import sys

# this checkout's sft, as finetune.py (next to it) gets: the scripts work without installing the package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sft.cli import show_sample_main  # noqa: E402  (stdlib only; a missing dependency is reported by the CLI policy)

if __name__ == "__main__":
    sys.exit(show_sample_main())
