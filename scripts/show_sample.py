#!/usr/bin/env python
"""Print one rendered training sample with its supervised tokens marked «like this».

Usage: python scripts/show_sample.py MODEL_DIR DATA_FILE [--index 0] [--model_max_length N] [--system_message S] \
  (= sft-show-sample)
"""
from _entry import run

if __name__ == "__main__":
    run("sft.cli", "show_sample_main", "sft-show-sample")
