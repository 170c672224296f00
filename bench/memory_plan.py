#!/usr/bin/env python
"""The memory plan against the measured peak of one training step, side by side (a benchmark, not a test).

    .venv/bin/python bench/memory_plan.py         # full and LoRA, checkpointing off and on at 2k; on at 8k
    .venv/bin/python bench/memory_plan.py --tokens 2048 --tokens_checkpointed 8192 16384
    .venv/bin/python bench/memory_plan.py --sft_train --runs defaults lora   # whole sft-train runs instead
    .venv/bin/python bench/memory_plan.py --family nemotron_h --kinds full --checkpointing off --tokens 4096 8192

Default: one configuration per fresh process (``--worker``), for full fine-tuning and LoRA (``sft-train``'s LoRA
defaults: r 64, alpha 16, dropout 0.05, every linear layer), gradient checkpointing off and on, at each of
``--tokens`` tokens per micro batch (and ``--tokens_checkpointed``, with checkpointing only: without it they need more
memory than a 24 GiB host spares), padding-free (one ``[1, tokens]`` row of documents of ``--doc_length`` random token
ids, position ids restarting per document, :data:`sft.model.attention.PACKED_ATTENTION`, every token supervised: the
plan's LM head assumes so), in the dtype ``--bf16 auto`` chooses on this machine
(:func:`sft.config.precision.auto_bf16`; bf16 weights and autocast as the Trainer's, LoRA adapters fp32). Each process
loads the model as ``sft-train`` does (:func:`sft.model.loading.load_model`, :func:`sft.model.loading.apply_lora`),
plans as ``sft-train`` does before step 1 (:func:`sft.train.memory_plan.held_and_available` after loading, the forward
probe, :func:`sft.train.memory_plan.plan` for ``adamw_torch`` with the LM head at supervised positions), then turns
checkpointing on as the Trainer does (non-reentrant), creates AdamW's state with one step on zero gradients (so the
measured step is like step 2, the first that holds optimizer state next to activations), resets the peak (``VmHWM``,
:func:`sft.train.metrics.reset_peak_memory`) and runs one step: forward with the supervised head
(:func:`sft.model.loss.compute_supervised_loss`), backward, gradient clipping, ``optimizer.step``. *Measured* is
``VmHWM`` after that step: the whole process's peak resident set
over the step, comparable with the plan's peak, whose weights are the resident set after loading. Also printed:
both above that resident set (*after load*), and the ratio planned / measured.

``--family``: a tiny random model of that family (tests/helpers/families.py, vocabulary 128, fp32) instead of
``--model``, full fine-tuning; ``--one_row``: one padded row without position ids (the gated delta rule's reference
path refuses packed rows without flash-linear-attention).

``--sft_train``: the earlier way: whole ``sft-train`` runs (:data:`RUNS`) on ``--model`` / ``--data`` for
``--max_steps`` steps, the ``memory plan:`` line next to the training peak the run logs at the end (``memory: peak RSS
L GiB loading, T GiB training``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import sft  # noqa: F401  (first: holds library import notices, see sft.logs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, ".cache", "example")
RUNS = {  # name -> extra sft-train flags (--sft_train)
    "defaults": [],
    "checkpointing": ["--gradient_checkpointing", "True"],
    "lora": ["--use_lora", "True", "--lora_r", "16", "--lora_alpha", "32"],
}
PLAN = re.compile(r"memory plan: (.*) = ([\d.]+) GiB planned peak of ([\d.]+) GiB")
PEAKS = re.compile(r"memory: (peak RSS|cuda max allocated) ([\d.]+) GiB loading, ([\d.]+) GiB (training|in all)")
GIB = 2 ** 30


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(EXAMPLE, "smollm2-135m-instruct"))
    p.add_argument("--tokens", type=int, nargs="*", default=[2048], help="tokens per micro batch, every "
                   "configuration")
    p.add_argument("--tokens_checkpointed", type=int, nargs="*", default=[8192], help="more token counts, with "
                   "gradient checkpointing only (LoRA at 8,192 tokens without it peaked at 18.4 GiB)")
    p.add_argument("--kinds", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    p.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--doc_length", type=int, default=512, help="tokens per document in the row")
    p.add_argument("--lora_r", type=int, default=64)
    p.add_argument("--lora_alpha", type=int, default=16)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--bf16", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--family", help="a tiny model of this family (tests/helpers/families.py) instead of --model")
    p.add_argument("--one_row", action="store_true", help="one row without position ids (no padding-free documents)")
    p.add_argument("--worker", nargs=3, metavar=("KIND", "CHECKPOINTING", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--sft_train", action="store_true", help="whole sft-train runs (--runs, --data, --max_steps)")
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--max_steps", type=int, default=3, help="--sft_train: optimizer steps per run (step 1 holds the "
                   "largest micro batch, step 2 is the first with optimizer state)")
    p.add_argument("--flags", default="", help="--sft_train: more sft-train flags for every run (one string)")
    a = p.parse_args(argv)
    if a.max_steps < 1 or min(a.tokens + a.tokens_checkpointed, default=0) < 1 or a.doc_length < 2:
        p.error("--max_steps and --tokens must be at least 1, --doc_length at least 2")
    if a.family and a.kinds != ["full"]:
        p.error("--family: full fine-tuning only (--kinds full)")
    return a


def worker(a: argparse.Namespace) -> dict:
    """One configuration in this process (module docstring); returns its figures (bytes, seconds)."""
    import torch

    from sft.config.precision import auto_bf16
    from sft.data.batches.packing import PaddingFreeCollator
    from sft.model.attention import register, use_packed_attention
    from sft.model.loading import apply_lora, load_model, load_tokenizer, torch_dtype
    from sft.model.loss import compute_supervised_loss
    from sft.model.spec import LoadSpec, LoraSpec
    from sft.train.memory_plan import held_and_available, measure_saved_bytes, plan, resident_bytes
    from sft.train.metrics import peak_memory_bytes, reset_peak_memory

    kind, checkpointing, tokens = a.worker[0], a.worker[1] == "on", int(a.worker[2])
    bf16 = auto_bf16(cuda=False)[0] if a.bf16 == "auto" else a.bf16 == "true"
    if a.family:  # a tiny random model, fp32, vocabulary 128
        from tests.helpers.families import tiny_model

        bf16, model, tok = False, tiny_model(a.family, vocab_size=128), list(range(128))
    else:
        tok, _eot, grew = load_tokenizer(a.model)
        model, grew = load_model(a.model, tok, grew, LoadSpec(dtype=torch_dtype(bf16)))
    lora = kind == "lora"
    if lora:
        model = apply_lora(model, tok, grew, LoraSpec(r=a.lora_r, alpha=a.lora_alpha, dropout=a.lora_dropout),
                           activation_checkpointing=checkpointing)
    register()
    use_packed_attention(model)
    model.train()
    held = held_and_available(torch.device("cpu"), model=model)  # as sft-train: before the probe
    loaded = held[0]  # the resident set after loading, weights paged in
    probe = measure_saved_bytes(model)
    planned = plan(model, tokens=tokens, checkpointing=checkpointing, optim="adamw_torch", supervised_head=True,
                   lora_dropout=lora and a.lora_dropout > 0, held_available=held, measured=probe)
    if checkpointing:  # as transformers' Trainer, with sft's kwargs (sft.config.arguments)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(0)
    docs, left = [], tokens
    while left > 0:
        n = min(a.doc_length, left)
        left -= n
        ids = torch.randint(0, len(tok), (n,), generator=g).tolist()
        docs.append({"input_ids": ids, "labels": ids})  # every token supervised, as the plan counts the LM head
    batch = PaddingFreeCollator()(docs)
    if a.one_row:
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:  # AdamW's state now, as after step 1
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    reset_peak_memory()
    before = resident_bytes()
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = compute_supervised_loss(model, batch, head=model.get_output_embeddings())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    return {"kind": kind, "checkpointing": checkpointing, "tokens": tokens, "bf16": bf16, "loaded": loaded,
            "before_step": before, "measured": peak_memory_bytes()[1], "seconds": seconds,
            "probe": list(probe) if probe else None, "planned": planned.peak, "plan": planned.line(),
            "parts": {k: getattr(planned, k) for k in ("weights", "gradients", "optimizer", "activations", "head",
                                                       "per_token")}}


def configurations(a: argparse.Namespace) -> list[tuple[str, str, int]]:
    runs = [(k, c, t) for t in a.tokens for k in a.kinds for c in a.checkpointing]
    runs += [(k, "on", t) for t in a.tokens_checkpointed for k in a.kinds if "on" in a.checkpointing]
    return runs


def steps(a: argparse.Namespace, argv) -> int:
    """Every configuration in a fresh process of this script, then the table."""
    passed = [x for x in (argv if argv is not None else sys.argv[1:])]
    rows = []
    for kind, ckpt, tokens in configurations(a):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *passed, "--worker", kind, ckpt, str(tokens)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
        r = json.loads(line) if p.returncode == 0 and line else None
        rows.append((kind, ckpt, tokens, p.returncode, r))
        print(f"{kind} checkpointing {ckpt} {tokens} tokens: exit {p.returncode} in {time.perf_counter() - t0:.0f} s"
              + (f" (step {r['seconds']:.0f} s): planned {r['planned'] / GIB:.2f}, measured "
                 f"{r['measured'] / GIB:.2f} GiB" if r else f"\n{p.stderr[-2000:]}"), flush=True)
    first = next((r for *_, r in rows if r), None)
    print(f"\n{'run':<22}{'tokens':>7}{'planned':>9}{'measured':>9}{'ratio':>7}  {'after load: planned':>20}"
          f"{'measured':>9}{'ratio':>7}{'KiB/token':>10}")
    for kind, ckpt, tokens, code, r in rows:
        name = f"{kind}, ckpt {ckpt}"
        if r is None:
            print(f"{name:<22}{tokens:>7}  exit {code}")
            continue
        pl, me = r["planned"] / GIB, r["measured"] / GIB
        pa, ma = (r["planned"] - r["loaded"]) / GIB, (r["measured"] - r["loaded"]) / GIB
        print(f"{name:<22}{tokens:>7}{pl:>9.2f}{me:>9.2f}{pl / me:>7.2f}  {pa:>20.2f}{ma:>9.2f}{pa / ma:>7.2f}"
              f"{r['parts']['per_token'] / 1024:>10.0f}")
    if first:
        print(f"(GiB; {'bf16' if first['bf16'] else 'fp32'}; measured: VmHWM over one step after loading, the probe "
              f"and AdamW's state; after load: less each process's resident set after loading, the first's "
              f"{first['loaded'] / GIB:.2f} GiB; "
              f"ratio: planned / measured; KiB/token: the plan's activations per token)")
    return 0 if all(r is not None for *_, r in rows) else 1


def read_log(text: str) -> dict:
    """The planned and measured figures (GiB) of one sft-train run's log; missing ones are None."""
    plan, peaks = PLAN.search(text), PEAKS.search(text)
    refusal = next((ln.strip() for ln in text.splitlines() if "does not fit in memory" in ln), None)
    return {"parts": plan.group(1) if plan else None, "planned": float(plan.group(2)) if plan else None,
            "available": float(plan.group(3)) if plan else None, "load": float(peaks.group(2)) if peaks else None,
            "training": float(peaks.group(3)) if peaks else None, "refusal": refusal,
            "checkpointing": "gradient checkpointing on" in text}


def sft_train_runs(a: argparse.Namespace) -> int:
    sft_train = shutil.which("sft-train") or os.path.join(os.path.dirname(sys.executable), "sft-train")
    rows = []
    for name in a.runs:
        out = tempfile.mkdtemp(prefix=f"sft-memory-{name}-")
        cmd = [sft_train, "--model_name_or_path", a.model, "--data_path", a.data, "--output_dir", out,
               "--max_steps", str(a.max_steps), "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
               *RUNS[name], *a.flags.split()]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        log = p.stdout + p.stderr
        with open(os.path.join(out, "run.log"), "w") as f:
            f.write(log)
        rows.append((name, p.returncode, seconds, read_log(log), out))
        print(f"{name}: exit {p.returncode} in {seconds:.0f} s (log {out}/run.log)", flush=True)
    print(f"\n{'run':<15}{'exit':>5}{'wall':>8}{'planned':>10}{'measured':>10}{'ratio':>7}{'available':>11}  plan")
    for name, code, seconds, r, _ in rows:
        ratio = f"{r['planned'] / r['training']:.2f}" if r["planned"] and r["training"] else "-"
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"{name:<15}{code:>5}{seconds:>7.0f}s{fmt(r['planned']):>10}{fmt(r['training']):>10}{ratio:>7}"
              f"{fmt(r['available']):>11}  {r['parts'] or r['refusal'] or '-'}")
    print("(GiB; measured: the peak of training after loading, as sft-train logs it at the end)")
    return 0 if all(code == 0 for _, code, *_ in rows) else 1


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        print(json.dumps(worker(a)), flush=True)
        return 0
    return sft_train_runs(a) if a.sft_train else steps(a, argv)


if __name__ == "__main__":
    sys.exit(main())
