#!/usr/bin/env python
"""Print a model folder's greedy reply to one user message (rendered with its chat template).

Usage: python scripts/generate.py MODEL_DIR "your message" [--max_new_tokens 48]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from sft.errors import SFTError
    from sft.export import generate_reply

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("prompt")
    ap.add_argument("--max_new_tokens", type=int, default=48)
    a = ap.parse_args()
    if a.max_new_tokens < 1:
        print(f"error: --max_new_tokens {a.max_new_tokens}: must be at least 1", file=sys.stderr)
        return 2
    if not os.path.isdir(a.model_dir):
        print(f"error: {a.model_dir}: no such folder; give a model folder", file=sys.stderr)
        return 2
    try:
        print(generate_reply(a.model_dir, a.prompt, a.max_new_tokens))
    except SFTError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
