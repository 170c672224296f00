#!/usr/bin/env python
"""One long conversation trained with and without sequence parallelism, side by side (a benchmark, not a test).

    .venv/bin/python bench/long_context.py                                  # LoRA and full, N = 1 and 2, 2k-8k
    .venv/bin/python bench/long_context.py --modes lora --lengths 4096 16384 --sizes 1 2

Each cell is one ``finetune.py`` run (the toolkit's own entry point) on SmolLM2-135M-Instruct (the built-in example's
model, ``scripts/prepare_example.py``) and one conversation of at least ``L`` tokens built from chitchat-dataset's
chats, cut to exactly ``--model_max_length L`` (``--long_conversations truncate``): ``--max_steps 2`` optimizer
steps of one micro batch, gradient checkpointing on, ``--memory_check warn`` (the plan is logged, never refuses),
with N processes under torchrun and ``--sequence_parallel_size N`` (N = 1: one process). The machine's cores are
shared: one process gets ``OMP_NUM_THREADS`` = cores, N processes cores / N each.

Printed per cell, from the run's own log lines: the memory plan's peak (rank 0), rank 0's measured peak RSS while
loading and training (``memory: peak RSS A GiB loading, B GiB training``), activations = the training peak minus the
training peak of the same configuration at the shortest length given (the static part: weights, gradients,
optimizer state and buffers do not grow with L), the job's tokens/s at step 2 (rank 0's real tokens/s per device x
N: each rank holds L / N of the row) and the loss at step 1 (equal across N within fp32 rounding when bf16 is off).
Then, per mode, the N = 2 / N = 1 ratio of activations at each length, and the longest conversation that fits
``--budget_gib`` per rank extrapolated linearly from the measured activations per token (stated as extrapolated).

``--memory_limit_gib X`` (root): every rank gets a memory cgroup of its own capped at X GiB (cgroup v1 or v2), as if
each had a device of X GiB, and runs as its own torchrun node on this host (``--nnodes N --nproc_per_node 1``), so the
memory plan reads X as what it may use and the kernel enforces it; the plan refuses (``--memory_check refuse``, the
default, instead of ``warn``) when a rank's plan needs more than 90% of it. That is how a conversation one process
cannot hold is shown to train on two: ``--memory_limit_gib 5 --modes lora --lengths 4096 --sizes 1 2``.
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
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, ".cache", "example", "smollm2-135m-instruct")
MODES = {"lora": ["--use_lora", "True", "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0"],
         "full": ["--use_lora", "False"]}
PEAKS = re.compile(r"memory: peak RSS ([\d.]+) GiB loading, ([\d.]+) GiB training")
PLAN = re.compile(r"memory plan: .* = ([\d.]+) GiB planned peak")
SPEED = re.compile(r"step 2/2: ([\d.]+) real tokens/s per device")
LOSS = re.compile(r"\{'loss': '([\d.]+)'")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 2], help="sequence-parallel sizes N (processes)")
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192], help="conversation tokens")
    p.add_argument("--budget_gib", type=float, default=8.0, help="memory per rank for the extrapolated longest "
                   "conversation")
    p.add_argument("--flags", default="", help="more finetune.py flags for every run (one string)")
    p.add_argument("--keep", action="store_true", help="keep the runs' folders (printed)")
    p.add_argument("--memory_limit_gib", type=float, default=None, help="root: each rank in a memory cgroup of its "
                   "own capped at this many GiB, as its own torchrun node (module docstring)")
    return p.parse_args(argv)


def load_file(*parts: str):
    """The module at ``ROOT/parts...``, loaded by its path (scripts and test helpers are not packages on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.splitext(parts[-1])[0], os.path.join(ROOT, *parts))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def long_conversation(tokens: int) -> dict:
    """One conversation of about ``tokens`` x 1.3 tokens (at ~4 characters per token) of real chats: the chats of
    chitchat-dataset one after another, human / gpt turns alternating."""
    chitchat_records = load_file("scripts", "prepare_example.py").chitchat_records

    turns, chars = [], 0
    for record in chitchat_records(None):
        for turn in record["conversations"]:
            if not turns and turn["from"] != "human":
                continue
            if turns and turns[-1]["from"] == turn["from"]:
                turns[-1]["value"] += "\n" + turn["value"]
            else:
                turns.append(dict(turn))
            chars += len(turn["value"])
        if chars > tokens * 5.2 and turns[-1]["from"] == "gpt":
            break
    return {"id": f"long-{tokens}", "conversations": turns}


def run_cell(work: str, model: str, mode: str, n: int, length: int, flags: list[str],
             limit_gib: Optional[float] = None) -> dict:
    data = os.path.join(work, f"long-{length}.jsonl")
    if not os.path.exists(data):
        with open(data, "w") as f:
            f.write(json.dumps(long_conversation(length)) + "\n")
    out = os.path.join(work, f"{mode}-n{n}-{length}")
    cores = os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // n)), "SFT_CACHE_DIR": os.path.join(work, "cache")}
    args = ["--model_name_or_path", model, "--data_path", data, "--output_dir", out, "--model_max_length",
            str(length), "--long_conversations", "truncate", "--per_device_train_batch_size", "1", "--max_steps", "2",
            "--gradient_checkpointing", "True", "--memory_check", "refuse" if limit_gib else "warn", "--save_strategy",
            "no", "--report_to",
            "none", "--logging_steps", "1", "--disable_tqdm", "True", "--sequence_parallel_size", str(n),
            *MODES[mode], *flags]
    launch = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                               str(n), "--master_addr", "127.0.0.1", "--master_port", "29731"]
    t0 = time.time()
    if limit_gib:  # every rank its own node and its own memory cgroup
        nodes = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--node_rank", str(i),
                  "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", "29731",
                  os.path.join(ROOT, "finetune.py"), *args] for i in range(n)] if n > 1 else \
            [[sys.executable, os.path.join(ROOT, "finetune.py"), *args]]
        cgroups = load_file("tests", "helpers", "cgroups.py")
        rc, log = cgroups.run_in_memory_cgroups(nodes, int(limit_gib * 2 ** 30), env, ROOT)
    else:
        r = subprocess.run([*launch, os.path.join(ROOT, "finetune.py"), *args], capture_output=True, text=True,
                           env=env, cwd=ROOT)
        rc, log = r.returncode, r.stdout + r.stderr
    cell = {"mode": mode, "n": n, "length": length, "rc": rc, "wall_s": time.time() - t0}
    for key, pattern, group in (("plan", PLAN, 1), ("loading", PEAKS, 1), ("training", PEAKS, 2),
                                ("per_device_tok_s", SPEED, 1), ("loss", LOSS, 1)):
        m = pattern.search(log)
        cell[key] = float(m.group(group)) if m else None
    if rc != 0:
        refusal = next((ln for ln in log.splitlines() if "does not fit in memory" in ln), None)
        cell["error"] = [refusal] if refusal else [ln for ln in log.splitlines() if ln.strip()][-1:]
    return cell


def show(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def main(argv=None) -> int:
    a = parse(argv)
    if not os.path.isdir(a.model):
        print(f"no model at {a.model}: run `bash scripts/run_example.sh` (or scripts/prepare_example.py) first")
        return 2
    work = tempfile.mkdtemp(prefix="sft-long-context-")
    lengths = sorted(a.lengths)
    cells = []
    try:
        print(f"{'mode':5} {'N':>2} {'tokens':>7} {'rc':>3} {'plan GiB':>9} {'load GiB':>9} {'train GiB':>10} "
              f"{'act GiB':>8} {'tok/s':>8} {'loss':>7} {'wall s':>7}")
        for mode in a.modes:
            for n in a.sizes:
                base = None
                for length in lengths:
                    c = run_cell(work, a.model, mode, n, length, a.flags.split(), a.memory_limit_gib)
                    width = 600 if a.memory_limit_gib else 120  # a refusal in full
                    if base is None and c["training"] is not None:
                        base = c["training"]
                    c["activations"] = c["training"] - base if c["training"] is not None and base is not None \
                        else None
                    c["job_tok_s"] = c["per_device_tok_s"] * n if c["per_device_tok_s"] else None
                    cells.append(c)
                    print(f"{mode:5} {n:>2} {length:>7} {c['rc']:>3} {show(c['plan']):>9} {show(c['loading']):>9} "
                          f"{show(c['training']):>10} {show(c['activations']):>8} "
                          f"{show(c['job_tok_s'], '{:.0f}'):>8} {show(c['loss'], '{:.4f}'):>7} "
                          f"{c['wall_s']:>7.0f}  {' '.join(c.get('error', []))[:width]}", flush=True)
        print()
        for mode in a.modes:
            by = {(c["n"], c["length"]): c for c in cells if c["mode"] == mode}
            for n in a.sizes:
                top = by.get((n, lengths[-1]))
                if top and top["activations"] and len(lengths) > 1:
                    slope = top["activations"] / (lengths[-1] - lengths[0])  # GiB per token above the shortest
                    longest = lengths[0] + (a.budget_gib - by[(n, lengths[0])]["training"]) / slope
                    print(f"{mode} N={n}: {slope * 2 ** 20:.0f} KiB of activations per token of the conversation "
                          f"(rank 0); longest that fits {a.budget_gib:g} GiB per rank, extrapolated: "
                          f"{max(0, int(longest)):,} tokens")
            for length in lengths[1:]:
                one, two = by.get((1, length)), by.get((2, length))
                if one and two and one["activations"] and two["activations"]:
                    print(f"{mode} {length} tokens: activations per rank N=2 / N=1 = "
                          f"{two['activations'] / one['activations']:.2f}")
    finally:
        if a.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
