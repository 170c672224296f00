#!/usr/bin/env python
"""The same samples in each batch layout: forward + backward time of one model (a benchmark, not a test).

    .venv/bin/python bench/layouts.py                          # built-in example: SmolLM2 + chitchat, LoRA r 16
    .venv/bin/python bench/layouts.py --samples 16 --max_length 2048 --rounds 2

Draws ``--samples`` training samples at random (seed 0) from ``--data`` (truncated at ``--max_length``), and
runs forward + backward (LoRA gradients, no optimizer step) over all of them in every layout, in one process,
the layouts interleaved round by round so that a change in the machine's load touches them alike:

* ``padded``            -- micro batches of ``--batch`` samples padded to the longest (multiple of 8), a mask;
  ``--padding_free False``;
* ``padding-free``      -- the same micro batches, samples end to end in one ``[1, tokens]`` row, attention per
  sample without a mask (:mod:`sft.model.attention`); the default;
* ``grouped``           -- micro batches of samples of similar length (sorted), padded: what
  ``--group_by_length True --padding_free False`` approaches;
* ``packed-rows``       -- ``--packing True``: the samples packed into rows of ``--max_length`` (best-fit
  decreasing), micro batches of ``--rows`` rows, one row per packed row, attention per sample without a mask;
* ``packed-flat-mask``  -- the packing path before :mod:`sft.model.attention`: the same rows flattened into one row
  per micro batch, plain ``sdpa`` with the block-diagonal mask transformers builds from the position ids.

Prints, per layout, real (non-pad) tokens/s over the timed rounds (after one untimed micro batch with each
attention implementation), the positions computed per real token, and the machine's load (``uptime``) before
and after.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import time

import sft  # noqa: F401  (first: holds library import notices, see sft.logs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, ".cache", "example")


LAYOUTS = ("padded", "padding-free", "grouped", "packed-rows", "packed-flat-mask")


def layouts(samples, batch: int, rows: int, max_len: int, tok):
    """``{name: (attention implementation, [batch dicts])}`` over the same samples."""
    from transformers import DataCollatorWithFlattening

    from sft.data.batches.packing import PackedCollator, PaddingFreeCollator, pack_dataset, split_row
    from sft.data.store.dataset import make_collator
    from sft.model.attention import PACKED_ATTENTION

    pad, free = make_collator(tok), PaddingFreeCollator()
    micro = [samples[i:i + batch] for i in range(0, len(samples), batch)]
    by_len = sorted(samples, key=lambda s: len(s["input_ids"]))
    grouped = [by_len[i:i + batch] for i in range(0, len(by_len), batch)]
    packed = list(pack_dataset(samples, max_len)[0])
    packed_micro = [packed[i:i + rows] for i in range(0, len(packed), rows)]
    flat = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    return {
        "padded": ("sdpa", [pad(m) for m in micro]),
        "padding-free": (PACKED_ATTENTION, [free(m) for m in micro]),
        "grouped": ("sdpa", [pad(m) for m in grouped]),
        "packed-rows": (PACKED_ATTENTION, [PackedCollator(tok.pad_token_id)(m) for m in packed_micro]),
        "packed-flat-mask": ("sdpa", [flat([c for r in m for c in split_row(r)], return_tensors="pt")
                                      for m in packed_micro]),
    }


def real_tokens(b, pad_id: int) -> int:
    from sft.train.metrics import packed_padding

    if "attention_mask" in b:
        return int(b["attention_mask"].sum())
    return int(b["input_ids"].numel() - packed_padding(b["input_ids"], b["position_ids"], pad_id))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(EXAMPLE, "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="samples per micro batch (padded, padding-free, grouped)")
    p.add_argument("--rows", type=int, default=3, help="packed rows per micro batch")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="timed passes over the samples per layout (after one "
                   "untimed micro batch with each attention implementation)")
    p.add_argument("--bf16", action="store_true", help="forward under bf16 autocast (as --bf16 True trains), not fp32")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="the layouts to time")
    p.add_argument("--per_batch", action="store_true", help="also print every micro batch's tokens and seconds "
                   "(per layout, the last round): how a micro batch's cost per token follows its size")
    a = p.parse_args(argv)
    import torch

    from sft.data.records.records import load_conversations
    from sft.data.template.chat import IGNORE_INDEX, encode_conversations
    from sft.model.attention import register
    from sft.model.loading import apply_lora, load_model, load_tokenizer
    from sft.model.spec import LoadSpec, LoraSpec

    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    tok, eot, grew = load_tokenizer(a.model)
    convs = load_conversations(a.data, "error")
    random.Random(0).shuffle(convs)
    samples = []
    for ids, labels in encode_conversations(tok, [c.messages for c in convs[:4 * a.samples]], eot):
        if any(x != IGNORE_INDEX for x in labels[:a.max_length]):
            samples.append({"input_ids": ids[:a.max_length], "labels": labels[:a.max_length]})
        if len(samples) == a.samples:
            break
    model, _ = load_model(a.model, tok, grew, LoadSpec(dtype=torch.float32))
    lora = LoraSpec(r=a.lora_r, alpha=2 * a.lora_r, dropout=0.0, train_embeddings="false")
    model = apply_lora(model, tok, grew, lora).train()
    register()
    base = model.get_base_model()
    plan = {k: v for k, v in layouts(samples, a.batch, a.rows, a.max_length, tok).items() if k in a.layouts}
    n_real = sum(len(s["input_ids"]) for s in samples)
    for name, (_, batches) in plan.items():
        # every layout carries the same tokens
        assert sum(real_tokens(b, tok.pad_token_id) for b in batches) == n_real, name
    print(f"{len(samples)} samples, {n_real} tokens (mean {n_real / len(samples):.0f}), length {a.max_length}, "
          f"LoRA r {a.lora_r}, {'bf16 autocast' if a.bf16 else 'fp32'}, {torch.get_num_threads()} threads", flush=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16)
    warm = {impl: batches[0] for impl, batches in reversed(plan.values())}
    for impl, b in warm.items():  # warm-up of every attention implementation used, not timed
        base.set_attn_implementation(impl)
        with autocast:
            loss = model(**b).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    seconds, last = {name: 0.0 for name in plan}, {}
    for rnd in range(a.rounds):
        order = list(plan)[rnd % len(plan):] + list(plan)[:rnd % len(plan)]
        for name in order:
            impl, batches = plan[name]
            base.set_attn_implementation(impl)
            t0, last[name] = time.perf_counter(), []
            for b in batches:
                t1 = time.perf_counter()
                with autocast:
                    loss = model(**b).loss
                loss.backward()
                last[name].append((real_tokens(b, tok.pad_token_id), time.perf_counter() - t1))
            model.zero_grad(set_to_none=True)
            seconds[name] += time.perf_counter() - t0
            print(f"  round {rnd + 1} {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    timed = a.rounds
    for name, runs in last.items() if a.per_batch else ():
        print(f"  {name}, last round, per micro batch (real tokens: seconds, ms per token): "
              + "; ".join(f"{n}: {s:.2f} s, {1e3 * s / n:.2f}" for n, s in runs))
    print(f"\n{'layout':<18}{'micro batches':>14}{'positions / real token':>24}{'real tokens/s':>15}{'vs padded':>11}")
    for name, (_, batches) in plan.items():
        rate = timed * n_real / seconds[name] if seconds[name] else float("nan")
        base_rate = timed * n_real / seconds["padded"] if seconds.get("padded") else float("nan")
        positions = sum(b["input_ids"].numel() for b in batches) / n_real
        print(f"{name:<18}{len(batches):>14}{positions:>24.3f}{rate:>15.1f}{rate / base_rate:>10.2f}x")
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
