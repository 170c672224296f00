#!/usr/bin/env python
"""The benchmark rows that fit one CUDA GPU in about 8 minutes (a benchmark, not a test).

    bash scripts/gpu_bench.sh                    # sets up .venv and the example, then runs every row
    .venv/bin/python bench/gpu_bench.py --dry_run   # prints the plan; runs anywhere

Rows (each a fresh process of bench/compare.py's ``ours`` worker on the example's SmolLM2-135M-Instruct and
chitchat data, LoRA r 16 on every linear layer, bf16, AdamW; :data:`ROWS`):

* ``bf16``             -- our defaults: padding-free batches, one attention call per layer (:mod:`sft.attention`:
  flash-attn varlen when the ``flash-attn`` package is installed, else torch's ``varlen_attn``, else SDPA per
  document);
* ``bf16-padded-sdpa`` -- ``--padding_free False``: padded batches under transformers' SDPA;
* ``qlora-4bit``       -- ``--q_lora True``: the base in bitsandbytes 4-bit NF4 on CUDA, adapters in bf16;
* ``zero2``            -- ``--deepspeed sft/configs/ds_config_zero2.json`` in one process (torchrun, 1 GPU).

Prints the attention path, then real tokens/s over optimizer steps 2..N and MFU against the GPU's bf16 matmul peak measured here
(:func:`sft.callbacks.measure_matmul_peak`) and, for the device names in :data:`DATASHEET_BF16_TFLOPS`, against
the datasheet's dense bf16 peak, and a verdict per target of :data:`TARGETS`. Refuses with exit 2 on a machine without CUDA (except ``--dry_run``).
Each row gets at most the time left of ``--time_limit_s``; a row that fails or runs out of time is reported
and the others still run. Exit 0 when every row ran, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, ".cache", "example")
COMPARE = os.path.join(ROOT, "bench", "compare.py")

ROWS = {  # name -> (what it measures, sft flags on top of compare.py's common ones, runs under torchrun)
    "bf16": ("our defaults: padding-free, per-document attention", "", False),
    "bf16-padded-sdpa": ("--padding_free False: padded batches, transformers' SDPA", "--padding_free False", False),
    "qlora-4bit": ("Q-LoRA: 4-bit NF4 base (bitsandbytes, CUDA)", "--q_lora True", False),
    "zero2": ("DeepSpeed ZeRO-2, one process", f"--deepspeed {os.path.join(ROOT, 'sft', 'configs', 'ds_config_zero2.json')}",
              True),
}

# Dense bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s (no sparsity), matched on the device name in
# this order (first match wins).
DATASHEET_BF16_TFLOPS = (("H200", 989.4), ("GH200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
                         ("H100", 989.4), ("A100", 312.0), ("L40S", 362.05), ("L4", 121.0))


def datasheet_peak(device_name: str) -> float | None:
    """The datasheet dense bf16 peak (TFLOP/s) for a CUDA device name such as ``"NVIDIA H100 80GB HBM3"``;
    None when the name matches no entry of :data:`DATASHEET_BF16_TFLOPS`."""
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows to run (default: all)")
    p.add_argument("--max_steps", type=int, default=30, help="optimizer steps per row, >= 2 (step 1 not timed)")
    p.add_argument("--max_length", type=int, default=2048, help="model_max_length (tokens)")
    p.add_argument("--batch", type=int, default=8, help="micro batch (conversations) per GPU")
    p.add_argument("--time_limit_s", type=float, default=480.0, help="wall-clock budget for all rows (seconds)")
    p.add_argument("--model", default=os.path.join(EXAMPLE, "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--dry_run", action="store_true", help="print the plan and exit (no CUDA needed)")
    a = p.parse_args(argv)
    if a.max_steps < 2:
        p.error("--max_steps must be at least 2 (step 1 is warm-up)")
    if a.max_length < 8 or a.batch < 1 or a.time_limit_s <= 0:
        p.error("--max_length must be >= 8, --batch >= 1 and --time_limit_s > 0")
    return a


def row_command(a, row: str, json_path: str, peak_tflops: float) -> list[str]:
    """The command line of one row (compare.py's ``ours`` worker, bf16; ZeRO-2 under torchrun, 1 process)."""
    _, flags, distributed = ROWS[row]
    worker = [COMPARE, "--worker", "ours", "--json", json_path, "--model", a.model, "--data", a.data, "--bf16",
              "--timing", "steps", "--max_steps", str(a.max_steps), "--batch", str(a.batch), "--packing_batch", "1",
              "--max_length", str(a.max_length), "--lora_r", "16", "--cache", os.path.join(tempfile.gettempdir(), "sft-gpu-bench-cache"),
              "--peak_tflops", f"{peak_tflops:.3f}", f"--train_flags={flags}"]
    if distributed:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *worker]
    return [sys.executable, *worker]


# Issue 30's targets that these rows measure: (name, row, reference row, least ratio of real tokens/s).
TARGETS = (("ours default >= 1.5x --padding_free False (SmolLM2-135M)", "bf16", "bf16-padded-sdpa", 1.5),)


def verdicts(rates: dict[str, float]) -> list[str]:
    """One line per target of :data:`TARGETS`: the measured ratio and "met" or "MISSED", or why it was not measured.

    Args:
        rates: real tokens/s by row name (rows that ran).
    """
    lines = []
    for name, row, ref, least in TARGETS:
        if row not in rates or ref not in rates or rates[ref] <= 0:
            lines.append(f"target {name}: not measured (needs the rows {row} and {ref})")
            continue
        ratio = rates[row] / rates[ref]
        lines.append(f"target {name}: {ratio:.2f}x, {'met' if ratio >= least else 'MISSED'}")
    return lines


def attention_path() -> str:
    """The padding-free attention path bf16 rows take on this machine's GPU (:func:`sft.attention.varlen_kernel`)."""
    import torch

    from sft.attention import varlen_kernel

    return {"flash_attn": "one flash-attn varlen call per layer", "torch_varlen": "one torch varlen_attn call per layer",
            "sdpa_loop": "SDPA per document (flash/memory-efficient backends)"}[varlen_kernel("cuda", torch.bfloat16)]


def plan(a) -> None:
    print(f"model {a.model}\ndata {a.data}\nLoRA r 16 / alpha 32 / dropout 0.05 on all linear layers, bf16, "
          f"max length {a.max_length}, micro batch {a.batch}, {a.max_steps} optimizer steps per row (step 1 not "
          f"timed), at most {a.time_limit_s:.0f} s in all")
    for row in a.rows:
        print(f"  {row:<18}{ROWS[row][0]}\n  {'':<18}$ {shlex.join(row_command(a, row, f'<work>/{row}.json', 0.0))}")


def main(argv=None) -> int:
    a = parse(argv)
    if a.dry_run:
        plan(a)
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"error: bench/gpu_bench.py needs a CUDA GPU, and torch {torch.__version__} finds none on this machine "
              "(torch.cuda.is_available() is False). Run it on a machine with an NVIDIA GPU and a CUDA build of torch, "
              "or pass --dry_run to see the plan; bench/compare.py measures the CPU.", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    if not (os.path.exists(a.model) and os.path.exists(a.data)):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_example.py")], check=True, cwd=ROOT)
    from sft.callbacks import measure_matmul_peak

    name = torch.cuda.get_device_name()
    measured = measure_matmul_peak(torch.bfloat16, torch.device("cuda"), seconds=2.0) / 1e12
    sheet = datasheet_peak(name)
    attention = attention_path()
    print(f"device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); bf16 matmul peak measured "
          f"{measured:.1f} TFLOP/s; datasheet {f'{sheet:.1f} TFLOP/s' if sheet else 'unknown for this name'}; "
          f"per-document attention: {attention}")
    plan(a)
    work = tempfile.mkdtemp(prefix="sft-gpu-bench-")
    print(f"results and logs: {work}", flush=True)
    rows, failed = [], []
    for row in a.rows:
        left = a.time_limit_s - (time.perf_counter() - t_start)
        if left < 30:
            failed.append((row, "not run: the time limit was spent"))
            continue
        json_path = os.path.join(work, f"{row}.json")
        log = os.path.join(work, f"{row}.log")
        try:
            with open(log, "w") as f:
                p = subprocess.run(row_command(a, row, json_path, measured), cwd=ROOT, stdout=f,
                                   stderr=subprocess.STDOUT, timeout=left, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        except subprocess.TimeoutExpired:
            failed.append((row, f"stopped after {left:.0f} s (time limit); log {log}"))
            continue
        if p.returncode != 0 or not os.path.exists(json_path + ".0"):
            failed.append((row, f"exit {p.returncode}; last line: {open(log).read().strip().splitlines()[-1:]} (log {log})"))
            continue
        r = json.load(open(json_path + ".0"))
        rate = r["real"] / r["seconds"]
        head = r.get("head_flops_per_token", 0)
        flops = ((r["flops_per_token"] - head) * r["real"] + head * r["supervised"]) / r["seconds"] / 1e12
        rows.append((row, rate, r["median_step_s"], r.get("load_peak_gib", 0.0), r["peak_mem_gib"], flops))
    print(f"\n{'row':<18}{'real tok/s':>12}{'median step':>13}{'load peak':>13}{'step peak':>13}{'TFLOP/s':>9}"
          f"{'MFU measured':>14}{'MFU datasheet':>15}   (peaks: CUDA max allocated)")
    for row, rate, median, load, mem, tf in rows:
        print(f"{row:<18}{rate:>12.0f}{median:>11.3f} s{load:>9.2f} GiB{mem:>9.2f} GiB{tf:>9.1f}"
              f"{100 * tf / measured:>13.1f}%" + (f"{100 * tf / sheet:>14.1f}%" if sheet else f"{'-':>15}"))
    for row, why in failed:
        print(f"{row:<18}failed: {why}")
    for line in verdicts({row: rate for row, rate, *_ in rows}):
        print(line)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
