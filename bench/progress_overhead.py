#!/usr/bin/env python
"""What the hang and straggler watch costs a training step (a benchmark, not a test; issue 33: below 1%).

    PYTHONPATH=. .venv/bin/python bench/progress_overhead.py    # parts, then 3 alternating A/B rounds of 2 processes
    .venv/bin/python bench/progress_overhead.py --rounds 0      # the parts only (seconds)

The end-to-end rounds train the tests' tiny Qwen2 model (``tests/helpers/assets.py``: run from the repository root
with ``PYTHONPATH=.``).

Prints, side by side in one run:

1. **The training thread's part per optimizer step**: the phase marks and forward hooks of
   :class:`sft.train.stragglers.ProgressCallback` (two forward passes per step -- gradient accumulation 2 --, the
   optimizer and step-end marks, the window's sum), timed over 20,000 simulated steps around a no-op module, in
   microseconds per step.
2. **The watcher thread's part per beat**: one :meth:`sft.distributed.watchdog.Watcher.poll` (publish this rank's
   beat, read every rank's with one ``multi_get``, judge) over a real ``TCPStore`` on loopback for 2, 8 and 64
   ranks, in microseconds; it runs every ``interval`` seconds (a tenth of ``--hang_timeout``, 0.5-5 s) on another
   thread, so its share of the training thread is at most that time divided by the interval (the GIL).
3. **End to end** (``--rounds`` N > 0): the same 2-process LoRA training under ``finetune/launch.sh`` (torchrun,
   gloo, CPU) with the watch off (``--hang_timeout 0 --straggler_factor 0``) and on (the defaults, with
   ``--hang_timeout 20`` so that beats come every 2 s), alternating, N rounds; seconds per optimizer step from the
   Trainer's ``train_runtime``. On a CPU this is noisier than the overhead itself; the parts above bound it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def training_thread_us(steps: int = 20000) -> float:
    import torch
    from transformers import TrainerControl, TrainerState

    from sft.train.stragglers import ProgressCallback

    class Noop(torch.nn.Module):
        def forward(self, input_ids=None):
            return input_ids

    model = Noop().train()
    cb = ProgressCallback(model, factor=1.5, window=20)
    state, control = TrainerState(), TrainerControl()
    ids = torch.zeros(1, 512, dtype=torch.long)
    cb.on_train_begin(None, state, control)

    def loop(n, hooked):
        t0 = time.perf_counter()
        for k in range(n):
            for _ in range(2):
                model(input_ids=ids)
            if hooked:
                cb.on_pre_optimizer_step(None, state, control)
                state.global_step = k + 1
                cb.on_step_end(None, state, control)
        return time.perf_counter() - t0

    with_hooks = min(loop(steps, True) for _ in range(3))
    cb.on_train_end(None, state, control)
    without = min(loop(steps, False) for _ in range(3))
    return 1e6 * (with_hooks - without) / steps


def watcher_poll_us(ranks: int, polls: int = 200) -> float:
    import torch.distributed as dist

    from sft.distributed.watchdog import Record, Watcher

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    for r in range(1, ranks):  # the other ranks' beats, as they would have published them
        server.set(f"sft/progress/bench/{r}", json.dumps({"rank": r, "host": "h", "pid": r, "node_rank": 0,
                                                          "local_rank": r, "step": 1, "phase": "forward and backward",
                                                          "waiting": None, "since": 0.0, "seq": 1, "tick": 1,
                                                          "work": {"rate": 1.0, "n": 20, "first": 1, "last": 20}}))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    w = Watcher(client, "bench", 0, ranks, timeout_s=300, interval_s=5, record=Record(),
                identity={"host": "h", "pid": os.getpid(), "node_rank": 0, "local_rank": 0})
    w.poll(time.monotonic())  # the first poll finds the keys one by one
    t0 = time.perf_counter()
    for _ in range(polls):
        w.poll(time.monotonic())
    return 1e6 * (time.perf_counter() - t0) / polls


def end_to_end(rounds: int, steps: int) -> dict:
    from tests.helpers import assets
    from tests.helpers.data import TOY, write_jsonl

    model = assets.tiny_qwen2_dir()
    tmp = tempfile.mkdtemp(prefix="sft-progress-bench-")
    data = write_jsonl(os.path.join(tmp, "toy.jsonl"), [dict(r, id=f"{r['id']}-{k}") for k in range(10) for r in TOY])
    arms = {"off": ["--hang_timeout", "0", "--straggler_factor", "0"], "on": ["--hang_timeout", "20"]}
    out: dict = {k: [] for k in arms}
    for i in range(rounds):
        for arm, flags in arms.items():
            folder = os.path.join(tmp, f"{arm}-{i}")
            env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1", MASTER_PORT=str(6200 + i))
            cmd = ["bash", os.path.join(ROOT, "finetune", "finetune_lora_single_gpu.sh"), "-m", model, "-d", data,
                   "--output_dir", folder, "--max_steps", str(steps), "--lora_r", "4", "--per_device_train_batch_size",
                   "4", "--gradient_accumulation_steps", "1", "--save_strategy", "no", "--disable_tqdm", "True",
                   "--logging_steps", "10", "--report_to", "none", *flags]
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            state = json.load(open(os.path.join(folder, "trainer_state.json")))
            runtime = next(h["train_runtime"] for h in state["log_history"] if "train_runtime" in h)
            out[arm].append(runtime / steps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating end-to-end A/B rounds (0: the parts only)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per end-to-end run")
    a = p.parse_args(argv)
    print(f"training thread: {training_thread_us():.1f} us per optimizer step (2 micro batches: phase marks, forward "
          "hooks and timer, the window)")
    for n in (2, 8, 64):
        us = watcher_poll_us(n)
        print(f"watcher: {us:.0f} us per beat with {n} ranks (publish + one multi_get + judge); every 5 s (default "
              f"--hang_timeout 300): {100 * us / 5e6:.4f}% of a core; every 0.5 s: {100 * us / 5e5:.3f}%")
    if a.rounds:
        try:
            import tests.helpers.assets  # noqa: F401
        except ImportError:
            print("error: the end-to-end rounds need the tests' model helpers: run from the repository root with "
                  "PYTHONPATH=. (or pass --rounds 0)", file=sys.stderr)
            return 2
        e2e = end_to_end(a.rounds, a.steps)
        off, on = statistics.median(e2e["off"]), statistics.median(e2e["on"])
        print(f"end to end (2 processes, CPU, {a.steps} steps, {a.rounds} alternating rounds): off "
              f"{1000 * off:.1f} ms/step {[round(1000 * x, 1) for x in e2e['off']]}, on {1000 * on:.1f} ms/step "
              f"{[round(1000 * x, 1) for x in e2e['on']]}: {100 * (on - off) / off:+.1f}% (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
