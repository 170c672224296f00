#!/usr/bin/env python
"""The LM head only at supervised positions (sft/model/loss.py) against logits at every position (a benchmark, \
not a test).

For each model and mode, in its own process (so that peak RSS is that configuration's): a LoRA model (r 16, all
linear projections but the head, as bench/compare.py) runs ``--steps`` forward + backward passes (no optimizer
step) of one ``[--micro_batch, --length]`` batch whose rows are supervised on their last ``--supervised``
fraction of positions (labels -100 before); prints the median seconds per pass after one warm-up, the peak RSS, and
the two modes' ratio. Models: ``smollm2`` = the example's SmolLM2-135M-Instruct (49,152-token vocabulary, tied
head), ``qwen-vocab`` = the same architecture with Qwen's 151,646-token vocabulary (random weights).

Usage: .venv/bin/python bench/lm_head.py [--models smollm2 qwen-vocab] [--bf16]
(the example model first: bash scripts/run_example.sh, or .venv/bin/python scripts/prepare_example.py)
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOL = os.path.join(ROOT, ".cache", "example", "smollm2-135m-instruct")
QWEN_VOCAB = 151646


def one(a) -> dict:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from sft.model.loss import compute_supervised_loss

    dtype = torch.bfloat16 if a.bf16 else torch.float32
    if a.model == "smollm2":
        model = transformers.AutoModelForCausalLM.from_pretrained(a.smol, dtype=dtype)
    else:
        config = transformers.AutoConfig.from_pretrained(a.smol)
        config.vocab_size = QWEN_VOCAB
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (a.micro_batch, a.length), generator=g)
    labels = ids.clone()
    labels[:, :int(a.length * (1 - a.supervised))] = -100
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    n = (labels[:, 1:] != -100).sum()
    head = model.get_output_embeddings()
    times = []
    for _ in range(a.steps + 1):
        t0 = time.perf_counter()
        if a.mode == "supervised":
            loss = compute_supervised_loss(model, inputs, n, head)
        else:
            loss = model(**inputs, num_items_in_batch=n, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"model": a.model, "mode": a.mode, "loss": loss.item(), "step_s": statistics.median(times[1:]),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
            "vocab": model.config.vocab_size, "threads": torch.get_num_threads()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "qwen-vocab"], choices=["smollm2", "qwen-vocab"])
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--supervised", type=float, default=0.5, help="supervised fraction of each row (its end)")
    p.add_argument("--steps", type=int, default=3, help="timed passes after one warm-up")
    p.add_argument("--bf16", action="store_true", help="model in bf16 (default fp32)")
    p.add_argument("--smol", default=SMOL, help="the SmolLM2 folder (architecture and, for smollm2, weights)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        a.model, a.mode = a.one
        print(json.dumps(one(a)))
        return 0
    if not os.path.isdir(a.smol):
        print(f"no model folder {a.smol}: run .venv/bin/python scripts/prepare_example.py first", file=sys.stderr)
        return 2
    print(f"load before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs; batch [{a.micro_batch}, {a.length}], "
          f"supervised fraction {a.supervised}, {'bf16' if a.bf16 else 'fp32'}, LoRA r16")
    flags = [f"--micro_batch={a.micro_batch}", f"--length={a.length}", f"--supervised={a.supervised}",
             f"--steps={a.steps}", f"--smol={a.smol}"] + (["--bf16"] if a.bf16 else [])
    print(f"{'model':<11} {'vocab':>7} {'mode':<11} {'s/step':>7} {'peak RSS GiB':>12} {'loss':>8}")
    for model in a.models:
        rows = {}
        for mode in ("all", "supervised"):
            out = subprocess.run([sys.executable, __file__, "--one", model, mode, *flags], capture_output=True,
                                 text=True, check=True)
            r = rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{model:<11} {r['vocab']:>7} {mode:<11} {r['step_s']:>7.2f} "
                  f"{r['peak_rss_gib']:>12.2f} {r['loss']:>8.4f}")
        print(f"{model:<11} supervised/all: step time x{rows['supervised']['step_s'] / rows['all']['step_s']:.2f}, "
              f"peak RSS x{rows['supervised']['peak_rss_gib'] / rows['all']['peak_rss_gib']:.2f}")
    print(f"load after: {os.getloadavg()[0]:.2f} (1 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
