#!/usr/bin/env python
"""Hybrid models on this CPU: the per-document path of padding-free rows against the padded run on the same documents
(issue 51's CPU cost target: at most 1.3x the padded time), side by side in one run (a benchmark, not a test).

    .venv/bin/python bench/hybrid.py                          # qwen3_5_text, lfm2, bamba, jamba at width 256
    .venv/bin/python bench/hybrid.py --families lfm2 --steps 3 --docs 4

Per family, one random fp32 model of transformers' own config (``tests/helpers/families.py``'s layer pattern, widened
to ``--hidden``: every width of the family scaled with it) in two copies with the same weights:

* ``padded``   -- what ``--padding_free False`` runs: the documents as ``[docs, longest]`` rows with an
  ``attention_mask``, transformers' SDPA, the token mixers batched (transformers masks the padding itself);
* ``per-doc``  -- what padding-free rows run: the documents back to back in one ``[1, sum of lengths]`` row with
  restarting ``position_ids``, attention per document (:func:`sft.model.attention.use_packed_attention`) and every
  layer that carries a state run once per document (:func:`sft.model.token_mixers.keep_documents_apart`).

Both see the same documents (``--docs`` lengths drawn once, seeded, between 1 and ``--max_len`` tokens; labels the
inputs), and run a forward and backward of the mean token loss per step; steps alternate between the arms (one
warm-up each), so that the load of a shared machine falls on both alike. Prints the median step time of each arm and
their ratio per family, and what the target (``--target``, 1.3) says.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("qwen3_5_text", "lfm2", "bamba", "jamba")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--hidden", type=int, default=256, help="hidden size (a multiple of 64)")
    p.add_argument("--docs", type=int, default=8, help="documents per step")
    p.add_argument("--max_len", type=int, default=1024, help="longest document (tokens)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per arm (after one warm-up)")
    p.add_argument("--target", type=float, default=1.3, help="the per-doc / padded ratio the issue allows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="then one step of each arm under torch.profiler: the "
                   "operators with the most CPU time (self), to say where a ratio comes from")
    a = p.parse_args(argv)
    if a.hidden % 64 or a.docs < 1 or a.max_len < 2 or a.steps < 1:
        p.error("--hidden must be a multiple of 64, --docs and --steps >= 1, --max_len >= 2")
    return a


def widths(family: str, h: int) -> dict:
    """The overrides that widen ``family``'s tiny shape to hidden size ``h`` (heads of 32 dimensions)."""
    common = dict(hidden_size=h, intermediate_size=2 * h, num_attention_heads=h // 32, num_key_value_heads=2,
                  head_dim=32)
    extra = {"qwen3_5_text": dict(linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=h // 64,
                                  linear_num_value_heads=h // 32),
             "lfm2": dict(),
             "bamba": dict(mamba_n_heads=h // 32, mamba_d_head=64, mamba_d_state=16, mamba_chunk_size=64),
             "jamba": dict(mamba_d_state=16, mamba_dt_rank=h // 16)}[family]
    return {**common, **extra}


def build(family: str, a):
    """``(padded, per_doc)``: the family's model twice, the same weights; per_doc switched to the per-document path.
    Also the mixer kinds and whether attention was switched."""
    import torch

    from sft.model.attention import use_packed_attention
    from sft.model.token_mixers import keep_documents_apart
    from tests.helpers.families import tiny_model

    padded = tiny_model(family, seed=a.seed, vocab_size=1024, **widths(family, a.hidden))
    padded.config.use_cache = False
    per_doc = copy.deepcopy(padded)
    switched = use_packed_attention(per_doc)
    kinds = keep_documents_apart(per_doc)
    for m in (padded, per_doc):
        m.train()
    torch.manual_seed(a.seed)
    return padded, per_doc, kinds, switched


def batches(a):
    """``(padded kwargs, per-doc kwargs, lengths)`` of the same ``--docs`` documents."""
    import torch

    g = torch.Generator().manual_seed(a.seed)
    lengths = [int(x) for x in torch.randint(1, a.max_len + 1, (a.docs,), generator=g)]
    lengths[0] = a.max_len  # the longest document is there: the padded rows are as long as it
    docs = [torch.randint(0, 1024, (n,), generator=g) for n in lengths]
    longest = max(lengths)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)], labels[i, :len(d)] = d, 1, d
    row = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    row_labels = torch.cat([torch.cat([d[:1].new_full((1,), -100), d[1:]]) for d in docs])[None]
    # labels shift inside the model: the first token of each document is never a target of the one before
    return (dict(input_ids=ids, attention_mask=mask, labels=labels),
            dict(input_ids=row, position_ids=pos, labels=row_labels), lengths)


def step(model, kwargs) -> float:
    t = time.perf_counter()
    model(**kwargs).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def profile(model, kwargs, top: int = 8) -> str:
    """One step of ``model`` under ``torch.profiler``: the ``top`` operators by self CPU time, on one line."""
    from torch.profiler import ProfilerActivity, profile as run

    with run(activities=[ProfilerActivity.CPU]) as prof:
        step(model, kwargs)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    return f"    {total:.2f} s in operators; " + "; ".join(
        f"{e.key} {e.self_cpu_time_total / 1e6:.2f} s x{e.count}" for e in rows)


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    padded_kw, row_kw, lengths = batches(a)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {a.docs} documents of {lengths} tokens "
          f"({sum(lengths)} real, {a.docs * max(lengths)} padded); width {a.hidden}; median of {a.steps} alternated "
          "forward+backward steps, fp32", flush=True)
    print(f"{'family':<14}{'layers carrying a state':<34}{'padded s':>10}{'per-doc s':>11}{'ratio':>8}  target")
    missed = 0
    for family in a.families:
        padded, per_doc, kinds, switched = build(family, a)
        arms = {"padded": (padded, padded_kw), "per-doc": (per_doc, row_kw)}
        times = {k: [] for k in arms}
        for name, (m, kw) in arms.items():
            step(m, kw)  # warm-up
        for _ in range(a.steps):
            for name, (m, kw) in arms.items():
                times[name].append(step(m, kw))
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["per-doc"] / med["padded"]
        ok = ratio <= a.target
        missed += not ok
        note = "" if switched else " (attention not switched: per-document by mask)"
        print(f"{family:<14}{', '.join(kinds) or 'none':<34}{med['padded']:>10.3f}{med['per-doc']:>11.3f}"
              f"{ratio:>7.2f}x  {'met' if ok else 'MISSED'} (<= {a.target}x){note}", flush=True)
        if a.profile:
            for name, (m, kw) in arms.items():
                print(f"  {name}:\n{profile(m, kw)}", flush=True)
        del padded, per_doc
    return 1 if missed else 0


if __name__ == "__main__":
    if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # the repository's packages (sft, tests.helpers)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONPATH": ROOT})
    sys.exit(main())
