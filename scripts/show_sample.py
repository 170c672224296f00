#!/usr/bin/env python
"""Print one rendered training sample with its supervised tokens marked «like this».

Usage: python scripts/show_sample.py MODEL_DIR DATA_FILE [--index 0] [--model_max_length N] [--system_message S]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from types import SimpleNamespace

    from sft.chat import visualize
    from sft.data import load_conversations
    from sft.dataset import encode_truncated
    from sft.errors import SFTError
    from sft.modeling import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("data_file")
    ap.add_argument("--index", type=int, default=0, help="0-based index among the valid records")
    ap.add_argument("--model_max_length", type=int, default=8192)
    ap.add_argument("--system_message", default=None)
    a = ap.parse_args()
    try:
        if not os.path.isfile(os.path.join(a.model_dir, "config.json")) and not os.path.isfile(
                os.path.join(a.model_dir, "tokenizer.json")):
            raise SFTError(f"{a.model_dir}: not a model folder (no config.json or tokenizer.json)")
        if a.model_max_length < 8:
            raise SFTError(f"--model_max_length {a.model_max_length}: must be at least 8")
        convs = load_conversations(a.data_file, "skip")
        if not 0 <= a.index < len(convs):
            raise SFTError(f"--index {a.index}: the file has {len(convs)} valid records")
        tok, eot, _ = load_tokenizer(SimpleNamespace(model_name_or_path=a.model_dir, trust_remote_code=False),
                                     SimpleNamespace(cache_dir=None, model_max_length=a.model_max_length))
        c = convs[a.index]
        ex = encode_truncated(tok, c.messages, eot, a.model_max_length, a.system_message)
    except SFTError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"record {c.index} id={c.id}: {len(ex['input_ids'])} tokens, {ex['n_supervised']} supervised"
          + (f", truncated ({ex['n_lost']} supervised tokens lost)" if ex["truncated"] else ""))
    print(visualize(tok, ex["input_ids"], ex["labels"], color=sys.stdout.isatty()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
