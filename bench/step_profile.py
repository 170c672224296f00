#!/usr/bin/env python
"""Where a Trainer step's time goes, against the bare forward + backward of the same batches (a benchmark).

Builds the run of the usual finetune.py flags (with the callbacks ``sft.app.train.run`` installs: checkpoint,
preemption, throughput), trains ``--max_steps`` optimizer steps (gradient accumulation 1), and times each
part of every step after the first: fetching the batch (``get_batch_samples``: data loading, collation, the
supervised-token count), ``training_step`` (forward + backward as the Trainer runs them), gradient clipping,
``optimizer.step``, every callback event, logging; the rest of the step is the Trainer's own loop. Then the
same batches run bare: ``compute_loss`` + ``backward`` (the same loss path) and ``torch.optim.AdamW.step`` on
the trainable parameters, with nothing else. Prints seconds per step for each part (median over the steps).

Usage (the README example's configuration):
    .venv/bin/python bench/step_profile.py --model_name_or_path .cache/example/smollm2-135m-instruct \\
        --data_path .cache/example/chitchat.jsonl --use_lora True --lora_r 16 --lora_alpha 32 \\
        --per_device_train_batch_size 4 --model_max_length 256 --max_steps 6
"""
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

import sft  # noqa: F401  (first: holds library import notices that do not concern the run, see sft.logs)


def timed(obj, name: str, into: dict, key: str):
    """Replace ``obj.name`` by a wrapper that adds its wall time to ``into[key]`` (seconds, this step)."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into[key] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def main() -> int:
    from transformers import TrainerCallback

    from sft.app.train import trainer_for
    from sft.cli import report
    from sft.config.arguments import parse_args
    from sft.errors import SFTError
    from sft.logs import setup_logging
    from sft.train.preemption import PreemptionHandler

    argv = sys.argv[1:]
    if "--output_dir" not in argv:
        argv += ["--output_dir", tempfile.mkdtemp(prefix="sft-profile-")]
    argv = ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "True", "--logging_steps", "1",
            "--overwrite_output_dir", "True", "--gradient_accumulation_steps", "1"] + argv
    try:
        args = parse_args(argv)
        setup_logging()
        preemption = PreemptionHandler(args[2].preemption_timeout, ()).install()
        # as sft.app.train.run: sft's checkpoint callback and rotation
        trainer, _, _ = trainer_for(*args, callbacks=[preemption], sft_checkpoints=True)
    except SFTError as e:
        return report(e)

    part = defaultdict(float)
    steps, batches = [], []
    timed(trainer, "get_batch_samples", part, "batch fetch (data loading, collation, token count)")
    timed(trainer, "training_step", part, "training_step (forward + backward)")
    timed(trainer, "_clip_grad_norm", part, "gradient clipping (--max_grad_norm)")
    timed(trainer, "_maybe_log_save_evaluate", part, "logging (loss .item(), log line)")
    timed(trainer.callback_handler, "call_event", part, "callback events (all callbacks)")
    get_batch_samples = trainer.get_batch_samples

    def keep(*a, **k):  # the batches, for the bare run
        out = get_batch_samples(*a, **k)
        batches.append(out)
        return out

    trainer.get_batch_samples = keep

    class Clock(TrainerCallback):
        def on_pre_optimizer_step(self, *a, **k):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            part["optimizer.step"] += time.perf_counter() - self.t_opt

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            if hasattr(self, "t"):
                steps.append({"step": now - self.t, **part})
            self.t = now
            part.clear()

    trainer.add_callback(Clock())
    try:
        trainer.train()
    finally:
        preemption.uninstall()
    # steps[i] spans from step i+1's end to step i+2's end; the first step (warm-up, and the clock's start) is out
    if len(steps) < 2:
        print("error: need --max_steps >= 3", file=sys.stderr)
        return 2
    model = trainer.model
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    bare = defaultdict(list)
    for samples, n in batches[1:1 + len(steps)]:
        t0 = time.perf_counter()
        for inputs in samples:
            trainer.compute_loss(model, inputs, num_items_in_batch=n).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        bare["bare forward + backward"].append(t1 - t0)
        bare["bare AdamW step + zero_grad"].append(t2 - t1)
    med = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in steps[0]}
    ta = args[2]
    print(f"\nconfig: {os.path.basename(args[0].model_name_or_path.rstrip('/'))}, "
          f"{'LoRA r=' + str(args[3].lora_r) if ta.use_lora else 'full'}, "
          f"micro batch {ta.per_device_train_batch_size}, "
          f"max length {ta.model_max_length}, {'bf16' if ta.bf16 else 'fp32'}, LM head "
          f"{'at supervised positions' if trainer.supervised_head else 'at every position'}, {len(steps)} timed steps, "
          f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f} (1 min)")
    print(f"{'Trainer step, whole':<56}{med.pop('step'):>8.3f} s")
    for k, v in med.items():
        print(f"  {k:<54}{v:>8.3f} s")
    whole = statistics.median(s["step"] for s in steps)
    print(f"  {'the rest (the Trainer loop itself)':<54}{whole - sum(med.values()):>8.3f} s  (medians; logging "
          "includes the on_log callback event, counted in both)")
    for k, v in bare.items():
        print(f"{k:<56}{statistics.median(v):>8.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
