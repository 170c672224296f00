#!/usr/bin/env python
"""Where a training process spends its CPU time before its first optimizer step (docs/testing.md, "Where a test's
time goes"): run in place of finetune.py, one process or under torchrun, with the same flags.

    OMP_NUM_THREADS=1 SFT_STARTUP_REPORT=/tmp/p python bench/startup_profile.py --model_name_or_path ... [flags]
    torchrun --nproc_per_node 2 bench/startup_profile.py ...        (one report per rank)

Phases, each in CPU seconds of this process (user + system, every thread; ``resource.getrusage``) and wall seconds,
cumulative from the interpreter's start (the time before ``main`` runs, Python's own start-up, is in the first):
``imports`` (sft.app.train and what it pulls in: torch, transformers, peft, ...), ``parse``, ``validate``, ``runtime``
(:func:`sft.distributed.process_group.start_runtime`: the process group, DeepSpeed's communication), ``data``
(:func:`sft.app.data.prepare_data`: tokenizer, records, tokenized samples), ``model`` (:func:`sft.app.train.
prepare_model`: load, LoRA, the attention and collator choices), ``plan`` (the memory plan and its probe),
``trainer`` (the Trainer, its accelerator), ``first_step`` (``Trainer.train`` up to the end of the first
``training_step``: DeepSpeed/FSDP wrapping, optimizer, the first forward and backward), and ``end`` (the whole run).
Each phase also names the heavy packages first imported in it. The report is JSON,
``$SFT_STARTUP_REPORT/rank{RANK}.json``, written at the first step and again at the end.
"""
import json
import os
import resource
import sys
import time

T0 = time.perf_counter()
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "deepspeed", "accelerate", "datasets", "pandas", "pyarrow",
         "sympy", "torch._dynamo", "torch._inductor", "transformers.trainer", "torch.distributed.tensor", "ray",
         "matplotlib", "tensorboard", "triton", "scipy")
phases: list = []


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def mark(name: str) -> None:
    new = [m for m in HEAVY if m in sys.modules and not any(m in p["imported"] for p in phases)]
    phases.append({"phase": name, "cpu_s": round(_cpu(), 3), "wall_s": round(time.perf_counter() - T0, 3),
                   "imported": new})


def write() -> None:
    out = os.environ.get("SFT_STARTUP_REPORT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(phases, f, indent=1)


def timed(module, name: str, phase: str) -> None:
    """Wrap ``module.name`` so that its return marks ``phase``."""
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        mark(phase)
        return result
    setattr(module, name, wrapper)


def main() -> int:
    import sft.app.train as training
    import sft.config.arguments as arguments
    from sft.cli import train_main
    from sft.train.trainer import Trainer

    mark("imports")
    timed(training, "parse_args", "parse")
    timed(training, "validate", "validate")
    timed(training, "start_runtime", "runtime")
    timed(training, "prepare_data", "data")
    timed(training, "prepare_model", "model")
    timed(training, "plan_memory", "plan")
    timed(training, "make_trainer", "trainer")
    del arguments
    step = Trainer.training_step

    def first_step(self, *args, **kwargs):
        loss = step(self, *args, **kwargs)
        if not any(p["phase"] == "first_step" for p in phases):
            mark("first_step")
            write()
        return loss
    Trainer.training_step = first_step
    code = train_main(sys.argv[1:])
    mark("end")
    write()
    return code


if __name__ == "__main__":
    from sft.cli import exit_process

    exit_process(main())
