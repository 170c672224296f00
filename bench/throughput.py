#!/usr/bin/env python
"""Training throughput of one finetune.py configuration (a benchmark, not a test).

Runs the configuration given by the usual finetune.py flags for --max_steps optimizer steps and
prints, over the steps after the first (warm-up) one:

* real tokens/s: non-padding tokens (attention_mask == 1) processed per second of step time;
* padding ratio: padding tokens / all tokens in the batches;
* supervised tokens/s (tokens whose label is not -100), median step time, peak RSS.

Usage (the README's example configuration):
    .venv/bin/python bench/throughput.py --model_name_or_path .cache/example/smollm2-135m-instruct \
        --data_path .cache/example/chitchat.jsonl --use_lora True --lora_r 16 --lora_alpha 32 \
        --per_device_train_batch_size 4 --model_max_length 256 --max_steps 9
"""
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

import sft  # noqa: F401  (first: holds library import notices that do not concern the run, see sft.logs)


def main() -> int:
    from transformers import TrainerCallback

    from sft.app.train import trainer_for
    from sft.cli import report
    from sft.config.arguments import parse_args
    from sft.errors import SFTError
    from sft.logs import setup_logging

    argv = sys.argv[1:]
    if "--output_dir" not in argv:
        argv += ["--output_dir", tempfile.mkdtemp(prefix="sft-bench-")]
    argv = ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "True", "--logging_steps", "1000",
            "--overwrite_output_dir", "True"] + argv
    try:
        args = parse_args(argv)
        setup_logging()
        trainer, tok, _ = trainer_for(*args)
    except SFTError as e:
        return report(e)

    counts = {"real": 0, "total": 0, "supervised": 0}
    per_step, times = [], []

    training_step = trainer.training_step

    def count_batch(model, inputs, *rest, **kw):  # every micro batch of each step, before the model sees it
        mask, labels = inputs.get("attention_mask"), inputs["labels"]
        if mask is None:  # --packing: one padding-free row, every token real
            mask = torch.ones_like(inputs["input_ids"])
        counts["real"] += int(mask.sum())
        counts["total"] += mask.numel()
        counts["supervised"] += int((labels != -100).sum())
        return training_step(model, inputs, *rest, **kw)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, self.c0 = time.perf_counter(), dict(counts)

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)
            per_step.append({key: counts[key] - self.c0[key] for key in counts})

    trainer.training_step = count_batch
    trainer.add_callback(Timer())
    trainer.train()
    if len(times) < 2:
        print("error: need --max_steps >= 2 (the first step is warm-up and not counted)", file=sys.stderr)
        return 2
    t, steps = sum(times[1:]), per_step[1:]
    real, total, sup = (sum(s[k] for s in steps) for k in ("real", "total", "supervised"))
    ta = args[2]
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"config: {os.path.basename(args[0].model_name_or_path.rstrip('/'))}, "
          f"{'LoRA r=' + str(args[3].lora_r) if ta.use_lora else 'full'}, "
          f"micro batch {ta.per_device_train_batch_size}, "
          f"grad accumulation {ta.gradient_accumulation_steps}, max length {ta.model_max_length}, "
          f"{'bf16' if ta.bf16 else 'fp32'}, {len(times) - 1} timed steps, "
          f"torch threads {__import__('torch').get_num_threads()}")
    print(f"real tokens/s:        {real / t:10.1f}")
    print(f"supervised tokens/s:  {sup / t:10.1f}")
    print(f"padding ratio:        {1 - real / total:10.3f}  ({total - real} pad of {total} tokens)")
    print(f"median step time:     {statistics.median(times[1:]):10.2f} s")
    print(f"peak RSS:             {rss_mib:10.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
