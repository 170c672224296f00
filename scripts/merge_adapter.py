#!/usr/bin/env python
"""Merge a LoRA adapter into its base model; the result loads offline with plain from_pretrained.

Usage: python scripts/merge_adapter.py ADAPTER_DIR OUT_DIR [--base BASE_DIR] [--overwrite]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from sft.errors import SFTError
    from sft.export import merge_adapter

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("adapter_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--base", default=None, help="base model folder (default: from adapter_config.json)")
    ap.add_argument("--overwrite", action="store_true", help="allow a non-empty OUT_DIR")
    a = ap.parse_args()
    try:
        out = merge_adapter(a.adapter_dir, a.out_dir, a.base, a.overwrite)
    except SFTError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"merged model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
