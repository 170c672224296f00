"""Command-line arguments: dataclasses parsed by ``transformers.HfArgumentParser``.

Qwen's ``finetune.py`` flag names keep their meaning (``--model_name_or_path --data_path
--eval_data_path --lazy_preprocess --model_max_length --use_lora --q_lora --lora_r --lora_alpha
--lora_dropout --lora_target_modules --lora_bias``), plus every ``transformers.TrainingArguments``
flag. Flags that transformers 5 removed but Qwen's scripts pass (``--evaluation_strategy``,
``--warmup_ratio``, ``--group_by_length``, ``--overwrite_output_dir``) are accepted and mapped to
their transformers 5 equivalents.

``--config FILE.yaml`` gives defaults; flags on the command line win; a YAML key that is not a
flag is an error. :func:`validate` (:mod:`sft.app.validation`) checks every rule before anything heavy loads and
raises one :class:`~sft.errors.ConfigError` listing all problems. Parsing starts nothing in a single process;
under torchrun it starts the bounded process group (see ``TrainingArguments.__post_init__``).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import transformers

from sft.compat.transformers import parser_actions
from sft.config.deepspeed import read_ds_config, zero_stage
from sft.config.deferred import DeferredRuntime
from sft.config.fsdp import normalize_fsdp_flag, read_fsdp_config
from sft.config.precision import parse_bf16, resolve_bf16
from sft.config.yaml_file import read_yaml, split_config, suggest, yaml_to_argv
from sft.distributed.process_group import prepare_training_args
from sft.errors import ConfigError


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
    chat_template: Optional[str] = field(
        default=None,
        metadata={"help": "A chat template (a Jinja file, e.g. one that renders tool calls) used instead of the "
                  "tokenizer's own; saved with the trained tokenizer, so inference renders as training did."},
    )
    chat_template_kwargs: Optional[str] = field(
        default=None,
        metadata={"help": "A JSON object of extra variables for every rendering of the chat template, e.g. "
                  "'{\"enable_thinking\": false}' (apply_chat_template's keyword arguments); written into the saved "
                  "template as defaults."},
    )


@dataclass
class DataArguments:
    data_path: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Training data (required): one or more sources, each a .json (list) or .jsonl file "
                  "(optionally .gz/.bz2/.xz/.zst), a .parquet file or a datasets save_to_disk folder. Several "
                  "sources are concatenated, or mixed by --data_weights."},
    )
    data_weights: Optional[list[float]] = field(
        default=None,
        metadata={"help": "Mixing weights, one per --data_path source (e.g. 0.7 0.3): the mix has as many samples "
                  "as the sources together, a share w_i / sum(w) from source i (whole passes plus a subset drawn "
                  "with --seed). Unset: every sample of every source once."},
    )
    data_timeout: float = field(
        default=14400.0,
        metadata={"help": "Seconds a rank waits for the other ranks' data shards (completion markers in the cache "
                  "folder) before it stops; independent of --ddp_timeout, so a long preparation does not end the job."},
    )
    eval_data_path: Optional[str] = field(default=None, metadata={"help": "Evaluation data: one source, same formats."})
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
        metadata={"help": "Where tokenized data shards are cached (default: $SFT_CACHE_DIR or ~/.cache/sft/datasets); "
                  "a folder every node sees: each shard is prepared once per job, else once per node."},
    )
    preprocessing_num_workers: Optional[int] = field(
        default=None, metadata={"help": "Processes each rank tokenizes its data shard with (default 1)."}
    )
    long_conversations: Optional[str] = field(
        default=None,
        metadata={"help": "A conversation longer than --model_max_length: 'split' cuts it at turn boundaries into "
                  "several samples (each starts with the system prompt and as much earlier context as fits, "
                  "unsupervised), so every reply that fits with its own user turn is trained exactly once; "
                  "'truncate' keeps its first --model_max_length tokens; 'refuse' splits as 'split' does, but a "
                  "conversation with a turn too long to fit with its context (which 'split' would cut) is an invalid "
                  "record, named with its turn and size in tokens (--on_bad_record error: exit 2). Unset: split, or "
                  "truncate with --lazy_preprocess True (which cannot know a conversation's sample count before "
                  "reading it).",
                  "choices": ["split", "truncate", "refuse"]},
    )
    mask_history: bool = field(default=False, metadata={
        "help": "Train only the last assistant reply of each conversation; earlier replies are context "
                "(LLaMA-Factory's mask_history). Default: every reply not marked \"train\": false / \"weight\": 0."})
    allow_dropped_content: bool = field(default=False, metadata={
        "help": "Train a conversation even when the chat template drops part of it (e.g. reasoning it strips, or the "
                "record's tools under a template that ignores tools); what it drops is counted in the log. Default: "
                "such a record is refused, naming the turn and what is dropped."})
    check_all_records: bool = field(default=False, metadata={
        "help": "sft-check: encode every record with the chat template, as training does (default: validate every "
                "record, encode the first 1000 of each source)."})
    eval_split_ratio: Optional[float] = field(
        default=None,
        metadata={"help": "Without --eval_data_path: hold out this fraction (0 < R < 1) of --data_path's records "
                  "for evaluation, chosen by a hash of each record's id and --eval_split_seed (the same records "
                  "when the file is reordered or grows; records without an id are keyed on their text)."},
    )
    eval_split_seed: int = field(
        default=0, metadata={"help": "Seed of the --eval_split_ratio choice (independent of --seed)."}
    )
    packing: bool = field(default=False, metadata={
        "help": "Pack several conversations into each row of up to --model_max_length tokens (best-fit decreasing); "
                "position ids restart per conversation and attention never crosses conversations. "
                "--per_device_train_batch_size then counts rows. Non-packing alternative: --group_by_length True."})
    padding_free: bool = field(default=True, metadata={
        "help": "Without --packing: lay each micro batch's samples end to end in one row with no padding (position "
                "ids restart per sample, attention per sample without a mask); the same samples, order and loss as "
                "padding them. False: pad each micro batch to its longest sample (dynamic padding, for comparison). "
                "Falls back to padding, with a log line, when the model's attention cannot keep samples apart "
                "without a mask."})

    @property
    def long_conversations_mode(self) -> str:
        """``--long_conversations`` as used: the flag, or its default (``split``; ``truncate`` when lazy)."""
        return self.long_conversations or ("truncate" if self.lazy_preprocess else "split")


@dataclass
class LoraArguments:
    lora_r: int = field(default=64, metadata={"help": "LoRA rank r."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha; the update is scaled by alpha / r."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input, in [0, 1)."})
    lora_target_modules: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Names to adapt: linear modules and expert parameters (gate_up_proj, down_proj). Default: "
                  "attention, every routed expert, shared experts and dense MLPs (lm_head and routers excluded)."},
    )
    lora_router: bool = field(
        default=False, metadata={"help": "Also adapt the routers of mixture-of-experts blocks (frozen by default)."})
    lora_weight_path: str = field(default="", metadata={"help": "Unused; kept so Qwen commands still parse."})
    lora_bias: str = field(
        default="none", metadata={"help": "Which biases to train.", "choices": ["none", "all", "lora_only"]}
    )
    q_lora: bool = field(
        default=False, metadata={"help": "Q-LoRA: 4-bit NF4 base model (bitsandbytes) + LoRA; a pre-quantized base "
                                 "(GPTQ, saved bitsandbytes 4-bit) is loaded as saved, not quantized again."}
    )


@dataclass(frozen=True)
class Parsed:
    """What parsing learns beyond the flags' values, recorded once by ``TrainingArguments.__post_init__`` as
    ``training_args.parsed`` and read by validation (:mod:`sft.app.validation`), the precision agreement
    (:func:`sft.app.settings.derive`) and the memory plan.

    Fields:
        deepspeed: ``--deepspeed`` as typed (a file path, inline JSON text, or None); ``training_args.deepspeed``
            is then the path, the parsed dict (inline JSON) or None (not given, or a config with problems).
        deepspeed_problems: one line per problem of the DeepSpeed config (:func:`sft.config.deepspeed.read_ds_config`).
        zero_stage: the config's ZeRO stage (0 without DeepSpeed).
        fsdp: ``--fsdp`` as typed; fsdp_config: ``--fsdp_config`` as typed (for messages).
        fsdp_problems: one line per problem of ``--fsdp`` / ``--fsdp_config`` (:mod:`sft.config.fsdp`).
        fsdp_on: ``--fsdp`` asked for FSDP (also when its config has problems, so that they are reported).
        activation_checkpointing: ``--gradient_checkpointing`` / ``--activation_checkpointing`` as given; None:
            unset (the memory plan decides, :func:`sft.train.memory_plan.choose_checkpointing`).
        bf16: ``--bf16`` as given: True, False, ``"auto"`` or the text (refused by validation).
        bf16_reason: why ``--bf16 auto`` chose this process's precision (None when not auto).
        fp16_without_cuda: ``--fp16 True`` on a machine without CUDA (switched off here, refused by validation).
    """

    deepspeed: Union[str, dict, None] = None
    deepspeed_problems: tuple[str, ...] = ()
    zero_stage: int = 0
    fsdp: Any = None
    fsdp_config: Any = None
    fsdp_problems: tuple[str, ...] = ()
    fsdp_on: bool = False
    activation_checkpointing: Optional[bool] = None
    bf16: Union[bool, str] = False
    bf16_reason: Optional[str] = None
    fp16_without_cuda: bool = False


@dataclass
class TrainingArguments(DeferredRuntime, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` plus Qwen's training flags.

    On a machine without CUDA, ``use_cpu`` is switched on and ``ddp_backend`` defaults to ``gloo``
    (:func:`sft.distributed.process_group.prepare_training_args`): otherwise ``torchrun --nproc_per_node 2``
    would start two independent trainings on CPU.

    Parsing starts nothing (:class:`sft.config.deferred.DeferredRuntime`).
    """

    model_max_length: int = field(default=8192, metadata={"help": "Maximum sequence length in tokens; longer samples "
                                                            "are split or truncated (reported)."})
    use_lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "transformers cache_dir for from_pretrained."})
    optim: str = field(default="adamw_torch", metadata={"help": "Optimizer name (transformers OptimizerNames)."})
    # Flags removed in transformers 5 that Qwen's scripts still pass; mapped in __post_init__.
    group_by_length: bool = field(default=False, metadata={
        "help": "Batch samples of similar length (train_sampling_strategy=group_by_length)."})
    warmup_ratio: Optional[float] = field(default=None, metadata={
        "help": "Fraction of training steps for LR warmup (sets warmup_steps to it)."})
    evaluation_strategy: Optional[str] = field(
        default=None, metadata={"help": "Old name of --eval_strategy.", "choices": ["no", "steps", "epoch"]}
    )
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Allow writing into a non-empty --output_dir."})
    preemption_timeout: float = field(
        default=300.0,
        metadata={"help": "Seconds from SIGTERM/SIGINT to a forced exit (code 75) if the current step and the "
                  "checkpoint have not finished by then; the last complete checkpoint is kept."},
    )
    save_async: bool = field(default=False, metadata={"help": "Write checkpoints in the background: training waits "
        "only while the weights and optimizer state are copied to host memory; the files, checksums and completion "
        "marker follow from a thread, one save at a time (sft/train/async_save.py). Not with --deepspeed. Under "
        "--fsdp the config's \"state_dict_type\" must be \"SHARDED_STATE_DICT\"."})
    hang_timeout: Optional[float] = field(default=None, metadata={"help": "Seconds without progress after which a "
        "stuck or frozen rank is named (rank, host, last step and phase) and the job ends with code 1 "
        "(sft/distributed/watchdog.py; several processes under torchrun). Unset: 300, at most half of --ddp_timeout, "
        "at least 30. 0: off."})
    straggler_factor: float = field(default=1.5, metadata={"help": "Name a rank whose forward time per token over "
        "the last --straggler_window steps is this many times the median of the other ranks' (sft/train/stragglers.py; "
        "checked at every logging step). 0: off."})
    straggler_window: int = field(default=20, metadata={"help": "Optimizer steps over which --straggler_factor "
        "compares the ranks."})
    bf16: bool = field(default=False, metadata={"help": "Train in bfloat16: True, False (fp32) or auto (bf16 on a GPU "
                       "with it or a CPU with avx512_bf16 / amx_bf16, else fp32; sft/config/precision.py)."})
    lm_head_supervised_only: bool = field(default=True, metadata={"help": "Training: the LM head and loss only at "
        "supervised positions (labels not -100), chunked (sft/model/loss.py); same loss and gradients. False: every "
        "position."})
    max_tokens_per_micro_batch: Optional[int] = field(default=None, metadata={"help": "Padding-free micro batches: "
        "at most this many tokens each (the largest runs first; sft/train/trainer.py). Unset: micro batch x "
        "--model_max_length, lowered by the memory plan (sft/train/memory_plan.py) only when that does not fit."})
    sequence_parallel_size: int = field(default=1, metadata={"help": "Sequence parallelism: split every micro "
        "batch's tokens over this many consecutive ranks (N), each holding 1/N of the row's activations; attention "
        "sees the whole row (docs/long-context.md). Must divide the world size; 1: off."})
    sequence_parallel_mode: str = field(default="auto", metadata={"choices": ["auto", "ulysses", "all_gather"],
        "help": "How attention sees the whole row under --sequence_parallel_size > 1: ulysses (DeepSpeed's "
        "all-to-all over heads; heads and KV heads divisible by N), all_gather (each rank's queries against the "
        "row's gathered keys and values; any head count), auto: ulysses where the heads allow, else all_gather."})
    expert_parallel_size: int = field(default=1, metadata={"help": "Expert parallelism: each of N consecutive ranks "
        "keeps E/N of every layer's routed experts and tokens travel to their experts by all-to-all "
        "(sft/model/expert_parallel.py, docs/moe.md). Must divide the experts and the world size; 1: off."})
    moe_aux_loss_coef: Optional[float] = field(default=None, metadata={"help": "Mixture-of-experts load-balancing "
        "loss weight, the aux loss weighted like the cross entropy over the global batch (docs/moe.md). Unset: "
        "the model's own (config router_aux_loss_coef) when the router is trained, 0 with a frozen router (LoRA)."})
    memory_check: str = field(default="refuse", metadata={"choices": ["refuse", "warn", "off"], "help": "A memory plan "
        "over 90%% of what is available (sft/train/memory_plan.py): exit 2 with the fixes, warn, or only log it. An "
        "unset budget is lowered, then an unset --gradient_checkpointing turned on, when the plan does not fit."})
    peak_tflops: Optional[float] = field(default=None, metadata={"help": "Peak TFLOP/s of one device, the denominator "
        "of the logged MFU (e.g. 989 for an H100 SXM in dense bf16). Unset: $SFT_PEAK_TFLOPS, else a torch.matmul "
        "peak measured at the start."})

    parsed: Parsed = field(init=False, default_factory=lambda: Parsed(), repr=False, metadata={
        "help": "What parsing learned beyond the flags' values (set by __post_init__; not a flag)."})

    def __post_init__(self):
        """Qwen-era flag mapping, the DeepSpeed / FSDP config pre-checks and the precision choice (all pure; recorded
        in :attr:`parsed`), then transformers' own ``__post_init__`` with the runtime deferred (parsing starts
        nothing: :class:`sft.config.deferred.DeferredRuntime`)."""
        if self.evaluation_strategy is not None:
            self.eval_strategy = self.evaluation_strategy
        if self.warmup_ratio is not None and 0 <= self.warmup_ratio < 1:  # otherwise validate() reports it
            self.warmup_steps = float(self.warmup_ratio)
        if self.group_by_length:
            self.train_sampling_strategy = "group_by_length"
        # transformers 5.24's __post_init__ reads --deepspeed (step "12. DeepSpeed") and raises a bare traceback on
        # a bad file: read it first; a config with problems is dropped here and its problems reported by validate().
        deepspeed_requested, deepspeed_problems, stage = self.deepspeed, [], 0
        if isinstance(self.deepspeed, str):
            config, deepspeed_problems = read_ds_config(self.deepspeed, str(getattr(
                self.lr_scheduler_type, "value", self.lr_scheduler_type)))
            if config is None:
                self.deepspeed = None
            else:
                stage = zero_stage(config)
                if self.deepspeed.lstrip().startswith("{"):  # inline JSON (e.g. a YAML mapping): pass the dict
                    self.deepspeed = config
        # The same for --fsdp / --fsdp_config (step "11. FSDP" opens the file): checked by validate().
        fsdp_requested, fsdp_config_requested = self.fsdp, self.fsdp_config
        self.fsdp, fsdp_problems = normalize_fsdp_flag(self.fsdp)
        fsdp_on = bool(self.fsdp) or bool(fsdp_problems)
        if self.fsdp_config is not None:
            self.fsdp_config, problems = read_fsdp_config(self.fsdp_config)
            fsdp_problems += problems
        if fsdp_problems or self.deepspeed:  # never hand transformers a config it would choke on
            self.fsdp = None
        if self.disable_tqdm is None:
            # tqdm redraws its bar with carriage returns: in a file (a scheduler's job log) the bars splice into
            # the log lines. Off unless stderr is a terminal; the per-step numbers (sft.train.metrics) still show
            # progress.
            self.disable_tqdm = not sys.stderr.isatty()
        if self.ddp_find_unused_parameters is None:
            # every parameter of a causal LM (and of a LoRA adapter on it) takes part in each step; DDP's
            # search for unused ones costs a graph traversal per step and warns on every rank.
            self.ddp_find_unused_parameters = False
        # Qwen's --gradient_checkpointing is transformers 5's --activation_checkpointing (same meaning).
        if self.activation_checkpointing is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing, self.gradient_checkpointing = self.gradient_checkpointing, None
        if self.activation_checkpointing_kwargs is None and self.gradient_checkpointing_kwargs is not None:
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
            self.gradient_checkpointing_kwargs = None
        checkpointing_requested = self.activation_checkpointing  # None: unset, decided by the memory plan
        if self.activation_checkpointing and self.activation_checkpointing_kwargs is None:
            # Non-reentrant checkpointing works with frozen inputs (LoRA).
            self.activation_checkpointing_kwargs = {"use_reentrant": False}
        # The device/backend choice (pure), then --bf16 auto -> True / False for this process, before transformers
        # reads it (every rank agrees on it once the runtime has started: sft.app.settings.derive).
        fp16_without_cuda = prepare_training_args(self)
        bf16_requested = parse_bf16(self.bf16)
        self.bf16, bf16_reason = resolve_bf16(bf16_requested, bool(self.fp16 or fp16_without_cuda))
        self.parsed = Parsed(
            deepspeed=deepspeed_requested, deepspeed_problems=tuple(deepspeed_problems), zero_stage=stage,
            fsdp=fsdp_requested, fsdp_config=fsdp_config_requested, fsdp_problems=tuple(fsdp_problems),
            fsdp_on=fsdp_on, activation_checkpointing=checkpointing_requested, bf16=bf16_requested,
            bf16_reason=bf16_reason, fp16_without_cuda=fp16_without_cuda)
        super().__post_init__()


ALL_DATACLASSES = (ModelArguments, DataArguments, TrainingArguments, LoraArguments)


def _flag_names(extra: tuple = ()) -> set[str]:
    names = set()
    for dc in (*ALL_DATACLASSES, *extra):
        names.update(f.name for f in dataclasses.fields(dc) if f.init)
    return names


def parse_args(argv: Optional[list[str]] = None, extra: tuple = ()):
    """Parse argv (default ``sys.argv[1:]``) into (ModelArguments, DataArguments, TrainingArguments, LoraArguments),
    followed by one instance of each dataclass in ``extra`` (a launcher's own flags, e.g. the Ray launcher's;
    their names are then also valid YAML keys).

    Raises:
        ConfigError: bad ``--config`` file, unknown YAML keys, a value argparse cannot convert (or a missing one),
            or a value transformers rejects.
        SystemExit: ``-h`` (exit 0).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = split_config(argv)
    parser = transformers.HfArgumentParser((*ALL_DATACLASSES, *extra))
    parser.add_argument("--config", help="YAML file of flag: value defaults; the command line wins.")

    def error(message: str):  # argparse's own: the whole usage (over 100 lines) above one line; ours: that line
        raise ConfigError([f"{message}; see finetune.py -h (sft-train -h) for the flags"])

    parser.error = error
    # True / False / auto (sft.config.precision)
    next(a for a in parser_actions(parser) if a.dest == "bf16").type = parse_bf16
    if config_path is not None:
        argv = yaml_to_argv(config_path, read_yaml(config_path, _flag_names(extra)), parser) + argv
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=False)
    except ValueError as e:  # raised by TrainingArguments.__post_init__, or for flags no dataclass has
        if "not used by the HfArgumentParser" in str(e):
            known = _flag_names(extra) | {"config"}
            names = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
            unknown = [u for u in names if u[2:] not in known and not (u.startswith("--no_") and u[5:] in known)]
            raise ConfigError([f"unknown flag {u}" + suggest(u[2:], known).replace("'", "'--", 1)
                               + "; see finetune.py -h (sft-train -h) for the flags" for u in unknown]
                              or [str(e).strip()]) from None
        raise ConfigError([str(e).strip()]) from None
    return tuple(parsed[:len(ALL_DATACLASSES)]) + tuple(parsed[len(ALL_DATACLASSES):len(ALL_DATACLASSES) + len(extra)])
