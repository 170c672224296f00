#!/usr/bin/env python
"""Side-by-side training throughput: ours vs. the Qwen-style pipeline vs. TRL's SFTTrainer (a benchmark, not a test).

    .venv/bin/python bench/compare.py                      # the table (built-in example: SmolLM2 + chitchat)
    .venv/bin/python bench/compare.py --scaling            # + 1 vs 2 processes (torchrun, gloo on CPU)
    .venv/bin/python bench/compare.py --max_steps 8 --systems ours qwen-style trl

Every system trains the same model (``--model``), on the same data (``--data``), with the same LoRA
(r, alpha, dropout, all linear projections), precision (fp32 on CPU, bf16 on CUDA), micro batch,
maximum length, optimizer (AdamW, linear schedule, no warm-up) and number of optimizer steps, each in
a fresh process (so peak RSS is its own):

* ``ours``          -- sft defaults: padding-free batches (``--padding_free True``: the micro batch's samples end to
  end in one row, attention per sample without a mask, :mod:`sft.attention`);
* ``ours-padded``   -- ``--padding_free False``: dynamic padding to the batch's longest sample (multiple of 8);
* ``ours-group``    -- ``--group_by_length True --padding_free False`` (length-grouped sampling, padded);
* ``ours-packing``  -- ``--packing True``: rows of up to ``--max_length`` tokens, one row per packed row, attention
  per conversation with no mask (:mod:`sft.attention`); the micro batch is set to carry about as many tokens as
  the others' (printed);
* ``ours-packing-flat`` -- the packing path before :mod:`sft.attention`, for comparison: the same rows flattened
  into one ``[1, total]`` row (``transformers.DataCollatorWithFlattening``) under plain ``sdpa``, whose
  block-diagonal mask transformers builds from the position ids;
* ``qwen-style``    -- stand-in for Qwen's finetune.py: our pipeline with every sample padded to
  ``--max_length`` (``DataCollatorForSeq2Seq(padding="max_length")``), all else equal;
* ``trl``           -- ``trl.SFTTrainer`` from PyPI, ``assistant_only_loss=True``, ``max_length`` equal, no
  packing, the same LoRA via ``peft_config``. SmolLM2's template has no ``{% generation %}`` markers, so the
  benchmark gives TRL the same template with markers around each reply and its end-of-turn token
  (:func:`marked_chatml_template`) and checks that TRL's tokens and assistant mask equal ours.

Measured per system, over optimizer steps 2..N (step 1 is warm-up): real (non-pad) tokens/s, padding
ratio, median step time, peak RSS (CUDA: max allocated) and MFU = FLOPs/token x real tokens/s / the
matmul peak measured here in the training dtype (FLOP convention in :mod:`sft.callbacks`: 6 N per token
for trained linear weights, 4 N for frozen ones; LoRA = 4 N_frozen + 6 N_adapters). The live callback's own
tokens/s (:class:`sft.callbacks.ThroughputCallback`, logging every step) is printed next to the
benchmark's for comparison. Also: preprocessing speed (ours vs. a plain batched ``tokenizer()``, with
``num_proc`` 1 and 2) and, with ``--scaling``, 1 vs 2 processes with the same threads per process.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import sft  # noqa: F401  (first: holds library import notices that do not concern the run, see sft.logs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the example's .cache lives
EXAMPLE = os.path.join(ROOT, ".cache", "example")
SYSTEMS = ("ours", "ours-padded", "ours-group", "ours-packing", "ours-packing-flat", "qwen-style", "trl")


def marked_chatml_template(template: str) -> str:
    """The ChatML-style template of SmolLM2/Qwen with TRL's ``{% generation %}`` markers around each
    assistant reply and its ``<|im_end|>`` (the text it renders is unchanged).

    Raises:
        ValueError: the template is not the ChatML loop this rewrite knows.
    """
    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    if turn not in template:
        raise ValueError("not a ChatML-style template with the expected turn expression; give TRL a template with "
                         "{% generation %} markers yourself")
    marked = ("{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
              "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}" + turn + "{% endif %}")
    return template.replace(turn, marked)


# ----------------------------------------------------------------------------------------------- workers

def common_flags(a, system: str) -> list[str]:
    batch = a.packing_batch if system.startswith("ours-packing") else a.batch
    flags = ["--model_name_or_path", a.model, "--data_path", a.data, "--use_lora", "True", "--lora_r", str(a.lora_r),
             "--lora_alpha", str(2 * a.lora_r), "--lora_dropout", "0.05", "--per_device_train_batch_size", str(batch),
             "--gradient_accumulation_steps", "1", "--model_max_length", str(a.max_length), "--max_steps",
             str(a.max_steps), "--learning_rate", "2e-4", "--lr_scheduler_type", "linear", "--weight_decay", "0.0",
             "--optim", "adamw_torch", "--gradient_checkpointing", "False", "--seed", "0", "--logging_steps", "1",
             "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True", "--overwrite_output_dir", "True",
             "--data_cache_dir", a.cache, "--peak_tflops", str(a.peak_tflops), "--train_embeddings", "false"]
    if a.bf16:
        flags += ["--bf16", "True"]
    if system == "ours-group":
        flags += ["--group_by_length", "True"]
    if system in ("ours-padded", "ours-group", "qwen-style"):
        flags += ["--padding_free", "False"]
    if system in ("ours-packing", "ours-packing-flat"):
        flags += ["--packing", "True"]
    return flags


class StepTimer:
    """Trainer callback: wall time of every optimizer step (on_step_begin -> on_step_end)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.times, self._t = [], None

            def on_step_begin(self, args, state, control, **kw):
                self._sync(args)
                self._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                self._sync(args)
                self.times.append(time.perf_counter() - self._t)

            @staticmethod
            def _sync(args):
                import torch

                if args.device.type == "cuda":
                    torch.cuda.synchronize()

        return _Timer()


def build_ours(a, system: str, out_dir: str):
    from transformers import DataCollatorForSeq2Seq

    from sft.arguments import parse_args, validate
    from sft.distributed.process_group import setup_runtime
    from sft.training import build_trainer

    args = parse_args(common_flags(a, system) + ["--output_dir", out_dir])
    validate(*args)
    setup_runtime(args[2])
    trainer, tok, _ = build_trainer(*args)
    if system == "qwen-style":  # every sample padded to model_max_length, as Qwen's preprocess() does
        trainer.data_collator = DataCollatorForSeq2Seq(tok, padding="max_length", max_length=a.max_length,
                                                       label_pad_token_id=-100, return_tensors="pt")
    if system == "ours-packing-flat":  # one [1, total] row per micro batch, transformers' block-diagonal mask
        from transformers import DataCollatorWithFlattening

        from sft.packing import split_row

        flat = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
        trainer.data_collator = lambda rows: flat([c for r in rows for c in split_row(r)], return_tensors="pt")
        trainer.model.get_base_model().set_attn_implementation("sdpa")
    return trainer, {}


def build_trl(a, out_dir: str):
    import datasets
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from sft.chat import IGNORE_INDEX, encode_conversations
    from sft.data import load_conversations
    from sft.modeling import load_model, load_tokenizer, torch_dtype

    tok, eot, grew = load_tokenizer(a.model)  # same pad token and template as ours
    ours_tok_template = tok.chat_template
    tok.chat_template = marked_chatml_template(ours_tok_template)
    model, _ = load_model(a.model, tok, grew, dtype=torch_dtype(bf16=a.bf16))
    convs = load_conversations(a.data, "error")
    ds = datasets.Dataset.from_list([{"messages": c.messages} for c in convs])
    cfg = SFTConfig(output_dir=out_dir, max_length=a.max_length, assistant_only_loss=True, packing=False,
                    padding_free=False, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                    learning_rate=2e-4, lr_scheduler_type="linear", weight_decay=0.0, optim="adamw_torch",
                    max_steps=a.max_steps, logging_steps=1, save_strategy="no", report_to="none", bf16=a.bf16,
                    gradient_checkpointing=False, seed=0, disable_tqdm=True, use_cpu=not a.cuda)
    peft_config = LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=0.05, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=peft_config)
    # equivalence check: TRL's tokens and assistant mask vs. ours on the first 200 conversations
    n = min(200, len(convs))
    tok.chat_template = ours_tok_template
    ours = encode_conversations(tok, [c.messages for c in convs[:n]], eot)
    cols = trainer.train_dataset.column_names
    key = next((k for k in ("labels", "assistant_masks", "completion_mask") if k in cols), None)
    if key is None:
        return trainer, {"trl_same_tokens_and_mask": f"not checked: no mask column in TRL's dataset ({cols})"}
    same = 0
    for (ids, labels), row in zip(ours, trainer.train_dataset.select(range(n))):
        mask = [int(x != IGNORE_INDEX) for x in labels][:a.max_length]
        theirs = [int(x != IGNORE_INDEX) for x in row[key]] if key == "labels" else list(row[key])  # trl 1.16: labels
        same += row["input_ids"] == ids[:a.max_length] and theirs == mask
    return trainer, {"trl_same_tokens_and_mask": f"{same}/{n}"}


def worker(a) -> int:
    import torch

    from sft.callbacks import ThroughputCallback, install, model_flops_per_token
    from sft.logs import setup_logging

    setup_logging()
    out_dir = tempfile.mkdtemp(prefix=f"sft-compare-{a.worker}-")
    if a.worker == "trl":
        trainer, extra = build_trl(a, out_dir)
        install(trainer, a.peak_tflops)
    else:
        trainer, extra = build_ours(a, a.worker, out_dir)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ThroughputCallback))
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    wins = cb.windows[1:]  # step 1 (warm-up) left out, like the step timer's first step
    t = timer.times[1:]
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
        "flops_per_token": model_flops_per_token(trainer.model),
        "callback_tokens_per_s": real / sum(w["seconds"] for w in wins),
        "batch": trainer.args.per_device_train_batch_size, **extra,
    }
    with open(f"{a.json}.{rank}", "w") as f:
        json.dump(result, f)
    return 0


# ------------------------------------------------------------------------------------------ orchestration

def worker_argv(a, system: str, json_path: str) -> list[str]:
    argv = [os.path.abspath(__file__), "--worker", system, "--json", json_path, "--model", a.model, "--data", a.data,
            "--max_steps", str(a.max_steps), "--batch", str(a.batch), "--packing_batch", str(a.packing_batch),
            "--max_length", str(a.max_length), "--lora_r", str(a.lora_r), "--cache", a.cache,
            "--peak_tflops", str(a.peak_tflops)]
    return argv + (["--bf16"] if a.bf16 else [])


def run_system(a, system: str, nproc: int = 1, threads: int | None = None, tag: str = "") -> list[dict]:
    """Run one system in fresh process(es); return each rank's result dict."""
    json_path = os.path.join(a.work, f"{system}{tag}-{nproc}.json")
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
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        print(f"{system} (nproc {nproc}) failed (exit {p.returncode}); last lines of {log}:\n"
              f"{open(log).read()[-3000:]}", file=sys.stderr)
        return []
    results = [json.load(open(f"{json_path}.{r}")) for r in range(nproc)]
    for r in results:
        r["wall_s"] = time.perf_counter() - t0
    return results


def mean_tokens_per_conversation(a) -> float:
    """Mean tokens per training sample after truncation (decides the packed micro batch)."""
    from sft.chat import encode_conversations
    from sft.data import load_conversations
    from sft.modeling import load_tokenizer

    tok, eot, _ = load_tokenizer(a.model)
    convs = load_conversations(a.data, "error")
    lengths = [min(len(i), a.max_length) for i, _ in encode_conversations(tok, [c.messages for c in convs], eot)]
    return sum(lengths) / len(lengths)


def matmul_peaks(device) -> dict:
    import torch

    from sft.callbacks import measure_matmul_peak

    return {name: measure_matmul_peak(dtype, device, seconds=1.0)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}


def preprocessing(a) -> list[tuple[str, float]]:
    """Conversations/s: our rendering + masking vs. rendering + one plain batched tokenizer() call; our full
    dataset preparation (stream, validate, Arrow shard) with 1 and 2 worker processes."""
    from sft.chat import encode_conversations
    from sft.data import load_conversations
    from sft.dataset import build_dataset
    from sft.modeling import load_tokenizer

    tok, eot, _ = load_tokenizer(a.model)
    convs = load_conversations(a.data, "error")
    msgs = [c.messages for c in convs]
    out = []
    t0 = time.perf_counter()
    encode_conversations(tok, msgs, eot)
    out.append(("ours: render + ids + labels (one batched call)", len(msgs) / (time.perf_counter() - t0)))
    t0 = time.perf_counter()
    texts = [tok.apply_chat_template(m, tokenize=False) for m in msgs]
    t1 = time.perf_counter()
    tok(texts, add_special_tokens=False)
    t2 = time.perf_counter()
    out.append(("plain: render + batched tokenizer(), no labels", len(msgs) / (t2 - t0)))
    out.append(("plain: batched tokenizer() on rendered texts only", len(msgs) / (t2 - t1)))
    for num_proc in (1, 2):
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            build_dataset([a.data], tok, eot, a.max_length, None, cache, num_proc if num_proc > 1 else None)
            out.append((f"ours: full dataset preparation (stream + Arrow shard, {num_proc} process(es))",
                        len(msgs) / (time.perf_counter() - t0)))
    return out


def print_table(a, results: dict, peaks: dict, device: str) -> None:
    peak = peaks["bf16" if a.bf16 else "fp32"]
    rows = []
    for name in a.systems:
        r = results.get(name)
        if not r:
            rows.append((name, None))
            continue
        r = r[0]
        rate = r["real"] / r["seconds"]
        rows.append((name, {"rate": rate, "pad": 1 - r["real"] / max(1, r["total"]), "median": r["median_step_s"],
                            "mem": r["peak_mem_gib"], "mfu": r["flops_per_token"] * rate / peak,
                            "cb": r["callback_tokens_per_s"], "batch": r["batch"]}))
    mem_kind = "CUDA max alloc" if a.cuda else "peak RSS"
    print(f"\n{'system':<18}{'micro batch':>12}{'real tok/s':>12}{'padding':>9}{'median step':>13}"
          f"{mem_kind + ' GiB':>20}{'MFU':>8}{'callback tok/s':>16}")
    for name, v in rows:
        if v is None:
            print(f"{name:<18}{'(failed; see stderr)':>40}")
            continue
        print(f"{name:<18}{v['batch']:>12d}{v['rate']:>12.1f}{v['pad']:>9.3f}{v['median']:>11.2f} s{v['mem']:>20.2f}"
              f"{100 * v['mfu']:>7.2f}%{v['cb']:>16.1f}")
    got = dict((n, v) for n, v in rows if v)
    if "ours" in got:
        for other in ("ours-padded", "ours-group", "ours-packing", "qwen-style", "trl"):
            if other in got:
                print(f"ours / {other}: {got['ours']['rate'] / got[other]['rate']:.2f}x real tokens/s"
                      + (f"  (ours-packing / {other}: {got['ours-packing']['rate'] / got[other]['rate']:.2f}x)"
                         if "ours-packing" in got and other in ("qwen-style", "trl") else ""))
    for name, v in got.items():
        agree = abs(v["cb"] / v["rate"] - 1)
        if agree > 0.10:
            print(f"note: {name}: the callback's tokens/s differs from the step timer's by {100 * agree:.1f}%")
    extra = results.get("trl", [{}])[0].get("trl_same_tokens_and_mask") if results.get("trl") else None
    if extra:
        print(f"TRL tokens and assistant mask identical to ours on {extra} conversations")
    print(f"matmul peak on {device}: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s "
          f"(MFU above uses {'bf16' if a.bf16 else 'fp32'})")


def print_scaling(a, one: list[dict], two: list[dict]) -> None:
    if not one or not two:
        print("scaling: a run failed; see stderr")
        return
    p1 = one[0]["real"] / one[0]["seconds"]
    p2 = [r["real"] / r["seconds"] for r in two]
    eff = statistics.mean(p2) / p1
    print(f"\nscaling ({one[0]['threads']} torch thread(s) per process, torchrun --standalone, "
          f"{'nccl' if a.cuda else 'gloo'}):")
    print(f"  1 process : {p1:8.1f} real tokens/s per process")
    print(f"  2 processes: {' / '.join(f'{x:.1f}' for x in p2)} real tokens/s per process "
          f"(total {sum(p2):.1f}); per-process efficiency {100 * eff:.1f}%")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=os.path.join(EXAMPLE, "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(EXAMPLE, "chitchat.jsonl"))
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--max_steps", type=int, default=8, help="optimizer steps per system (first one is warm-up)")
    p.add_argument("--batch", type=int, default=4, help="micro batch (conversations) per device")
    p.add_argument("--packing_batch", type=int, default=0, help="rows per micro batch with packing (0: about the "
                   "same tokens as --batch conversations)")
    p.add_argument("--max_length", type=int, default=512, help="model_max_length / Qwen-style padded length")
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank (alpha = 2 r, dropout 0.05, all linear layers)")
    p.add_argument("--scaling", action="store_true", help="also run ours with 1 and 2 processes")
    p.add_argument("--skip_preprocessing", action="store_true")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "sft-compare-cache"))
    p.add_argument("--bf16", action="store_true", help="train in bf16 (default on CUDA)")
    p.add_argument("--work", help="folder for each run's JSON result (default: a new temporary folder)")
    p.add_argument("--reuse", action="store_true", help="take a system's result from --work if it is there")
    p.add_argument("--peak_tflops", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    import torch

    a.cuda = torch.cuda.is_available()
    a.bf16 = a.bf16 or a.cuda
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    if a.max_steps < 2:
        print("error: --max_steps must be at least 2 (step 1 is warm-up)", file=sys.stderr)
        return 2
    import torch

    device = "cuda" if a.cuda else "cpu"
    name = torch.cuda.get_device_name() if a.cuda else f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}; {'bf16' if a.bf16 else 'fp32'}; attention: sdpa "
          "(ours-packing: per-conversation SDPA without a mask)")
    peaks = matmul_peaks(torch.device(device))
    a.peak_tflops = peaks["bf16" if a.bf16 else "fp32"] / 1e12
    if a.packing_batch <= 0:
        mean = mean_tokens_per_conversation(a)
        a.packing_batch = max(1, round(a.batch * mean / a.max_length))
        print(f"mean sample length {mean:.0f} tokens: packed micro batch = {a.packing_batch} row(s) of <= "
              f"{a.max_length} tokens (about {a.batch} conversations' worth)")
    print(f"model {a.model}\ndata {a.data}\nLoRA r={a.lora_r} alpha={2 * a.lora_r} dropout 0.05 all-linear; micro batch "
          f"{a.batch}; max length {a.max_length}; {a.max_steps} optimizer steps (step 1 not timed)")
    a.work = a.work or tempfile.mkdtemp(prefix="sft-compare-")
    os.makedirs(a.work, exist_ok=True)
    print(f"results of each run: {a.work}", flush=True)
    if True:
        results = {}
        for system in a.systems:
            t0 = time.perf_counter()
            results[system] = run_system(a, system)
            print(f"  ran {system} in {time.perf_counter() - t0:.0f} s", flush=True)
        print_table(a, results, peaks, device)
        if not a.skip_preprocessing:
            print("\npreprocessing (conversations/s):")
            for label, rate in preprocessing(a):
                print(f"  {label:<66}{rate:10.0f}")
        if a.scaling and a.cuda and torch.cuda.device_count() < 2:
            print("\nscaling: 2 processes need 2 GPUs (one per process); skipped")
        elif a.scaling:
            threads = max(1, (os.cpu_count() or 2) // 2) if not a.cuda else None
            one = run_system(a, "ours", 1, threads, "-scaling")
            two = run_system(a, "ours", 2, threads, "-scaling")
            print_scaling(a, one, two)
    return 0


if __name__ == "__main__":
    sys.exit(main())
