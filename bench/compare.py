#!/usr/bin/env python
"""Side-by-side training throughput: ours vs. Qwen-style vs. TRL vs. LLaMA-Factory (a benchmark, not a test).

    .venv/bin/python bench/compare.py        # both tables: fp32 and bf16 (where fast), lengths 512 and 2048
    .venv/bin/python bench/compare.py --dtypes fp32 --max_lengths 512 --systems ours qwen-style trl
    .venv/bin/python bench/compare.py --scaling --dtypes fp32 --max_lengths 512   # + 1 vs 2 processes (torchrun)

Every system trains the same model (``--model``), on the same data (``--data``), with the same LoRA
(r, alpha, dropout, all linear projections), precision, maximum length, optimizer (AdamW, linear schedule,
no warm-up) and samples (each conversation once, cut at the max length: ours with ``--long_conversations
truncate``, as TRL and LLaMA-Factory do), each in a fresh process (so peak RSS is its own), and every system is
timed on the same conversations (``--timing epoch``, the default: two epochs over the first
``--epoch_conversations`` of ``--data``, the second timed; ``--timing steps``: ``--max_steps`` optimizer steps over
the first ``--max_conversations``, step 1 untimed, each system drawing its own conversations). One table per
dtype (``--dtypes``: fp32, and bf16 where :func:`sft.config.precision.auto_bf16` finds fast bf16; every system in
the same dtype), each with every length of ``--max_lengths``; the micro batch is ``--batch`` per length
(default: as many conversations as fill about one row of the length on average, round(length / mean sample),
at least 1: 2 at 512 and 3 at 2048 on the example's data), the packed systems' micro batch the rows that carry
about as many tokens (at least 1), so that a step's fixed cost weighs alike in every system; ``--rounds N`` runs the
systems N times interleaved and keeps each one's best round for the table, while the verdict on which of ours is
fastest is paired round by round (one layout is faster only when it is faster in every round;
:func:`compare_report.paired_verdict`):

* ``ours``          -- sft defaults: padding-free batches (``--padding_free True``: the micro batch's samples end to
  end in one row, attention per sample without a mask, :mod:`sft.model.attention`; LM head at supervised positions);
* ``ours-padded``   -- ``--padding_free False``: dynamic padding to the batch's longest sample (multiple of 8);
* ``ours-group``    -- ``--group_by_length True --padding_free False`` (length-grouped sampling, padded);
* ``ours-packing``  -- ``--packing True``: rows of up to the max length, attention per conversation, no mask;
* ``ours-packing-flat`` -- the packing path before :mod:`sft.model.attention`: the same rows flattened into one
  ``[1, total]`` row (``transformers.DataCollatorWithFlattening``) under plain ``sdpa`` with transformers' mask;
* ``qwen-style``    -- stand-in for Qwen's finetune.py: our pipeline with every sample padded to the max length;
* ``trl``           -- ``trl.SFTTrainer`` 1.16 defaults, ``assistant_only_loss=True``, no packing, the same LoRA
  via ``peft_config`` (the template gets ``{% generation %}`` markers, :func:`compare_peers.marked_chatml_template`);
* ``trl-best``      -- the same with :data:`compare_peers.TRL_BEST` (packing "bfd", padding-free) and the packed
  micro batch;
* ``llamafactory``  -- LLaMA-Factory 0.9.5 in ``.venv-llamafactory`` (``bash bench/setup_llamafactory.sh``),
  ``neat_packing: true`` (block-diagonal masks), the packed micro batch (bench/llamafactory_worker.py).

Measured per system over the timed steps (epoch 2, or steps 2..N): real (non-pad) tokens/s, padding
ratio, median step time, peak RSS (CUDA: max allocated) and MFU = required FLOPs / s / the matmul peak
measured here in the training dtype. Required FLOPs (the convention of :class:`sft.train.metrics.ThroughputCallback`,
the same for every system): 6 N per token for trained linear weights, 4 N for frozen ones, with the LM head's
counted per supervised token and the rest per real token. Also the live callback's tokens/s (ours, TRL),
preprocessing speed and, with ``--scaling``, 1 vs 2 processes with the same threads per process.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import compare_peers  # bench/compare_peers.py and bench/compare_report.py, beside this script (the script's
from compare_report import preprocessing, print_scaling, print_table  # folder is sys.path[0])

import sft  # noqa: F401  (first: holds library import notices that do not concern the run, see sft.logs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the example's .cache lives
EXAMPLE = os.path.join(ROOT, ".cache", "example")
SYSTEMS = ("ours", "ours-padded", "ours-group", "ours-packing", "ours-packing-flat", "qwen-style", "trl", "trl-best",
           "llamafactory")
PACKED = ("ours-packing", "ours-packing-flat", "trl-best", "llamafactory")  # micro batch = packed rows
DEFAULT_SYSTEMS = ("ours", "qwen-style", "trl", "trl-best", "llamafactory", "ours-packing", "ours-group")


# ----------------------------------------------------------------------------------------------- workers

def common_flags(a, system: str) -> list[str]:
    batch = a.packing_batch if system.startswith("ours-packing") else a.batch
    flags = ["--model_name_or_path", a.model, "--data_path", a.data, "--use_lora", "True", "--lora_r", str(a.lora_r),
             "--lora_alpha", str(2 * a.lora_r), "--lora_dropout", "0.05", "--per_device_train_batch_size", str(batch),
             "--gradient_accumulation_steps", "1", "--model_max_length", str(a.max_length),
             *(x for k, v in compare_peers.run_length(a).items() for x in (f"--{k}", str(v))),
             "--learning_rate", "2e-4", "--lr_scheduler_type", "linear", "--weight_decay", "0.0",
             "--optim", "adamw_torch", "--gradient_checkpointing", "False", "--seed", "0", "--logging_steps", "1",
             "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True", "--overwrite_output_dir", "True",
             "--data_cache_dir", a.cache, "--peak_tflops", str(a.peak_tflops), "--train_embeddings", "false",
             # the samples TRL and LLaMA-Factory train on: each conversation once, cut at the max length (our
             # default, split, makes shorter samples of the same conversations; docs/benchmarks.md)
             "--long_conversations", "truncate"]
    if a.bf16:
        flags += ["--bf16", "True"]
    flags += shlex.split(a.train_flags)  # bench/gpu_bench.py's rows (Q-LoRA, ZeRO-2, ...)
    if system == "ours-group":
        flags += ["--group_by_length", "True"]
    if system in ("ours-padded", "ours-group", "qwen-style"):
        flags += ["--padding_free", "False"]
    if system in ("ours-packing", "ours-packing-flat"):
        flags += ["--packing", "True"]
    return flags


def timed_steps(epochs: list[int], timing: str) -> list[int]:
    """Indices of the timed optimizer steps, given each step's epoch (1, 2, ...): with ``timing`` "epoch" the steps
    of epoch 2 (every conversation of ``--data`` once, in every system), else every step but the first.

    Raises:
        SystemExit: nothing is left to time (one step in all, or no second epoch).
    """
    keep = [i for i, e in enumerate(epochs) if e == 2] if timing == "epoch" else list(range(1, len(epochs)))
    if not keep:
        raise SystemExit(f"nothing to time: {len(epochs)} optimizer step(s) in epochs {sorted(set(epochs))} "
                         f"(--timing {timing})")
    return keep


class StepTimer:
    """Trainer callback: wall time of every optimizer step (on_step_begin -> on_step_end) and the epoch it belongs
    to (``epochs``, counted from 1 by on_epoch_begin)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.times, self.epochs, self._t, self._epoch = [], [], None, 0

            def on_epoch_begin(self, args, state, control, **kw):
                self._epoch += 1

            def on_step_begin(self, args, state, control, **kw):
                self._sync(args)
                self._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                self._sync(args)
                self.times.append(time.perf_counter() - self._t)
                self.epochs.append(self._epoch)

            @staticmethod
            def _sync(args):
                import torch

                if args.device.type == "cuda":
                    torch.cuda.synchronize()

        return _Timer()


def build_ours(a, system: str, out_dir: str):
    from transformers import DataCollatorForSeq2Seq

    from sft.app.train import trainer_for
    from sft.config.arguments import parse_args

    args = parse_args(common_flags(a, system) + ["--output_dir", out_dir])
    trainer, tok, _ = trainer_for(*args)
    if system == "qwen-style":  # every sample padded to model_max_length, as Qwen's preprocess() does
        trainer.data_collator = DataCollatorForSeq2Seq(tok, padding="max_length", max_length=a.max_length,
                                                       label_pad_token_id=-100, return_tensors="pt")
    if system == "ours-packing-flat":  # one [1, total] row per micro batch, transformers' block-diagonal mask
        from transformers import DataCollatorWithFlattening

        from sft.data.batches.packing import split_row

        flat = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
        trainer.data_collator = lambda rows: flat([c for r in rows for c in split_row(r)], return_tensors="pt")
        trainer.model.get_base_model().set_attn_implementation("sdpa")
    return trainer, {}


def compile_layers(model) -> int:
    """Regional compilation, as torchtitan and torchtune do it: ``torch.compile(dynamic=True)`` of every decoder layer
    (``nn.Module.compile``, in place), the rest eager. Its compile time falls in the first steps (reported as
    ``first_step_s``; a new micro-batch shape or document count can recompile later). Bench only (bench/gpu_bench.py's
    ``compiled`` row): no sft flag until it is measured faster (docs/benchmarks.md#regional-compilation).

    Returns:
        The number of layers compiled.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = base.get_decoder().layers
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def worker(a) -> int:
    import torch

    from sft.logs import setup_logging
    from sft.train.metrics import ThroughputCallback, attach, head_flops_per_token, model_flops_per_token

    setup_logging()
    out_dir = tempfile.mkdtemp(prefix=f"sft-compare-{a.worker}-")
    if a.worker in ("trl", "trl-best"):
        trainer, extra = compare_peers.build_trl(a, out_dir, best=a.worker == "trl-best")
        attach(trainer, a.peak_tflops)
    else:
        trainer, extra = build_ours(a, a.worker, out_dir)
        extra["attn"] = trainer.model.config._attn_implementation
        if a.compile_layers:
            extra["compiled_layers"] = compile_layers(trainer.model)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ThroughputCallback))
    timer = StepTimer()
    trainer.add_callback(timer)
    profile = StepProfile(a.profile_step) if a.profile_step else None
    if profile is not None:
        trainer.add_callback(profile)
    trainer.train()
    if len(cb.windows) != len(timer.times) or any(w["steps"] != 1 for w in cb.windows):
        raise SystemExit(f"expected one throughput window per optimizer step (--logging_steps 1): "
                         f"{len(cb.windows)} windows, {len(timer.times)} steps")
    keep = timed_steps(timer.epochs, a.timing)  # the warm-up (epoch 1, or step 1) left out
    wins = [cb.windows[i] for i in keep]
    t = [timer.times[i] for i in keep]
    real, total = sum(w["real"] for w in wins), sum(w["total"] for w in wins)
    rank = int(os.environ.get("RANK", "0"))
    if a.cuda:
        mem = torch.cuda.max_memory_allocated() / 2 ** 30
    else:
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    result = {
        "system": a.worker, "rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")), "steps": len(t),
        "real": real, "total": total, "supervised": sum(w["supervised"] for w in wins), "seconds": sum(t),
        "median_step_s": statistics.median(t), "peak_mem_gib": mem, "threads": torch.get_num_threads(),
        "load_peak_gib": (cb.load_peak or 0) / 2 ** 30,  # CUDA: peak_mem_gib is the training peak (reset after loading)
        "flops_per_token": model_flops_per_token(trainer.model),
        "head_flops_per_token": head_flops_per_token(trainer.model),
        "callback_tokens_per_s": real / sum(w["seconds"] for w in wins),
        "batch": trainer.args.per_device_train_batch_size, "first_step_s": timer.times[0], **extra,
    }
    if profile is not None and profile.result:
        result["profile"] = profile.result
    with open(f"{a.json}.{rank}", "w") as f:
        json.dump(result, f)
    return 0


# ------------------------------------------------------------------------------------------ orchestration

def worker_argv(a, system: str, json_path: str) -> list[str]:
    argv = [os.path.abspath(__file__), "--worker", system, "--json", json_path, "--model", a.model, "--data", a.data,
            "--max_steps", str(a.max_steps), "--timing", a.timing, "--batch", str(a.batch), "--packing_batch",
            str(a.packing_batch), "--max_length", str(a.max_length), "--lora_r", str(a.lora_r), "--cache", a.cache,
            "--peak_tflops", str(a.peak_tflops), f"--train_flags={a.train_flags}"]
    return argv + (["--bf16"] if a.bf16 else [])


def run_system(a, system: str, nproc: int = 1, threads: int | None = None, tag: str = "") -> list[dict]:
    """Run one system in fresh process(es) for the current dtype and length (``a.bf16``, ``a.max_length``,
    ``a.batch``, ``a.packing_batch``); return each rank's result dict ([] when it failed: the log is printed)."""
    json_path = os.path.join(a.work, f"{system}-{'bf16' if a.bf16 else 'fp32'}-{a.max_length}{tag}-{nproc}.json")
    if a.reuse and all(os.path.exists(f"{json_path}.{r}") for r in range(nproc)):
        return [json.load(open(f"{json_path}.{r}")) for r in range(nproc)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if nproc == 1:
        cmd = [sys.executable, *worker_argv(a, system, json_path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               *worker_argv(a, system, json_path)]
    t0 = time.perf_counter()
    log = f"{json_path}.log"
    with open(log, "w") as f:
        if system == "llamafactory":
            p = compare_peers.run_llamafactory(a, json_path, f)
        else:
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    if isinstance(p, str):
        print(f"{system}: {p}", file=sys.stderr)
        a.failures[system] = p
        return []
    if p.returncode != 0:
        tail = open(log).read()[-3000:]
        # a negative code is the signal that ended it (-9: the kernel's OOM killer, among others): say so, as the
        # log's last line then tells nothing of why
        why = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
        print(f"{system} (nproc {nproc}) failed ({why}); last lines of {log}:\n{tail}", file=sys.stderr)
        a.failures[system] = f"{why}: " + (tail.strip().splitlines() or ["?"])[-1][:160]
        return []
    results = [json.load(open(f"{json_path}.{r}")) for r in range(nproc)]
    for r in results:
        r["wall_s"] = time.perf_counter() - t0
    return results


def rate(result: list[dict]) -> float:
    """Real tokens/s of one run (rank 0's result; 0.0 for a failed run)."""
    return result[0]["real"] / result[0]["seconds"] if result else 0.0


def best_rounds(a, rounds: dict) -> dict:
    """Per (dtype, length, system) the round with the most real tokens/s (the one least slowed by other load, as
    ``timeit`` takes the minimum time); with several rounds it prints every round's rate first."""
    if a.rounds > 1:
        print("rounds (real tokens/s; the table takes the best):")
        for (dtype, length, system), runs in rounds.items():
            print(f"  {dtype} {length} {system}: " + ", ".join(f"{rate(r):.1f}" if r else "failed" for r in runs))
    return {key: max(runs, key=rate) for key, runs in rounds.items()}


def first_conversations(path: str, n: int, work: str) -> str:
    """A JSONL copy of the first ``n`` records of the JSONL file ``path`` in ``work``; returns its path.

    Raises:
        SystemExit: ``path`` is not a ``.jsonl`` file (pass ``--max_conversations 0`` to use it whole).
    """
    if not path.endswith(".jsonl"):
        raise SystemExit(f"error: --max_conversations needs a .jsonl --data file, got {path}; pass "
                         "--max_conversations 0 to train on it whole")
    out = os.path.join(work, f"first-{n}-" + os.path.basename(path))
    with open(path, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        lines = (line for line in src if line.strip())
        for _, line in zip(range(n), lines):
            dst.write(line)
    return out


def per_length(a, values: list[int] | None) -> dict:
    """``{length: value}`` for a flag given once for every ``--max_lengths`` entry or once per entry ({} if not
    given)."""
    if not values:
        return {}
    return dict(zip(a.max_lengths, values * len(a.max_lengths) if len(values) == 1 else values))


def mean_tokens_per_conversation(a) -> float:
    """Mean tokens per training sample after truncation at ``a.max_length`` (decides the packed micro batch)."""
    from sft.data.records.records import load_conversations
    from sft.data.template.chat import encode_conversations
    from sft.model.loading import load_tokenizer

    tok, eot, _ = load_tokenizer(a.model)
    convs = load_conversations(a.data, "error")
    lengths = [min(len(i), a.max_length) for i, _ in encode_conversations(tok, [c.messages for c in convs], eot)]
    return sum(lengths) / len(lengths)


def matmul_peaks(device) -> dict:
    import torch

    from sft.train.metrics import measure_matmul_peak

    return {name: measure_matmul_peak(dtype, device, seconds=1.0)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}


def best_peaks(path: str, device, reuse: bool) -> dict:
    """Matmul peaks (FLOP/s) per dtype: the best of a new measurement and, with ``reuse``, those in ``path``;
    writes them to ``path`` and prints them."""
    peaks = matmul_peaks(device)
    print(f"matmul peak measured now on {device}: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 "
          f"{peaks['bf16'] / 1e9:.1f} GFLOP/s (load {os.getloadavg()[0]:.2f})")
    if reuse and os.path.exists(path):
        peaks = {k: max(v, json.load(open(path)).get(k, 0.0)) for k, v in peaks.items()}
    with open(path, "w") as f:
        json.dump(peaks, f)
    print(f"matmul peak used (best seen): fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s")
    return peaks


class StepProfile:
    """Trainer callback: ``torch.profiler`` over optimizer step ``step`` (1-based) only; ``result`` then holds the
    step's wall seconds, the device's kernel seconds (CUDA; 0 on CPU), the kernel launches (CUDA runtime
    ``cudaLaunchKernel`` / ``cuLaunchKernel`` calls; 0 on CPU) and the aten operator calls (CPU side)."""

    def __new__(cls, step: int):
        from transformers import TrainerCallback

        class _Profile(TrainerCallback):
            def __init__(self):
                self.step, self.result, self._prof, self._t = step, None, None, None

            def on_step_begin(self, args, state, control, **kw):
                import torch

                if state.global_step + 1 != self.step:
                    return
                acts = [torch.profiler.ProfilerActivity.CPU]
                if args.device.type == "cuda":
                    torch.cuda.synchronize()
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self._prof = torch.profiler.profile(activities=acts)
                self._prof.__enter__()
                self._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                import torch

                if self._prof is None:
                    return
                if args.device.type == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - self._t
                self._prof.__exit__(None, None, None)
                events = self._prof.events()
                device_us = sum(e.self_device_time_total for e in events
                                if e.device_type == torch.autograd.DeviceType.CUDA)
                launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                "cudaLaunchKernelExC", "cuLaunchKernelEx"))
                ops = sum(1 for e in events if e.name.startswith("aten::"))
                self.result = {"step": self.step, "wall_s": wall, "device_s": device_us / 1e6, "launches": launches,
                               "aten_ops": ops}
                self._prof = None

        return _Profile()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=os.path.join(EXAMPLE, "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    p.add_argument("--timing", choices=("epoch", "steps"), default="epoch", help="epoch: every system trains two "
                   "epochs over the same --epoch_conversations conversations and the second epoch is timed (every "
                   "system times the same conversations); steps: --max_steps optimizer steps, the first one not timed "
                   "(each system's steps draw their own conversations)")
    p.add_argument("--epoch_conversations", type=int, nargs="*", default=None, help="--timing epoch: conversations "
                   "per epoch (the first ones of the --max_conversations), one per --max_lengths entry or one for all "
                   "(default: --epoch_batches unpacked micro batches of the length)")
    p.add_argument("--epoch_batches", type=int, default=6, help="--timing epoch without --epoch_conversations: "
                   "the epoch holds this many micro batches of the unpacked systems")
    p.add_argument("--max_steps", type=int, default=3, help="--timing steps: optimizer steps per system (first one "
                   "is warm-up)")
    p.add_argument("--max_lengths", type=int, nargs="+", default=[512, 2048],
                   help="model_max_length / Qwen-style padded length / TRL max_length / LLaMA-Factory cutoff_len")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"),
                   help="one table per dtype; bf16 only where sft.config.precision.auto_bf16 finds fast bf16")
    p.add_argument("--batch", type=int, nargs="*", default=None, help="micro batch (conversations) per device, one "
                   "per --max_lengths entry or one for all (default: the conversations that fill about one row of "
                   "the length on average, round(length / mean sample), at least 1)")
    p.add_argument("--rounds", type=int, default=1, help="run the systems this many times, interleaved; the table "
                   "takes each system's best round, the verdict on which of ours is fastest compares them round by "
                   "round (faster only in every round; otherwise level)")
    p.add_argument("--packing_batch", type=int, default=0, help="rows per micro batch with packing (0: about the "
                   "same tokens as --batch conversations, at least 1)")
    p.add_argument("--max_conversations", type=int, default=400, help="train on the first N conversations of --data "
                   "(a JSONL copy in --work; 0: all): enough for every step, and each system's own data preparation "
                   "(tokenizing, packing) at start-up stays short")
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha = 2 r, dropout 0.05, all linear layers)")
    p.add_argument("--llamafactory_template", default="smollm2", help="LLaMA-Factory's template name for --model")
    p.add_argument("--scaling", action="store_true", help="also run ours with 1 and 2 processes (first dtype, length)")
    p.add_argument("--skip_preprocessing", action="store_true")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "sft-compare-cache"))
    p.add_argument("--work", help="folder for each run's JSON result (default: a new temporary folder)")
    p.add_argument("--reuse", action="store_true", help="take a system's result from --work if it is there")
    p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)  # worker: train in bf16
    p.add_argument("--max_length", type=int, default=512, help=argparse.SUPPRESS)  # worker
    p.add_argument("--peak_tflops", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--train_flags", default="", help=argparse.SUPPRESS)  # worker: extra sft flags (one string)
    p.add_argument("--compile_layers", action="store_true", help=argparse.SUPPRESS)  # worker: compile_layers()
    p.add_argument("--profile_step", type=int, default=0, help=argparse.SUPPRESS)  # worker: profile this step (0: none)
    a = p.parse_args(argv)
    import torch

    a.cuda = torch.cuda.is_available()
    if a.worker:
        a.batch = a.batch[0]
    else:
        for name in ("batch", "epoch_conversations"):
            given = getattr(a, name)
            if given and len(given) not in (1, len(a.max_lengths)):
                p.error(f"--{name} takes one value or one per --max_lengths entry ({len(a.max_lengths)}); "
                        f"got {len(given)}")
            if given and min(given) < 1:
                p.error(f"--{name} must be at least 1, got {min(given)}")
    a.failures = {}
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    if a.timing == "steps" and a.max_steps < 2:
        print("error: --max_steps must be at least 2 (step 1 is warm-up)", file=sys.stderr)
        return 2
    if a.epoch_batches < 1:
        print(f"error: --epoch_batches must be at least 1, got {a.epoch_batches}", file=sys.stderr)
        return 2
    if a.rounds < 1:
        print(f"error: --rounds must be at least 1, got {a.rounds}", file=sys.stderr)
        return 2
    import torch

    from sft.config.precision import auto_bf16

    device = "cuda" if a.cuda else "cpu"
    name = torch.cuda.get_device_name() if a.cuda else f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}; LLaMA-Factory {compare_peers.llamafactory_version()}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    # every system runs under the allocator finetune/launch.sh gives ours (tcmalloc on CPU when installed;
    # SFT_ALLOCATOR=glibc for the C library's): the table compares steps, not allocators
    from sft.distributed.allocator import choose_allocator
    from sft.errors import SFTError

    try:
        allocator, preload = choose_allocator(os.environ, device)
    except SFTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.update(preload)
    print(f"allocator (every system): {allocator}")
    a.work = a.work or tempfile.mkdtemp(prefix="sft-compare-")
    os.makedirs(a.work, exist_ok=True)
    print(f"results of each run: {a.work}", flush=True)
    # The peak is the best matmul rate seen: measured before and after the runs (and taken from --work with
    # --reuse), so that a load from other processes during one measurement does not lower it and inflate MFU.
    peaks_path = os.path.join(a.work, "matmul-peaks.json")
    peaks = best_peaks(peaks_path, torch.device(device), a.reuse)
    dtypes = list(dict.fromkeys(a.dtypes))
    if "bf16" in dtypes:
        fast, why = auto_bf16(cuda=a.cuda)
        print(f"bf16: {'fast' if fast else 'not fast'} ({why})")
        if not fast:
            dtypes.remove("bf16")
    if a.max_conversations:
        a.data = first_conversations(a.data, a.max_conversations, a.work)
    full_data = a.data
    given, epoch_given = per_length(a, a.batch), per_length(a, a.epoch_conversations)
    batches, packing, data = {}, {}, {}
    for a.max_length in a.max_lengths:
        mean = mean_tokens_per_conversation(a)
        # by default a step carries about one full row of the length in every system: the unpacked systems as many
        # conversations as fill it on average, the packed ones one row (a step's fixed cost weighs alike)
        batches[a.max_length] = given.get(a.max_length) or max(1, round(a.max_length / mean))
        packing[a.max_length] = a.packing_batch or max(1, round(batches[a.max_length] * mean / a.max_length))
        data[a.max_length] = a.data
        if a.timing == "epoch":  # every system's timed epoch: the same first N conversations
            n = epoch_given.get(a.max_length) or a.epoch_batches * batches[a.max_length]
            if a.max_conversations and n > a.max_conversations:
                print(f"error: an epoch of {n} conversations at length {a.max_length} needs --max_conversations "
                      f"{n} or more (it is {a.max_conversations})", file=sys.stderr)
                return 2
            data[a.max_length] = first_conversations(a.data, n, a.work)
        print(f"length {a.max_length}: mean sample {mean:.0f} tokens; micro batch {batches[a.max_length]}; packed "
              f"micro batch {packing[a.max_length]} row(s) of <= {a.max_length} tokens"
              + (f"; epoch: the first {n} conversations" if a.timing == "epoch" else ""))
    timing = ("2 epochs per system over the same conversations (epoch 1 not timed)" if a.timing == "epoch" else
              f"{a.max_steps} optimizer steps per system (step 1 not timed)")
    print(f"model {a.model}\ndata {a.data}\nLoRA r={a.lora_r} alpha={2 * a.lora_r} dropout 0.05 all-linear; "
          f"{timing}; systems {' '.join(a.systems)}")
    rounds, t_all = {}, time.perf_counter()
    for dtype in dtypes:
        a.bf16 = dtype == "bf16"
        a.peak_tflops = peaks[dtype] / 1e12
        for a.max_length in a.max_lengths:
            a.batch, a.packing_batch, a.data = batches[a.max_length], packing[a.max_length], data[a.max_length]
            for rnd in range(a.rounds):  # rounds interleaved: a changing load touches every system alike
                for system in a.systems:
                    t0 = time.perf_counter()
                    got = run_system(a, system, tag=f"-round{rnd + 1}" if a.rounds > 1 else "")
                    rounds.setdefault((dtype, a.max_length, system), []).append(got)
                    print(f"  ran {system} ({dtype}, length {a.max_length}"
                          f"{f', round {rnd + 1}' if a.rounds > 1 else ''})"
                          f" in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    a.data = full_data  # preprocessing figures: every --max_conversations conversation
    print(f"all systems ran in {time.perf_counter() - t_all:.0f} s")
    results = best_rounds(a, rounds)
    peaks = best_peaks(peaks_path, torch.device(device), True)
    for dtype in dtypes:
        print_table(a, dtype, results, peaks, {key: [rate(r) for r in runs] for key, runs in rounds.items()})
    if not a.skip_preprocessing:
        print("\npreprocessing (conversations/s):")
        for label, per_s in preprocessing(a):
            print(f"  {label:<66}{per_s:10.0f}")
    if a.scaling and a.cuda and torch.cuda.device_count() < 2:
        print("\nscaling: 2 processes need 2 GPUs (one per process); skipped")
    elif a.scaling:
        a.bf16, a.max_length = dtypes[0] == "bf16", a.max_lengths[0]
        a.batch, a.packing_batch, a.peak_tflops = batches[a.max_length], packing[a.max_length], peaks[dtypes[0]] / 1e12
        a.data = data[a.max_length]  # the timed conversations of that length (--timing epoch)
        threads = max(1, (os.cpu_count() or 2) // 2) if not a.cuda else None
        one = run_system(a, "ours", 1, threads, "-scaling")
        two = run_system(a, "ours", 2, threads, "-scaling")
        print_scaling(a, one, two)
    return 0


if __name__ == "__main__":
    sys.exit(main())
