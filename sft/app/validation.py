"""Every rule that can be checked without loading the model, checked at once (:func:`validate`).

Each problem is one line naming the flag as typed, the value and the fix; :func:`validate` raises one
:class:`~sft.errors.ConfigError` listing all of them. Nothing here changes any state.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Optional

from sft.app.expert_parallel import expert_parallel_problems
from sft.config.deepspeed import EXAMPLE, mismatch_problems
from sft.data.records.sources import folder_problem
from sft.distributed.process_group import NCCL_TRACE_DIR, check_sequence_parallel_size
from sft.errors import ConfigError, SFTError
from sft.model.loading import read_chat_template, template_kwargs
from sft.model.quantized import HUB_ID as _HUB_ID, importable, model_folder, read_quantization, training_problems
from sft.model.token_mixers import sequence_parallel_problem
from sft.train.checkpoint import check_resume, check_zero_world_size, resolve_resume
from sft.train.metrics import peak_tflops_problems
from sft.train.world_size import plan_world_size_change

if TYPE_CHECKING:  # pragma: no cover
    from sft.config.arguments import DataArguments, LoraArguments, ModelArguments, TrainingArguments


# --report_to name -> module that must be importable for it
_REPORTERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
              "comet_ml": ("comet_ml",), "clearml": ("clearml",), "trackio": ("trackio",), "swanlab": ("swanlab",)}


def _check_model(m: Optional[str]) -> list[str]:
    if not m:
        return ["--model_name_or_path is required: the folder of a transformers model (config.json + weights)"]
    if os.path.exists(m):
        if not os.path.isdir(m):
            return [f"--model_name_or_path {m}: is a file; give the model's folder (with config.json)"]
        if not os.path.isfile(os.path.join(m, "config.json")):
            return [f"--model_name_or_path {m}: no config.json in this folder; give a transformers model folder "
                    "(scripts/prepare_example.py writes one for the built-in example)"]
        return []
    if _HUB_ID.match(m) and not os.path.isdir(m.split("/")[0]):
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(m, "config.json"), str):
            return []
        return [f"--model_name_or_path {m}: no such folder, and no Hugging Face hub model of that name in the local "
                "cache; give a local model folder (or download the model once, before the job)"]
    return [f"--model_name_or_path {m}: no such folder; give an existing model folder"]


def _check_chat_template(path: Optional[str], kwargs_text: Optional[str]) -> list[str]:
    """``--chat_template``: a readable Jinja file (:func:`sft.model.loading.read_chat_template`);
    ``--chat_template_kwargs``: a JSON object of variable names (:func:`sft.model.loading.template_kwargs`)."""
    p = []
    for value, check in ((path, read_chat_template), (kwargs_text, template_kwargs)):
        if value is None:
            continue
        try:
            check(value)
        except SFTError as e:
            p.append(str(e))
    return p


def _check_source(flag: str, path: str) -> list[str]:
    if os.path.isdir(path):
        why = folder_problem(path)
        return [f"{flag} {path}: {why}"] if why else []
    if not os.path.exists(path):
        return [f"{flag} {path}: no such file"]
    if not os.path.isfile(path):
        return [f"{flag} {path}: not a regular file (a pipe or device?); give a .json, .jsonl or .parquet file"]
    return []


def _check_data(data_args, training_args) -> list[str]:
    p = []
    paths = data_args.data_path or []
    paths = [paths] if isinstance(paths, str) else paths  # set in code rather than parsed
    if not paths:
        p.append("--data_path is required: a .json (list of records) or .jsonl file of conversations (or several "
                 "sources: .parquet files, datasets save_to_disk folders)")
    for path in paths:
        p += _check_source("--data_path", path)
    if data_args.eval_data_path:
        p += _check_source("--eval_data_path", data_args.eval_data_path)
    w = data_args.data_weights
    if w is not None:
        if len(w) != len(paths):
            p.append(f"--data_weights {' '.join(map(str, w))}: {len(w)} weight(s) for {len(paths)} --data_path "
                     "source(s); give one weight per source, in the same order")
        elif not all(math.isfinite(x) and x > 0 for x in w):
            p.append(f"--data_weights {' '.join(map(str, w))}: every weight must be a number > 0 (e.g. 0.7 0.3)")
    if not (math.isfinite(data_args.data_timeout) and data_args.data_timeout > 0):
        p.append(f"--data_timeout {data_args.data_timeout}: must be a number of seconds > 0 (default 14400)")
    p += _check_eval(data_args, training_args)
    cache = data_args.data_cache_dir
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        p.append(f"--data_cache_dir {cache}: is a file; give a folder (it is created if missing)")
    env_cache = os.environ.get("SFT_CACHE_DIR")
    if not cache and env_cache and os.path.exists(env_cache) and not os.path.isdir(env_cache):
        p.append(f"SFT_CACHE_DIR={env_cache}: is a file; point it at a folder (it is created if missing) or unset it")
    if data_args.preprocessing_num_workers is not None and data_args.preprocessing_num_workers < 1:
        p.append(f"--preprocessing_num_workers {data_args.preprocessing_num_workers}: must be at least 1")
    p += _check_packing(data_args, training_args)
    p += _check_sequence_parallel(data_args, training_args)
    return p


def _check_eval(data_args, training_args) -> list[str]:
    p, ratio = [], data_args.eval_split_ratio
    if ratio is not None and not (math.isfinite(ratio) and 0 < ratio < 1):
        p.append(f"--eval_split_ratio {ratio}: must be a fraction with 0 < R < 1 (e.g. 0.05 holds out about 5% of "
                 "the records)")
    if ratio is not None and data_args.eval_data_path:
        p.append(f"--eval_split_ratio {ratio} with --eval_data_path {data_args.eval_data_path}: choose one (the "
                 "ratio holds out records of --data_path when there is no evaluation file)")
    has_eval = bool(data_args.eval_data_path) or ratio is not None
    if training_args.eval_strategy != "no" and not has_eval:
        p.append(f"--eval_strategy {training_args.eval_strategy}: evaluation needs --eval_data_path or "
                 "--eval_split_ratio; add one or use --eval_strategy no")
    if training_args.eval_on_start and not has_eval:
        p.append("--eval_on_start True: the evaluation before training needs --eval_data_path or --eval_split_ratio; "
                 "add one or drop --eval_on_start")
    if data_args.long_conversations in ("split", "refuse") and data_args.lazy_preprocess:
        p.append(f"--long_conversations {data_args.long_conversations} with --lazy_preprocess True: a lazy dataset "
                 "cannot know how many samples a conversation gives before reading it; drop --lazy_preprocess or use "
                 "--long_conversations truncate")
    return p


def _check_sequence_parallel(data_args, training_args) -> list[str]:
    n = training_args.sequence_parallel_size
    if n == 1:
        return []
    flag = f"--sequence_parallel_size {n}"
    if n < 1:
        return [f"{flag}: must be at least 1 (1: off)"]
    world = training_args.world_size
    if "WORLD_SIZE" in os.environ:  # a training process; a lone check (the launcher's) cannot know the world
        try:
            check_sequence_parallel_size(n, world)
        except ConfigError as e:
            return e.problems
    if data_args.lazy_preprocess:
        return [f"{flag} with --lazy_preprocess True: the micro batches of a sequence-parallel group are planned from "
                "every sample's length; pass --lazy_preprocess False"]
    if not data_args.packing and not data_args.padding_free:
        return [f"{flag} with --padding_free False: sequence parallelism splits padding-free or packed rows; drop "
                "--padding_free False"]
    if training_args.group_by_length:
        return [f"{flag} with --group_by_length True: the ranks of a group must read the same micro batches, which "
                "the token-budget sampler deals; drop --group_by_length"]
    return []


def _check_packing(data_args, training_args) -> list[str]:
    p = []
    budget = training_args.max_tokens_per_micro_batch
    if budget is not None:
        if data_args.packing or not data_args.padding_free:
            mode = "--packing True" if data_args.packing else "--padding_free False"
            p.append(f"--max_tokens_per_micro_batch {budget} with {mode}: the token budget applies to padding-free "
                     "micro batches; a micro batch of packed or padded rows holds --per_device_train_batch_size x "
                     "--model_max_length tokens at most, so lower one of those instead")
        elif training_args.group_by_length or data_args.lazy_preprocess:
            other = "--group_by_length True" if training_args.group_by_length else "--lazy_preprocess True"
            p.append(f"--max_tokens_per_micro_batch {budget} with {other}: the token budget forms micro batches from "
                     f"every sample's length, which {other} does not allow; drop one of them")
        elif budget < training_args.model_max_length:
            p.append(f"--max_tokens_per_micro_batch {budget}: below --model_max_length "
                     f"{training_args.model_max_length}, a sample of that length would fit no micro batch; give at "
                     f"least {training_args.model_max_length} or lower --model_max_length to {budget}")
    if not data_args.packing:
        return p
    if data_args.lazy_preprocess:
        p.append("--packing True with --lazy_preprocess True: packing needs every sample's length up front; "
                 "drop one of them")
    if training_args.group_by_length:
        p.append("--packing True with --group_by_length True: choose one (packing already removes padding)")
    return p


def _check_training(t) -> list[str]:
    p = []
    if t.model_max_length < 8:
        p.append(f"--model_max_length {t.model_max_length}: must be at least 8 tokens")
    for flag, value in (("--per_device_train_batch_size", t.per_device_train_batch_size),
                        ("--per_device_eval_batch_size", t.per_device_eval_batch_size),
                        ("--gradient_accumulation_steps", t.gradient_accumulation_steps)):
        if value < 1:
            p.append(f"{flag} {value}: must be at least 1")
    if t.max_steps <= 0 and t.num_train_epochs <= 0:
        p.append(f"--max_steps {t.max_steps} and --num_train_epochs {t.num_train_epochs}: nothing would be trained; "
                 "give --num_train_epochs > 0 or --max_steps > 0")
    if not (math.isfinite(t.learning_rate) and t.learning_rate >= 0):
        p.append(f"--learning_rate {t.learning_rate}: must be a number >= 0 (e.g. 2e-4 for LoRA, 1e-5 full tuning)")
    if not math.isfinite(t.num_train_epochs):
        p.append(f"--num_train_epochs {t.num_train_epochs}: must be a finite number")
    for flag, beta in (("--adam_beta1", t.adam_beta1), ("--adam_beta2", t.adam_beta2)):
        if not 0 <= beta < 1:
            p.append(f"{flag} {beta}: must be in [0, 1) (e.g. 0.9, 0.95, 0.999)")
    if t.dataloader_num_workers < 0:
        p.append(f"--dataloader_num_workers {t.dataloader_num_workers}: must be >= 0")
    if t.warmup_ratio is not None and not 0 <= t.warmup_ratio < 1:
        p.append(f"--warmup_ratio {t.warmup_ratio}: must be in [0, 1)")
    if not (math.isfinite(t.preemption_timeout) and t.preemption_timeout > 0):
        p.append(f"--preemption_timeout {t.preemption_timeout}: must be a number of seconds > 0 (e.g. 300)")
    hang = t.hang_timeout
    if hang is not None and not (math.isfinite(hang) and (hang == 0 or hang >= 2)):
        p.append(f"--hang_timeout {hang}: must be 0 (off) or a number of seconds >= 2 (e.g. 300)")
    elif hang and hang >= t.ddp_timeout:
        p.append(f"--hang_timeout {hang:g} with --ddp_timeout {t.ddp_timeout:g}: torch's timeout would end the job "
                 "first, without naming the stuck rank; set --hang_timeout below --ddp_timeout (or leave it unset: "
                 "300, at most half of it)")
    factor = t.straggler_factor
    if not (math.isfinite(factor) and (factor == 0 or factor > 1)):
        p.append(f"--straggler_factor {factor}: must be 0 (off) or a ratio > 1 (e.g. 1.5: 50% slower than the other "
                 "ranks' median)")
    if t.straggler_window < 2:
        p.append(f"--straggler_window {t.straggler_window}: must be at least 2 optimizer steps (e.g. 20)")
    if not 0 <= t.seed < 2**32:
        p.append(f"--seed {t.seed}: must be in [0, 2**32)")
    p += peak_tflops_problems(t.peak_tflops)
    if not isinstance(t.parsed.bf16, bool) and t.parsed.bf16 != "auto":
        p.append(f"--bf16 {t.parsed.bf16}: must be True, False or auto (bf16 where the machine computes it fast)")
    if t.parsed.fp16_without_cuda:
        p.append("--fp16 True: fp16 training needs a CUDA GPU and none is visible; on CPU use --bf16 True or "
                 "leave both off (fp32)")
    if (t.fp16 or t.parsed.fp16_without_cuda) and t.bf16:
        p.append("--fp16 True and --bf16 True: choose one precision")
    p += t.parsed.deepspeed_problems
    hf_ds = t.hf_deepspeed_config if t.deepspeed else None  # transformers sets it under --deepspeed
    if hf_ds is not None and hf_ds.mismatches:
        p += mismatch_problems(t.parsed.deepspeed, hf_ds.mismatches)
    for name in t.report_to or []:
        if name in _REPORTERS and not importable(*_REPORTERS[name]):
            p.append(f"--report_to {name}: the {name} package is not installed; pip install it or use --report_to none")
    if "bnb" in str(t.optim) and not importable("bitsandbytes"):
        p.append(f"--optim {t.optim}: needs bitsandbytes, which is not installed; use --optim adamw_torch")
    return p


def _check_quantized_base(model_args, t, lora_args):
    """Problems of a pre-quantized base (:mod:`sft.model.quantized`) and its kind (None: not pre-quantized)."""

    folder = model_folder(model_args.model_name_or_path)
    q = read_quantization(folder) if folder else None
    if q is None:
        return [], None
    return training_problems(model_args.model_name_or_path, q, use_lora=t.use_lora, q_lora=lora_args.q_lora), q


def _check_lora(model_args, t, lora_args) -> list[str]:
    p, prequantized = _check_quantized_base(model_args, t, lora_args)
    if lora_args.q_lora:
        if not t.use_lora:
            p.append("--q_lora True: Q-LoRA trains a LoRA adapter on the 4-bit base model; add --use_lora True")
        if not importable("bitsandbytes") and (prequantized is None or prequantized.bnb_4bit):
            p.append("--q_lora True: needs bitsandbytes (4-bit NF4), which is not installed; pip install "
                     "bitsandbytes, or use --use_lora True without --q_lora")
        if t.parsed.zero_stage == 3:
            packed = (f"the base's packed {prequantized.label} weights" if prequantized is not None
                      else "bitsandbytes' packed 4-bit weights")
            p.append(f"--q_lora True with --deepspeed {t.parsed.deepspeed} (ZeRO-3): ZeRO-3 partitions every "
                     f"weight across ranks, and {packed} cannot be partitioned or gathered "
                     f"by it; use ZeRO-2 (--deepspeed {EXAMPLE}, the finetune_qlora_ds.sh "
                     "default: the frozen 4-bit base is replicated, adapter gradients and optimizer state are "
                     "sharded)" + (" or no DeepSpeed" if prequantized is not None
                                   else " or plain LoRA (--q_lora False) with ZeRO-3"))
    if lora_args.lora_r <= 0:
        p.append(f"--lora_r {lora_args.lora_r}: the LoRA rank must be a positive integer (e.g. 8, 16, 64)")
    if lora_args.lora_alpha <= 0:
        p.append(f"--lora_alpha {lora_args.lora_alpha}: must be positive (e.g. 16)")
    if not 0.0 <= lora_args.lora_dropout < 1.0:
        p.append(f"--lora_dropout {lora_args.lora_dropout}: must be in [0, 1)")
    if lora_args.lora_target_modules is not None and not all(x.strip() for x in lora_args.lora_target_modules):
        p.append("--lora_target_modules: empty module name; give names such as q_proj v_proj (or omit the flag "
                 "for every linear projection)")
    if not t.use_lora and (model_args.train_embeddings != "auto" or lora_args.lora_target_modules):
        p.append("--train_embeddings/--lora_target_modules only apply with --use_lora True; add --use_lora True "
                 "or drop them (full fine-tuning trains every weight)")
    return p


def _check_output(t) -> list[str]:
    out = t.output_dir
    if not out:
        return ["--output_dir is empty; give the folder to write the adapter or model to"]
    p = []
    parent = out
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    parent = parent or "."
    if os.path.islink(out) and not os.path.exists(out):
        p.append(f"--output_dir {out}: is a symlink to a missing target; fix or remove the link")
    elif os.path.exists(out) and not os.path.isdir(out):
        p.append(f"--output_dir {out}: is a file; give a folder path")
    elif not os.path.isdir(parent):
        p.append(f"--output_dir {out}: {parent} is a file, so the folder cannot be created; choose another path")
    elif not os.access(parent, os.W_OK | os.X_OK):
        p.append(f"--output_dir {out}: {parent} is not writable; choose a folder you can write to")

    # under torchrun each rank verifies the files it wrote (sft.train.integrity); a lone check verifies all of them
    rank = t.process_index if "WORLD_SIZE" in os.environ else None
    resume_problems, resuming_here = check_resume(out, t.resume_from_checkpoint, t.overwrite_output_dir, t.use_lora,
                                                  rank, t.should_save)
    p += resume_problems
    p += fsdp_checkpoint_layout(t, resolve_resume(out, t.resume_from_checkpoint, t.overwrite_output_dir))
    if t.deepspeed and "WORLD_SIZE" in os.environ:  # a training process (torchrun, Ray); a lone check cannot know
        p += check_zero_world_size(out, t.resume_from_checkpoint, t.overwrite_output_dir, int(os.environ["WORLD_SIZE"]),
                                   t.parsed.zero_stage)
    if "WORLD_SIZE" in os.environ and not resume_problems:  # the global batch kept at another world size
        try:
            plan_world_size_change(resolve_resume(out, t.resume_from_checkpoint, t.overwrite_output_dir),
                                   int(os.environ["WORLD_SIZE"]), t.per_device_train_batch_size,
                                   t.gradient_accumulation_steps, max(1, t.sequence_parallel_size))
        except ConfigError as e:
            p += e.problems
    # NCCL_TRACE_DIR: made by a CUDA run's start for the flight recorder's dumps, not the user's content
    if (os.path.isdir(out) and set(os.listdir(out)) - {NCCL_TRACE_DIR} and not t.overwrite_output_dir
            and not resuming_here):
        p.append(f"--output_dir {out}: the folder is not empty; pass --overwrite_output_dir True to write "
                 "into it anyway, or choose another folder")
    return p


def _check_fsdp(t, lora_args) -> list[str]:
    """FSDP2 (``--fsdp`` + ``--fsdp_config``): the config's own problems, then the combinations that cannot run."""
    asked = t.parsed
    p = list(asked.fsdp_problems)
    if not asked.fsdp_on:
        if asked.fsdp_config is not None:
            p.append(f"--fsdp_config {asked.fsdp_config}: has no effect without --fsdp; add --fsdp (FSDP2) or "
                     "drop --fsdp_config")
        return p
    fsdp = f"--fsdp {asked.fsdp}" if isinstance(asked.fsdp, str) else "--fsdp"
    if asked.deepspeed:
        p.append(f"{fsdp} with --deepspeed {asked.deepspeed}: choose one sharding engine (FSDP2 or DeepSpeed "
                 "ZeRO); drop one of the two flags")
    config = t.fsdp_config if isinstance(t.fsdp_config, dict) else {}
    if t.use_cpu and config.get("cpu_offload"):
        # torch 2.13 fully_shard with CPUOffloadPolicy (pin_memory=True, what accelerate 1.15 builds) pins each
        # shard: "Cannot access accelerator device when none is available".
        p.append(f"--fsdp_config {asked.fsdp_config} \"cpu_offload\": true on CPU: FSDP2's offload pins host "
                 "memory for GPU copies and fails without a GPU, and on CPU the parameters are in CPU memory already; "
                 "use finetune/fsdp_config_full_shard.json (no offload)")
    if t.save_only_model and config.get("state_dict_type") == "SHARDED_STATE_DICT":
        # the checkpoints' weights are written with the optimizer's shards, which --save_only_model skips
        p.append(f"--save_only_model True with --fsdp_config {asked.fsdp_config} \"state_dict_type\": "
                 "\"SHARDED_STATE_DICT\": the checkpoints would hold no weights at all (each rank writes its shards "
                 "with the optimizer state); drop --save_only_model, or use \"FULL_STATE_DICT\"")
    if t.save_async and config.get("state_dict_type", "FULL_STATE_DICT") != "SHARDED_STATE_DICT":
        p.append(f"--save_async True with --fsdp_config {asked.fsdp_config} \"state_dict_type\": "
                 f"\"{config.get('state_dict_type', 'FULL_STATE_DICT')}\": a full state dict is gathered to rank 0 "
                 "at every save, which is what an asynchronous save exists to avoid; use \"SHARDED_STATE_DICT\" "
                 "(finetune/fsdp_config_full_shard.json), or drop --save_async")
    if lora_args.q_lora:
        p.append(f"--q_lora True with {fsdp}: FSDP2 shards every weight as a DTensor, and bitsandbytes' packed 4-bit "
                 "weights can only be sharded when stored in the compute dtype (bnb_4bit_quant_storage), while this "
                 "loader gives each rank a full 4-bit replica on its own device; use Q-LoRA with ZeRO-2 "
                 "(finetune_qlora_ds.sh) or LoRA with FSDP2 (finetune_lora_fsdp.sh)")
    if config.get("activation_checkpointing") and t.activation_checkpointing:
        p.append(f"--gradient_checkpointing True with --fsdp_config {asked.fsdp_config} "
                 "\"activation_checkpointing\": true: choose one (transformers refuses both); FSDP's own is the "
                 "cheaper one: add --gradient_checkpointing False")
    return p


def fsdp_checkpoint_layout(t, resume: Optional[str]) -> list[str]:
    """The checkpoint ``resume`` (or None) must be in the layout this run loads: FSDP2 shards
    (``pytorch_model_fsdp_0/``, ``"SHARDED_STATE_DICT"``), FSDP2 full state dicts (``pytorch_model_fsdp.bin``,
    ``"FULL_STATE_DICT"``, the shipped configs before issue 44), or neither (no ``--fsdp``). One problem line naming
    the setting that reads it, or none."""
    if not resume or not os.path.isdir(resume):
        return []
    names = set(os.listdir(resume))
    written = "shards" if "pytorch_model_fsdp_0" in names else "full" if "pytorch_model_fsdp.bin" in names else None
    config = t.fsdp_config if isinstance(t.fsdp_config, dict) else {}
    run = None if not t.parsed.fsdp_on else \
        "shards" if config.get("state_dict_type", "FULL_STATE_DICT") == "SHARDED_STATE_DICT" else "full"
    ddp_written = os.path.isfile(os.path.join(resume, "optimizer.pt"))
    if written == run or (written is None and (run is None or not ddp_written)):
        return []
    held = {"shards": "FSDP2 shards (pytorch_model_fsdp_0/, \"state_dict_type\": \"SHARDED_STATE_DICT\")",
            "full": "FSDP2 full state dicts (pytorch_model_fsdp.bin, \"state_dict_type\": \"FULL_STATE_DICT\", as "
                    "the shipped FSDP2 configs wrote them before sharded checkpoints)",
            None: "a checkpoint written without --fsdp"}
    fix = {"shards": "resume with --fsdp --fsdp_config finetune/fsdp_config_full_shard.json",
           "full": "resume with --fsdp and an --fsdp_config saying \"state_dict_type\": \"FULL_STATE_DICT\"",
           None: "resume without --fsdp"}
    return [f"checkpoint {resume}: holds {held[written]}, which this run's settings do not load; {fix[written]} "
            "(or start afresh: --overwrite_output_dir True, or another --output_dir)"]


def validate(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments,
             lora_args: LoraArguments) -> None:
    """Check every rule that can be checked without loading the model (a model's layers, where asked, from its
    config on the meta device); raise once with all problems: ``ConfigError``, one line per problem naming the flag,
    the value and the fix."""
    p = (_check_model(model_args.model_name_or_path)
         + _check_chat_template(model_args.chat_template, model_args.chat_template_kwargs)
         + _check_data(data_args, training_args)
         + _check_training(training_args) + _check_lora(model_args, training_args, lora_args)
         + _check_fsdp(training_args, lora_args) + _check_output(training_args)
         + expert_parallel_problems(model_args, training_args, lora_args)
         + sequence_parallel_problem(training_args.sequence_parallel_size, model_folder(model_args.model_name_or_path)))
    m, out = model_args.model_name_or_path, training_args.output_dir
    if m and out and os.path.isdir(m) and os.path.realpath(m) == os.path.realpath(out):
        p.append(f"--output_dir {out}: is the base model's folder; saving would overwrite it; choose another folder")
    if training_args.save_async and training_args.deepspeed:
        p.append(f"--save_async True with --deepspeed {training_args.deepspeed}: DeepSpeed writes its ZeRO checkpoint "
                 "itself, synchronously; drop --save_async (or use --fsdp with finetune/fsdp_config_full_shard.json, "
                 "whose sharded checkpoints are written in the background)")
    if (aux := training_args.moe_aux_loss_coef) is not None and not (math.isfinite(aux) and aux >= 0):
        p.append(f"--moe_aux_loss_coef {aux}: must be a number >= 0 (e.g. 0.001; 0: no load-balancing loss)")
    if p:
        raise ConfigError(p)
