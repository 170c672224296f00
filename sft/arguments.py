"""Command-line arguments: dataclasses parsed by ``transformers.HfArgumentParser``.

Qwen's ``finetune.py`` flag names keep their meaning (``--model_name_or_path --data_path
--eval_data_path --lazy_preprocess --model_max_length --use_lora --q_lora --lora_r --lora_alpha
--lora_dropout --lora_target_modules --lora_bias``), plus every ``transformers.TrainingArguments``
flag. Flags that transformers 5 removed but Qwen's scripts pass (``--evaluation_strategy``,
``--warmup_ratio``, ``--group_by_length``, ``--overwrite_output_dir``) are accepted and mapped to
their transformers 5 equivalents.

``--config FILE.yaml`` gives defaults; flags on the command line win; a YAML key that is not a
flag is an error. :func:`validate` checks every rule before anything heavy loads and raises one
:class:`~sft.errors.ConfigError` listing all problems.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

import transformers

from .errors import ConfigError


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "Base model: a local folder with config.json and weights (required)."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow model/tokenizer Python code shipped inside the model folder to run. Off by default."},
    )
    train_embeddings: str = field(
        default="auto",
        metadata={
            "help": "LoRA only: also train input embeddings and lm_head (peft modules_to_save). 'auto' = only when "
            "the chat template's special tokens are new to the model (not in its embedding matrix, or their rows "
            "are untrained).",
            "choices": ["auto", "true", "false"],
        },
    )


@dataclass
class DataArguments:
    data_path: Optional[str] = field(
        default=None, metadata={"help": "Training data: a JSON list file or a JSONL file of conversations (required)."}
    )
    eval_data_path: Optional[str] = field(default=None, metadata={"help": "Evaluation data, same format."})
    lazy_preprocess: bool = field(
        default=False,
        metadata={"help": "Tokenize each sample when it is read instead of preparing the whole dataset up front."},
    )
    system_message: Optional[str] = field(
        default=None,
        metadata={
            "help": "Default system prompt for records without a leading system turn. Unset: the chat template's "
            "own default (ChatML fallback: 'You are a helpful assistant.')."
        },
    )
    on_bad_record: str = field(
        default="error",
        metadata={
            "help": "What to do with an invalid record: 'error' stops before training and lists every problem; "
            "'skip' drops the record and prints a summary with counts and ids.",
            "choices": ["error", "skip"],
        },
    )
    data_cache_dir: Optional[str] = field(
        default=None,
        metadata={"help": "Where tokenized datasets are cached (default: $SFT_CACHE_DIR or ~/.cache/sft/datasets)."},
    )
    preprocessing_num_workers: Optional[int] = field(
        default=None, metadata={"help": "Processes used to tokenize the dataset (datasets.map num_proc)."}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Pack several conversations into each row of up to --model_max_length tokens (best-fit "
                  "decreasing); position ids restart per conversation and attention never crosses conversations. "
                  "--per_device_train_batch_size then counts rows. Non-packing alternative: --group_by_length True."},
    )


@dataclass
class LoraArguments:
    lora_r: int = field(default=64, metadata={"help": "LoRA rank r."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha; the update is scaled by alpha / r."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input, in [0, 1)."})
    lora_target_modules: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Module names to adapt. Default: every linear projection of the architecture "
                  "(peft 'all-linear', lm_head excluded)."},
    )
    lora_weight_path: str = field(default="", metadata={"help": "Unused; kept so Qwen commands still parse."})
    lora_bias: str = field(
        default="none", metadata={"help": "Which biases to train.", "choices": ["none", "all", "lora_only"]}
    )
    q_lora: bool = field(default=False, metadata={"help": "Q-LoRA: 4-bit NF4 base model (bitsandbytes) + LoRA."})


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` plus Qwen's training flags.

    On a machine without CUDA, ``use_cpu`` is switched on and ``ddp_backend`` defaults to ``gloo``:
    otherwise ``torchrun --nproc_per_node 2`` would start two independent trainings on CPU.
    """

    model_max_length: int = field(
        default=8192, metadata={"help": "Maximum sequence length in tokens; longer samples are truncated (reported)."}
    )
    use_lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "transformers cache_dir for from_pretrained."})
    optim: str = field(default="adamw_torch", metadata={"help": "Optimizer name (transformers OptimizerNames)."})
    # Flags removed in transformers 5 that Qwen's scripts still pass; mapped in __post_init__.
    group_by_length: bool = field(
        default=False, metadata={"help": "Batch samples of similar length (train_sampling_strategy=group_by_length)."}
    )
    warmup_ratio: Optional[float] = field(
        default=None, metadata={"help": "Fraction of training steps for LR warmup (sets warmup_steps to it)."}
    )
    evaluation_strategy: Optional[str] = field(
        default=None, metadata={"help": "Old name of --eval_strategy.", "choices": ["no", "steps", "epoch"]}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow writing into a non-empty --output_dir."}
    )
    preemption_timeout: float = field(
        default=300.0,
        metadata={"help": "Seconds from SIGTERM/SIGINT to a forced exit (code 75) if the current step and the "
                  "checkpoint have not finished by then; the last complete checkpoint is kept."},
    )
    peak_tflops: Optional[float] = field(
        default=None,
        metadata={"help": "Peak TFLOP/s of one device, the denominator of the logged MFU (e.g. 989 for an H100 SXM "
                  "in dense bf16). Unset: a torch.matmul peak measured at the start of training."},
    )

    def __post_init__(self):
        if self.evaluation_strategy is not None:
            self.eval_strategy = self.evaluation_strategy
        if self.warmup_ratio is not None and 0 <= self.warmup_ratio < 1:  # otherwise validate() reports it
            self.warmup_steps = float(self.warmup_ratio)
        if self.group_by_length:
            self.train_sampling_strategy = "group_by_length"
        import torch

        self.fp16_requested_without_cuda = False
        # transformers reads --deepspeed while parsing and raises a bare traceback on a bad file: check it
        # first; a config with problems is dropped here and the problems reported by validate().
        self.deepspeed_requested, self.deepspeed_problems, self.zero_stage = self.deepspeed, [], 0
        if isinstance(self.deepspeed, str):
            from .ds_config import read_ds_config, zero_stage

            config, self.deepspeed_problems = read_ds_config(self.deepspeed, str(getattr(
                self.lr_scheduler_type, "value", self.lr_scheduler_type)))
            if config is None:
                self.deepspeed = None
            else:
                self.zero_stage = zero_stage(config)
                if self.deepspeed.lstrip().startswith("{"):  # inline JSON (e.g. a YAML mapping): pass the dict
                    self.deepspeed = config
                from .ds_compat import skip_shm_comm_op_build

                skip_shm_comm_op_build()
        if self.ddp_find_unused_parameters is None:
            # every parameter of a causal LM (and of a LoRA adapter on it) takes part in each step; DDP's
            # search for unused ones costs a graph traversal per step and warns on every rank.
            self.ddp_find_unused_parameters = False
        if not torch.cuda.is_available():
            self.use_cpu = True
            if self.ddp_backend is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                self.ddp_backend = "gloo"
            if self.fp16:  # reported by validate() together with every other problem
                self.fp16, self.fp16_requested_without_cuda = False, True
        # Qwen's --gradient_checkpointing is transformers 5's --activation_checkpointing (same meaning).
        if self.activation_checkpointing is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing, self.gradient_checkpointing = self.gradient_checkpointing, None
        if self.activation_checkpointing_kwargs is None and self.gradient_checkpointing_kwargs is not None:
            self.activation_checkpointing_kwargs, self.gradient_checkpointing_kwargs = self.gradient_checkpointing_kwargs, None
        if self.activation_checkpointing and self.activation_checkpointing_kwargs is None:
            # Non-reentrant checkpointing works with frozen inputs (LoRA).
            self.activation_checkpointing_kwargs = {"use_reentrant": False}
        # Before transformers sets up devices: on CPU it would start gloo without --ddp_timeout (30 min).
        from .distributed import init_process_group

        init_process_group(self.ddp_backend, self.ddp_timeout)
        super().__post_init__()


ALL_DATACLASSES = (ModelArguments, DataArguments, TrainingArguments, LoraArguments)


def _flag_names(extra: tuple = ()) -> set[str]:
    names = set()
    for dc in (*ALL_DATACLASSES, *extra):
        names.update(f.name for f in dataclasses.fields(dc) if f.init)
    return names


def _split_config(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """Remove ``--config PATH`` / ``--config=PATH`` from argv; return (path, remaining argv)."""
    rest, path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ConfigError(["--config needs a file path: --config train.yaml"])
            path = argv[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
            if not path:
                raise ConfigError(["--config= has no file path: --config train.yaml"])
        else:
            rest.append(a)
        i += 1
    return path, rest


def _read_yaml(path: str, extra: tuple = ()) -> dict:
    import yaml

    if not path or not os.path.isfile(path):
        raise ConfigError([f"--config {path}: no such file; give the path of a YAML file of flag: value pairs"])
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"--config {path}:{where}: not valid YAML ({getattr(e, 'problem', e)}); "
                           "fix the syntax (flag: value, one per line)"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"--config {path}: not UTF-8 text (byte {e.start}); save it as UTF-8"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: top level is a {type(data).__name__}; it must be a mapping "
                           "of flag: value pairs"])
    known = _flag_names(extra)
    unknown = sorted(str(k) for k in data if not (isinstance(k, str) and k in known))
    if unknown:
        raise ConfigError([f"--config {path}: unknown key '{k}'"
                           + _suggest(k, known) + "; remove it or use a finetune.py flag name" for k in unknown])
    return data


def _suggest(name: str, known: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _yaml_to_argv(path: str, defaults: dict, parser) -> list[str]:
    """Turn YAML defaults into command-line tokens, so argparse converts and checks them exactly like typed flags
    (placed before the user's flags: the last occurrence of a flag wins)."""
    actions = {a.dest: a for a in parser._actions}
    argv, problems = [], []
    for key, value in defaults.items():
        if value is None:
            continue  # null = keep the default
        many = actions[key].nargs in ("+", "*")
        if isinstance(value, dict):
            if not key.endswith(("_kwargs", "_config")) and key != "deepspeed":
                problems.append(f"--config {path}: '{key}' is a mapping; give a single value")
                continue
            value = json.dumps(value)  # transformers reads dict-valued flags as JSON text
        if isinstance(value, bool) and actions[key].type is str:
            problems.append(f"--config {path}: '{key}' is the YAML boolean {value}; quote it if you mean the text "
                            f"('{key}: \"{str(value).lower()}\"')")
            continue
        if isinstance(value, list):
            if not many:
                problems.append(f"--config {path}: '{key}' is a list; give a single value")
                continue
            if any(isinstance(v, (list, dict)) for v in value):
                problems.append(f"--config {path}: '{key}' must be a list of plain values")
                continue
            argv += [f"--{key}", *map(_yaml_scalar, value)]
        else:
            argv += [f"--{key}", _yaml_scalar(value)]
    if problems:
        raise ConfigError(problems)
    return argv


def _yaml_scalar(v) -> str:
    return str(v) if not isinstance(v, bool) else ("True" if v else "False")


def parse_args(argv: Optional[list[str]] = None, extra: tuple = ()):
    """Parse argv (default ``sys.argv[1:]``) into (ModelArguments, DataArguments, TrainingArguments, LoraArguments),
    followed by one instance of each dataclass in ``extra`` (a launcher's own flags, e.g. the Ray launcher's;
    their names are then also valid YAML keys).

    Raises:
        ConfigError: bad ``--config`` file, unknown YAML keys, or a value transformers rejects.
        SystemExit: argparse's own exit (code 2) for unknown flags or unparsable values; ``-h`` exits 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = _split_config(argv)
    parser = transformers.HfArgumentParser((*ALL_DATACLASSES, *extra))
    parser.add_argument("--config", help="YAML file of flag: value defaults; the command line wins.")
    if config_path is not None:
        argv = _yaml_to_argv(config_path, _read_yaml(config_path, extra), parser) + argv
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=False)
    except ValueError as e:  # raised by TrainingArguments.__post_init__, or for flags no dataclass has
        if "not used by the HfArgumentParser" in str(e):
            known = _flag_names(extra) | {"config"}
            names = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
            unknown = [u for u in names if u[2:] not in known and not (u.startswith("--no_") and u[5:] in known)]
            raise ConfigError([f"unknown flag {u}" + _suggest(u[2:], known).replace("'", "'--", 1)
                               + "; see finetune.py -h for the flags" for u in unknown] or [str(e).strip()]) from None
        raise ConfigError([str(e).strip()]) from None
    return tuple(parsed[:len(ALL_DATACLASSES)]) + tuple(parsed[len(ALL_DATACLASSES):len(ALL_DATACLASSES) + len(extra)])


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# --report_to name -> module that must be importable for it
_REPORTERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
              "comet_ml": ("comet_ml",), "clearml": ("clearml",), "trackio": ("trackio",), "swanlab": ("swanlab",)}


def _importable(*modules: str) -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in modules)


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


def _check_data(data_args, training_args) -> list[str]:
    p = []
    for flag, path, required in (("--data_path", data_args.data_path, True),
                                 ("--eval_data_path", data_args.eval_data_path, False)):
        if not path:
            if required:
                p.append(f"{flag} is required: a .json (list of records) or .jsonl file of conversations")
        elif os.path.isdir(path):
            p.append(f"{flag} {path}: is a directory; give a .json or .jsonl file")
        elif not os.path.exists(path):
            p.append(f"{flag} {path}: no such file")
        elif not os.path.isfile(path):
            p.append(f"{flag} {path}: not a regular file (a pipe or device?); give a .json or .jsonl file")
    if training_args.eval_strategy != "no" and not data_args.eval_data_path:
        p.append(f"--eval_strategy {training_args.eval_strategy}: evaluation needs --eval_data_path; add it or use "
                 "--eval_strategy no")
    cache = data_args.data_cache_dir
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        p.append(f"--data_cache_dir {cache}: is a file; give a folder (it is created if missing)")
    env_cache = os.environ.get("SFT_CACHE_DIR")
    if not cache and env_cache and os.path.exists(env_cache) and not os.path.isdir(env_cache):
        p.append(f"SFT_CACHE_DIR={env_cache}: is a file; point it at a folder (it is created if missing) or unset it")
    if data_args.preprocessing_num_workers is not None and data_args.preprocessing_num_workers < 1:
        p.append(f"--preprocessing_num_workers {data_args.preprocessing_num_workers}: must be at least 1")
    p += _check_packing(data_args, training_args)
    return p


def _check_packing(data_args, training_args) -> list[str]:
    if not data_args.packing:
        return []
    p = []
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
        p.append(f"--learning_rate {t.learning_rate}: must be a number >= 0 (e.g. 2e-4 for LoRA, 1e-5 for full "
                 "fine-tuning)")
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
    if not 0 <= t.seed < 2**32:
        p.append(f"--seed {t.seed}: must be in [0, 2**32)")
    if t.peak_tflops is not None and not (math.isfinite(t.peak_tflops) and t.peak_tflops > 0):
        p.append(f"--peak_tflops {t.peak_tflops}: must be a positive number of TFLOP/s (or leave it unset to measure)")
    if t.fp16_requested_without_cuda:
        p.append("--fp16 True: fp16 training needs a CUDA GPU and none is visible; on CPU use --bf16 True or "
                 "leave both off (fp32)")
    if (t.fp16 or t.fp16_requested_without_cuda) and t.bf16:
        p.append("--fp16 True and --bf16 True: choose one precision")
    p += t.deepspeed_problems
    hf_ds = getattr(t, "hf_deepspeed_config", None) if t.deepspeed else None
    if hf_ds is not None and hf_ds.mismatches:
        from .ds_config import mismatch_problems

        p += mismatch_problems(t.deepspeed_requested, hf_ds.mismatches)
    for name in t.report_to or []:
        if name in _REPORTERS and not _importable(*_REPORTERS[name]):
            p.append(f"--report_to {name}: the {name} package is not installed; pip install it or use --report_to none")
    if "bnb" in str(t.optim) and not _importable("bitsandbytes"):
        p.append(f"--optim {t.optim}: needs bitsandbytes, which is not installed; use --optim adamw_torch")
    return p


def _check_lora(model_args, t, lora_args) -> list[str]:
    p = []
    if lora_args.q_lora:
        from .ds_config import EXAMPLE

        if not t.use_lora:
            p.append("--q_lora True: Q-LoRA trains a LoRA adapter on the 4-bit base model; add --use_lora True")
        if not _importable("bitsandbytes"):
            p.append("--q_lora True: needs bitsandbytes (4-bit NF4), which is not installed; pip install "
                     "bitsandbytes, or use --use_lora True without --q_lora")
        if t.zero_stage == 3:
            p.append(f"--q_lora True with --deepspeed {t.deepspeed_requested} (ZeRO-3): ZeRO-3 partitions every "
                     "weight across ranks, and bitsandbytes' packed 4-bit weights cannot be partitioned or gathered "
                     f"by it; use ZeRO-2 (--deepspeed {EXAMPLE}, the finetune_qlora_ds.sh "
                     "default: the frozen 4-bit base is replicated, adapter gradients and optimizer state are "
                     "sharded) or plain LoRA (--q_lora False) with ZeRO-3")
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
    from .checkpoint import check_resume

    resume_problems, resuming_here = check_resume(t)
    p += resume_problems
    if os.path.isdir(out) and os.listdir(out) and not t.overwrite_output_dir and not resuming_here:
        p.append(f"--output_dir {out}: the folder is not empty; pass --overwrite_output_dir True to write "
                 "into it anyway, or choose another folder")
    return p


def validate(model_args: ModelArguments, data_args: DataArguments, training_args: TrainingArguments,
             lora_args: LoraArguments) -> None:
    """Check every rule that can be checked without loading the model; raise once with all problems.

    Raises:
        ConfigError: one line per problem, each naming the flag, the value and the fix.
    """
    p = (_check_model(model_args.model_name_or_path) + _check_data(data_args, training_args)
         + _check_training(training_args) + _check_lora(model_args, training_args, lora_args)
         + _check_output(training_args))
    m, out = model_args.model_name_or_path, training_args.output_dir
    if m and out and os.path.isdir(m) and os.path.realpath(m) == os.path.realpath(out):
        p.append(f"--output_dir {out}: is the base model's folder; saving would overwrite the model you train "
                 "from; choose another folder")
    if p:
        raise ConfigError(p)
