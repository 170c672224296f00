#!/usr/bin/env python
"""How long a checkpoint save blocks training, synchronous against ``--save_async``, side by side in one run.

Each cell trains SmolLM2-135M-Instruct (``.cache/example``, ``scripts/prepare_example.py``) on the chitchat example
with ``finetune.py``'s flags under torchrun (``--nproc`` CPU processes, gloo), a checkpoint every ``--save_steps``
optimizer steps, once per mode (sync, then async, in turns over ``--rounds``). This script is also the worker
(``--worker``): it trains through :func:`sft.cli.train_main` with one callback added after sft's own, which records
per rank

* **blocked per save**: from the end of the optimizer step that saves (``on_step_end``) to the end of the save
  (``on_save``, after sft's marker callback): the Trainer's whole save, marker and rotation (sync), or the wait for
  the previous write, the host copy and the small files (async);
* **step time**: from the end of a step (or of its save) to the end of the next step, split by whether a background
  write was in flight during the step (the writer thread alive at its start or end);
* rank 0's peak resident memory (``VmHWM``) and the checkpoint's size on disk.

    .venv/bin/python bench/checkpoint_stall.py                       # every cell, 2 processes
    .venv/bin/python bench/checkpoint_stall.py --cells fsdp2-full --rounds 2
    .venv/bin/python bench/checkpoint_stall.py --shard_plan        # bytes per rank for 7B / 70B, computed

Cells: ``ddp-lora`` (LoRA r=8, DDP), ``ddp-full`` (full fine-tuning, DDP), ``fsdp2-full`` (full fine-tuning, FSDP2 with
the shipped ``finetune/fsdp_config_full_shard.json``: each rank writes its shards), ``fsdp2-full-gathered`` (the same
with ``"state_dict_type": "FULL_STATE_DICT"``: the model and optimizer gathered to rank 0 at every save; sync only),
``zero2-full`` (DeepSpeed ZeRO-2, which writes its own checkpoint: sync only).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, ".cache", "example", "smollm2-135m-instruct")
DATA = os.path.join(ROOT, ".cache", "example", "chitchat.jsonl")
FT = os.path.join(ROOT, "finetune")
CELLS = {
    "ddp-lora": ["--use_lora", "True", "--lora_r", "8", "--learning_rate", "1e-4"],
    "ddp-full": ["--learning_rate", "1e-5"],
    "fsdp2-full": ["--learning_rate", "1e-5", "--fsdp", "--fsdp_config",
                   os.path.join(FT, "fsdp_config_full_shard.json")],
    "fsdp2-full-gathered": ["--learning_rate", "1e-5", "--fsdp", "--fsdp_config", "GATHERED"],
    "zero2-full": ["--learning_rate", "1e-5", "--deepspeed", os.path.join(FT, "ds_config_zero2.json")],
}
SYNC_ONLY = {"fsdp2-full-gathered", "zero2-full"}
GIB, MIB = 2 ** 30, 2 ** 20


# ------------------------------------------------------------------------------------------------------- worker

def worker(argv: list[str]) -> int:
    """Train with the timing callback; write ``$SFT_BENCH_REPORT_DIR/rank{N}.json``."""
    from transformers import TrainerCallback

    import sft.app.train as training
    from sft.cli import train_main

    got = {}

    class Timing(TrainerCallback):
        def __init__(self):
            self.last, self.saved_at, self.steps, self.saves = None, None, [], []
            self.writing_at_start = False

        @staticmethod
        def writing() -> bool:
            return any(t.name == "sft-checkpoint-writer" and t.is_alive() for t in threading.enumerate())

        def on_step_end(self, args, state, control, **kwargs):
            now, writing = time.perf_counter(), self.writing()
            if self.last is not None:  # after a save, from its end
                self.steps.append({"step": state.global_step, "s": now - self.last,
                                   "writing": writing or self.writing_at_start})
            self.last, self.saved_at, self.writing_at_start = now, None, writing

        def on_save(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.saves.append({"step": state.global_step, "blocked_s": now - self.last})
            self.saved_at, self.last, self.writing_at_start = now, now, self.writing()

    timing = Timing()
    build = training.build_trainer

    def build_with_timing(*args, **kwargs):
        trainer, tok, eot = build(*args, **kwargs)
        trainer.add_callback(timing)  # after sft's checkpoint callback: on_save ends when the save has
        got["trainer"] = trainer
        return trainer, tok, eot

    training.build_trainer = build_with_timing
    code = train_main(argv)
    trainer = got.get("trainer")
    if trainer is not None:
        hwm = next((int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")), 0)
        with open(os.path.join(os.environ["SFT_BENCH_REPORT_DIR"], f"rank{trainer.args.process_index}.json"),
                  "w") as f:
            json.dump({"steps": timing.steps, "saves": timing.saves, "hwm": hwm}, f)
    return code


# ------------------------------------------------------------------------------------------------------- driver

def run_cell(a, cell: str, mode: str, work: str) -> dict:
    out, report = os.path.join(work, f"{cell}-{mode}"), os.path.join(work, f"{cell}-{mode}-report")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(report, ignore_errors=True)
    os.makedirs(report)
    flags = [f if f != "GATHERED" else a.gathered for f in CELLS[cell]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(a.port), os.path.abspath(__file__), "--worker",
           "--model_name_or_path", a.model, "--data_path", a.data, "--output_dir", out,
           "--overwrite_output_dir", "True",
           "--max_steps", str(a.steps), "--per_device_train_batch_size", "1", "--model_max_length", str(a.max_length),
           "--save_strategy", "no" if mode == "none" else "steps", "--save_steps", str(a.save_steps),
           "--save_total_limit", "2",
           "--logging_steps", "1000", "--report_to", "none", "--disable_tqdm", "True", "--bf16", "False",
           "--gradient_checkpointing", "False", "--data_cache_dir", os.path.join(work, "data-cache"),
           "--save_async", str(mode == "async"), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // a.nproc)),
           "SFT_BENCH_REPORT_DIR": report, "PYTHONPATH": ROOT}
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        print(f"{cell} {mode}: exit {r.returncode}\n{r.stderr[-3000:]}", file=sys.stderr)
        return {}
    ranks = [json.load(open(os.path.join(report, f"rank{i}.json"))) for i in range(a.nproc)]
    ckpts = [] if mode == "none" else sorted((d for d in os.listdir(out) if d.startswith("checkpoint-")),
                                             key=lambda d: int(d.split("-")[1]))
    size = sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(os.path.join(out, ckpts[-1]))
               for n in names) if ckpts else 0
    # a save blocks every rank until the slowest is through (the next step's collectives wait for it)
    blocked = [max(rk["saves"][i]["blocked_s"] for rk in ranks) for i in range(len(ranks[0]["saves"]))]
    steps = ranks[0]["steps"][2:]  # the first steps warm up
    quiet = [s["s"] for s in steps if not s["writing"]]
    busy = [s["s"] for s in steps if s["writing"]]
    shutil.rmtree(out, ignore_errors=True)
    return {"blocked": blocked, "quiet": quiet, "busy": busy, "hwm0": ranks[0]["hwm"], "size": size, "wall": wall}


SHAPES = {"qwen2.5-7b": 7_615_616_512, "llama-3-70b": 70_553_706_496}  # parameters (their config.json shapes)


def shard_plan(ranks=(8, 16, 32, 64)) -> None:
    """Bytes of one checkpoint per rank for full fine-tuning with AdamW: fp32 weights (FSDP2 keeps the sharded
    parameters in fp32 under bf16 mixed precision) and two fp32 moments, 12 bytes per parameter, each rank holding
    1/N (``SHARDED_STATE_DICT``), against rank 0 gathering all of it (``FULL_STATE_DICT``). Arithmetic, not a
    measurement; how long the copy to pinned host memory takes needs a GPU's measured bandwidth."""
    print("| model | parameters | gathered on rank 0, GB | " + " | ".join(f"per rank at {n} ranks, GB" for n in ranks)
          + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in ranks) + " |")
    for name, n_params in SHAPES.items():
        total = 12 * n_params
        print(f"| {name} | {n_params / 1e9:.2f} B | {total / 1e9:.0f} | "
              + " | ".join(f"{total / n / 1e9:.1f}" for n in ranks) + " |")


def med(xs) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async", "none"],
                    help="none: no checkpoints (rank 0's peak memory of training alone)")
    ap.add_argument("--rounds", type=int, default=1, help="each cell's modes in turn this many times")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--save_steps", type=int, default=4)
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--port", type=int, default=29741)
    ap.add_argument("--workdir", help="(default: a temporary folder, deleted)")
    ap.add_argument("--shard_plan", action="store_true", help="print the bytes per rank of 7B / 70B checkpoints at "
                    "8-64 ranks (arithmetic) and exit")
    a = ap.parse_args()
    if a.shard_plan:
        shard_plan()
        return 0
    for path, what in ((a.model, "--model"), (a.data, "--data")):
        if not os.path.exists(path):
            sys.exit(f"{what} {path}: not found; run scripts/prepare_example.py first")
    work = a.workdir or tempfile.mkdtemp(prefix="ckpt-stall-")
    a.gathered = os.path.join(work, "fsdp_gathered.json")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(FT, "fsdp_config_full_shard.json")) as f:
        cfg = json.load(f)
    with open(a.gathered, "w") as f:
        json.dump({**cfg, "state_dict_type": "FULL_STATE_DICT"}, f)
    print(f"{a.nproc} processes, {a.steps} steps, a checkpoint every {a.save_steps}, micro batch 1 x "
          f"{a.max_length} tokens, fp32, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
    print("| cell | mode | blocked per save, s (median; each) | step s, no write | step s, write in flight | "
          "rank 0 peak GiB | checkpoint MiB | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for _ in range(a.rounds):
        for cell in a.cells:
            for mode in a.modes:
                if mode == "async" and cell in SYNC_ONLY:
                    continue
                r = run_cell(a, cell, mode, work)
                if not r:
                    continue
                each = ", ".join(f"{b:.2f}" for b in r["blocked"])
                print(f"| {cell} | {mode} | {med(r['blocked'])} ({each}) | {med(r['quiet'])} (n={len(r['quiet'])}) | "
                      f"{med(r['busy'])} (n={len(r['busy'])}) | {r['hwm0'] / GIB:.2f} | {r['size'] / MIB:.0f} | "
                      f"{r['wall']:.0f} |", flush=True)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from sft.cli import exit_process

    exit_process(main())  # a worker ends as finetune.py does
