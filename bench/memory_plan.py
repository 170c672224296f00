#!/usr/bin/env python
"""The memory plan against the measured peak, side by side (a benchmark, not a test).

    .venv/bin/python bench/memory_plan.py                      # the example's model and data, three runs
    .venv/bin/python bench/memory_plan.py --data big.jsonl --runs defaults --max_steps 20

Each run is ``sft-train`` in its own process on ``--model`` / ``--data`` (the built-in example by default) with
``sft-train``'s defaults (full fine-tuning, micro batch 8, ``--model_max_length`` 8192, padding-free, the token
budget, the memory plan) plus the run's flags (:data:`RUNS`), for ``--max_steps`` optimizer steps. It reads two lines
from the run's log: the plan (``memory plan: ... = P GiB planned peak of A GiB ...``, logged before step 1) and the
measured peaks (``memory: peak RSS L GiB loading, T GiB training`` on CPU, ``cuda max allocated`` on a GPU, logged at
the end), and prints them side by side with the run's exit code and wall time. A run refused by the plan (exit 2)
shows its refusal instead.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, ".cache", "example")
RUNS = {  # name -> extra sft-train flags
    "defaults": [],
    "checkpointing": ["--gradient_checkpointing", "True"],
    "lora": ["--use_lora", "True", "--lora_r", "16", "--lora_alpha", "32"],
}
PLAN = re.compile(r"memory plan: (.*) = ([\d.]+) GiB planned peak of ([\d.]+) GiB")
PEAKS = re.compile(r"memory: (peak RSS|cuda max allocated) ([\d.]+) GiB loading, ([\d.]+) GiB (training|in all)")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(EXAMPLE, "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--max_steps", type=int, default=3, help="optimizer steps per run (step 1 holds the largest micro "
                   "batch, step 2 is the first with optimizer state)")
    p.add_argument("--flags", default="", help="more sft-train flags for every run (one string)")
    a = p.parse_args(argv)
    if a.max_steps < 1:
        p.error("--max_steps must be at least 1")
    return a


def read_log(text: str) -> dict:
    """The planned and measured figures (GiB) of one run's log; missing ones are None."""
    plan, peaks = PLAN.search(text), PEAKS.search(text)
    refusal = next((ln.strip() for ln in text.splitlines() if "does not fit in memory" in ln), None)
    return {"parts": plan.group(1) if plan else None, "planned": float(plan.group(2)) if plan else None,
            "available": float(plan.group(3)) if plan else None, "load": float(peaks.group(2)) if peaks else None,
            "training": float(peaks.group(3)) if peaks else None, "refusal": refusal,
            "checkpointing": "gradient checkpointing on" in text}


def main(argv=None) -> int:
    a = parse(argv)
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


if __name__ == "__main__":
    sys.exit(main())
