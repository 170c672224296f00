#!/usr/bin/env python
"""Cost per token of one forward + backward against the tokens in its row (a benchmark, not a test).

    .venv/bin/python bench/row_size.py --bf16                     # documents of 512 tokens, rows of 1..12 of them
    .venv/bin/python bench/row_size.py --doc_length 256 --docs 1 2 4 8 16

Builds padding-free rows (``[1, tokens]``, position ids restarting per document, attention per document without a
mask: :mod:`sft.model.attention`, as the default collator and ``--packing`` give) of ``--docs`` documents each, every
document ``--doc_length`` tokens of real chitchat text, so attention per token is the same in every row and any
change in the cost per token comes from the row's size alone (cache and memory traffic). Times forward + backward of
the example's model with LoRA (no optimizer step), ``--rounds`` times per row size, interleaved, after one untimed
pass per size, and prints per size the tokens, the median seconds and milliseconds per token, and the ratio to the
smallest row.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import sft  # noqa: F401  (first: holds library import notices, see sft.logs)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "example")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(EXAMPLE, "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--doc_length", type=int, default=512, help="tokens per document")
    p.add_argument("--docs", type=int, nargs="+", default=[1, 2, 4, 8, 12], help="documents per row, one size each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--bf16", action="store_true", help="forward under bf16 autocast (as --bf16 True trains)")
    p.add_argument("--shape", choices=("row", "rows"), default="row", help="row: the documents end to end in one "
                   "[1, tokens] row (padding-free); rows: one document per row, [documents, doc_length] (the same "
                   "tokens and attention as a 2-D batch)")
    a = p.parse_args(argv)
    if a.doc_length < 2 or min(a.docs) < 1 or a.rounds < 1:
        p.error("--doc_length must be at least 2, --docs and --rounds at least 1")
    import torch

    from sft.data.batches.packing import PackedCollator, PaddingFreeCollator
    from sft.data.records.records import load_conversations
    from sft.data.template.chat import encode_conversations
    from sft.model.attention import PACKED_ATTENTION, register
    from sft.model.loading import apply_lora, load_model, load_tokenizer
    from sft.model.spec import LoadSpec, LoraSpec

    tok, eot, grew = load_tokenizer(a.model)
    convs = load_conversations(a.data, "error")
    text = [ids for ids, _ in encode_conversations(tok, [c.messages for c in convs[:400]], eot)]
    stream = [t for ids in text for t in ids]
    need = max(a.docs) * a.doc_length
    if len(stream) < need:
        p.error(f"--data has {len(stream)} tokens in its first 400 conversations; {need} needed")
    docs = [stream[i * a.doc_length:(i + 1) * a.doc_length] for i in range(max(a.docs))]
    collate = PaddingFreeCollator() if a.shape == "row" else PackedCollator(tok.pad_token_id)
    rows = {n: collate([{"input_ids": d, "labels": d, "position_ids": list(range(len(d)))} for d in docs[:n]])
            for n in a.docs}
    model, _ = load_model(a.model, tok, grew, LoadSpec(dtype=torch.float32))
    lora = LoraSpec(r=a.lora_r, alpha=2 * a.lora_r, dropout=0.0, train_embeddings="false")
    model = apply_lora(model, tok, grew, lora).train()
    register()
    model.get_base_model().set_attn_implementation(PACKED_ATTENTION)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16)

    def step(b) -> float:
        t0 = time.perf_counter()
        with autocast:
            loss = model(**b).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    print(f"documents of {a.doc_length} tokens ({'one [1, tokens] row' if a.shape == 'row' else 'one row each'}), "
          f"LoRA r {a.lora_r}, {'bf16 autocast' if a.bf16 else 'fp32'}, "
          f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}", flush=True)
    for b in rows.values():
        step(b)  # untimed
    seconds = {n: [] for n in rows}
    for _ in range(a.rounds):
        for n, b in rows.items():
            seconds[n].append(step(b))
    base = None
    print(f"{'documents':>10}{'tokens':>8}{'median s':>10}{'ms / token':>12}{'vs smallest':>13}  rounds (s)")
    for n, runs in seconds.items():
        per = 1e3 * statistics.median(runs) / (n * a.doc_length)
        base = base or per
        print(f"{n:>10}{n * a.doc_length:>8}{statistics.median(runs):>10.2f}{per:>12.3f}{per / base:>12.2f}x  "
              + ", ".join(f"{s:.2f}" for s in runs))
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
