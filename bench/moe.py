#!/usr/bin/env python
"""Mixture-of-experts LoRA on this machine: a Qwen3-30B-A3B-shaped MoE layer (E = 128 experts, top-8) scaled down in
hidden and expert width, and a tiny whole model of the same shape, side by side in one run (a benchmark, not a test).

    .venv/bin/python bench/moe.py                       # every arm, the default shapes
    .venv/bin/python bench/moe.py --tokens 2048 --steps 5

Arms (memory on CPU: each in its own process, so that one arm's peak cannot hide another's, unless ``--one_process``;
on CUDA in this process, one arm after the other; speed: all in one process, their steps alternated, so that the load
of a shared machine falls on every arm alike):

* ``eager``     -- frozen experts, transformers' per-expert loop (``experts_implementation="eager"``);
* ``grouped``   -- frozen experts, transformers' ``grouped_mm`` path (the default);
* ``peft``      -- LoRA r 16 on every expert through peft's ``ParamWrapper`` (builds W + s·B·A each forward);
* ``ours``      -- the same LoRA through :class:`sft.model.expert_lora.ExpertLoraWrapper` (grouped, no W + s·B·A).

Per arm: tokens/s of a forward + backward step (median of ``--steps`` after a warm-up) and the peak resident memory
the steps added above the warmed-up model (``VmHWM`` after ``/proc/self/clear_refs`` less ``VmRSS`` before them,
MiB; on CUDA: ``torch.cuda.max_memory_allocated`` less the memory allocated before them). Then the Q-LoRA bytes of
the layer's experts in NF4 (packed values + absmax) against bf16. Figures from a machine shared with other work
compare only within one run.

``--device cuda --dtype bf16 --arms grouped peft ours --layer_only --json FILE`` is bench/gpu_bench.py's
``--shape qwen3-30b-a3b-layer`` row (one full-size layer: ``--hidden 2048 --expert_dim 768 --tokens 4096``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("eager", "grouped", "peft", "ours")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="hidden size (Qwen3-30B-A3B: 2048)")
    p.add_argument("--expert_dim", type=int, default=96, help="expert intermediate size (Qwen3-30B-A3B: 768)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top_k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--arm", choices=ARMS + ("model-peft", "model-ours"), help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=2, help="layers of the whole model")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="layer arms to run")
    p.add_argument("--layer_only", action="store_true", help="no whole-model arms, no Q-LoRA bytes")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--one_process", action="store_true", help="on CPU too, measure memory in this process (faster "
                   "start; the allocator may reuse an earlier arm's freed memory: smaller peaks)")
    return p.parse_args(argv)


def _sync(a) -> None:
    import torch

    if a.device.startswith("cuda"):
        torch.cuda.synchronize()


def config(a, layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=1024, hidden_size=a.hidden, intermediate_size=a.hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4,
                          num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_dim)


def build(a, arm: str):
    """The model of ``arm`` (one MoE layer for the layer arms, ``--layers`` for ``model-*``), adapted as the arm
    says; returns ``(model, step)`` where ``step()`` runs one forward + backward."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft.compat.peft import without_gptqmodel, without_v4_moe_conversion
    from sft.model.loading import apply_lora
    from sft.model.spec import LoraSpec

    torch.manual_seed(0)
    whole = arm.startswith("model-")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(config(a, a.layers if whole else 1), dtype=dtype).to(a.device)
    if arm == "eager":
        model.set_experts_implementation("eager")
    kind = arm.removeprefix("model-")
    if kind == "peft":
        with without_v4_moe_conversion(), without_gptqmodel():
            model = get_peft_model(model, LoraConfig(
                r=a.r, lora_alpha=2 * a.r, target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"] if whole else []))
    elif kind == "ours":
        targets = None if whole else ("gate_up_proj", "down_proj")
        model = apply_lora(model, None, False, LoraSpec(r=a.r, alpha=2 * a.r, dropout=0.0, target_modules=targets,
                                                        train_embeddings="false"))
    else:
        model.requires_grad_(False)
    if whole:
        ids = torch.randint(0, 1024, (1, a.tokens), device=a.device)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
        return model, step
    block = model.get_submodule("base_model.model.model.layers.0.mlp" if kind in ("peft", "ours")
                                else "model.layers.0.mlp")
    x = torch.randn(1, a.tokens, a.hidden, device=a.device, dtype=dtype, requires_grad=True)

    def step():
        block(x).sum().backward()
    return model, step


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def run_arm(a) -> dict:
    """Build, warm up, reset the process's peak resident memory (``/proc/self/clear_refs`` 5, Linux), time
    ``--steps`` steps; the peak (``VmHWM``) less the resident memory before the steps is what they added."""
    import torch

    model, step = build(a, a.arm)
    step()  # warm-up (lazy initialisation, the gradients' buffers)
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 1024
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        _sync(a)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 1024 if cuda else _status_kib("VmHWM")
    return {"arm": a.arm, "tokens_per_s": a.tokens / statistics.median(times), "peak_mib": (peak - before) / 1024}


def qlora_bytes(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from sft.model.experts import quantize_experts

    model = AutoModelForCausalLM.from_config(config(a, 1))
    experts = model.model.layers[0].mlp.experts
    values = quantize_experts(model)
    nf4 = sum(experts.parametrizations[n].original.numel()
              + experts.parametrizations[n][0].quant_state.absmax.numel() * 4 for n in ("gate_up_proj", "down_proj"))
    return {"expert_values": values, "bf16_bytes": 2 * values, "nf4_bytes": nf4,
            "ratio": nf4 / (2 * values), "dtype_check": str(torch.uint8)}


# bench/gpu_bench.py --shape qwen3-30b-a3b-layer: one full-size Qwen3-30B-A3B layer (or --tiny: scaled to a CPU)
LAYER_ROW = {False: ["--hidden", "2048", "--expert_dim", "768", "--tokens", "4096", "--steps", "10"],
             True: ["--hidden", "64", "--expert_dim", "32", "--tokens", "64", "--steps", "1", "--one_process"]}


def layer_row_command(tiny: bool, device: str, json_path: str) -> list[str]:
    """This script's command for gpu_bench's ``qwen3-30b-a3b-layer`` row: E = 128, top-8, r 16, bf16, the layer arms
    ``grouped`` / ``peft`` / ``ours`` (``tiny``: width 64, experts of 32, 64 tokens, in one process; fp32 on a CPU,
    where bf16 ``grouped_mm`` is slow)."""
    dtype = "fp32" if tiny and device == "cpu" else "bf16"
    return [sys.executable, os.path.abspath(__file__), *LAYER_ROW[tiny], "--experts", "128", "--top_k", "8", "--r",
            "16", "--device", device, "--dtype", dtype, "--arms", "grouped", "peft", "ours", "--layer_only",
            "--json", json_path]


def layer_row(tiny: bool, device: str, name: str, work: str, time_limit_s: float) -> int:
    """Run :func:`layer_row_command`; its output into ``work/table.txt``, its figures into ``work/results.json``
    (``moe_layer``: None when it failed). Returns 0 when it ran, 1 otherwise."""
    os.makedirs(work, exist_ok=True)
    json_path = os.path.join(work, "moe_layer.json")
    cmd = layer_row_command(tiny, device, json_path)
    print("$ " + " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=time_limit_s)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired:
        text, rc = f"stopped after {time_limit_s:.0f} s (time limit)", 124
    print(text)
    with open(os.path.join(work, "table.txt"), "w") as f:
        f.write(text)
    result = json.load(open(json_path)) if rc == 0 and os.path.exists(json_path) else None
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump({"device": name, "shape": "qwen3-30b-a3b-layer", "tiny": tiny, "moe_layer": result,
                   "failed": {} if result else {"qwen3-30b-a3b-layer": f"exit {rc}"}}, f, indent=1)
    return 0 if result else 1


def main(argv=None):
    a = parse(argv)
    if a.arm:
        print(json.dumps(run_arm(a)))
        return
    # glibc returns every block of 128 KiB or more to the system when freed (a fixed mmap threshold), so that the
    # resident memory follows the tensors alive, not what the allocator keeps cached
    env = {**os.environ, "PYTHONPATH": ROOT, "MALLOC_MMAP_THRESHOLD_": "131072"}
    arms = tuple(a.arms) + (() if a.layer_only else ("model-peft", "model-ours"))
    peaks = {}
    for arm in arms:  # memory: one process per arm on CPU (on CUDA the allocator's count is exact in this one)
        if a.device.startswith("cuda") or a.one_process:
            import torch

            peaks[arm] = run_arm(argparse.Namespace(**{**vars(a), "arm": arm}))["peak_mib"]
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        args = [sys.executable, os.path.abspath(__file__), "--arm", arm, *(argv if argv is not None else sys.argv[1:])]
        r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
        if r.returncode:
            sys.exit(f"arm {arm} failed: {r.stderr[-2000:]}")
        peaks[arm] = json.loads(r.stdout.strip().splitlines()[-1])["peak_mib"]
    steps = {arm: build(a, arm)[1] for arm in arms}  # speed: every arm in this process, alternated step by step
    times = {arm: [] for arm in arms}
    for arm in arms:
        steps[arm]()  # warm-up
    for _ in range(a.steps):
        for arm in arms:
            _sync(a)
            t = time.perf_counter()
            steps[arm]()
            _sync(a)
            times[arm].append(time.perf_counter() - t)
    print(f"MoE layer: hidden {a.hidden}, {a.experts} experts of {a.expert_dim}, top-{a.top_k}, {a.tokens} tokens, "
          f"LoRA r {a.r}, {a.dtype} on {a.device}; whole model: {a.layers} layers; tokens/s: median of {a.steps} "
          "alternated steps")
    print(f"{'arm':<12} {'tokens/s':>10} {'step ms':>9} {'peak MiB':>9}")
    rows = []
    for arm in arms:
        med = statistics.median(times[arm])
        rows.append({"arm": arm, "tokens_per_s": a.tokens / med, "step_ms": 1000 * med, "peak_mib": peaks[arm]})
        print(f"{arm:<12} {a.tokens / med:>10.0f} {1000 * med:>9.2f} {peaks[arm]:>9.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "dtype": a.dtype, "hidden": a.hidden, "expert_dim": a.expert_dim,
                       "experts": a.experts, "top_k": a.top_k, "tokens": a.tokens, "r": a.r, "arms": rows}, f)
    if a.layer_only:
        return
    q = qlora_bytes(a)
    print(f"Q-LoRA experts of one layer: {q['expert_values']:,} values, bf16 {q['bf16_bytes']:,} B, NF4 "
          f"{q['nf4_bytes']:,} B ({q['ratio']:.3f} x bf16)")


if __name__ == "__main__":
    main()
