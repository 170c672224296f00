"""One training run: data -> tokenizer -> datasets -> model (LoRA) -> transformers.Trainer -> save."""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional, Sequence

import transformers

from .callbacks import install as install_throughput_callback
from .chat import chat_control_tokens, visualize
from .checkpoint import run_info
from .data import load_conversations, reject_control_tokens
from .dataset import LazySupervisedDataset, build_dataset, make_collator
from .distributed.failures import raise_if_peer_lost
from .distributed.fingerprints import check_same_inputs
from .distributed.rendezvous import preflight_enabled
from .errors import ConfigError
from .eval_split import split_records
from .logs import setup_logging
from .modeling import apply_lora, generation_config_for, load_model, load_tokenizer, torch_dtype
from .packing import PackedCollator, check_packing_support, pack_dataset

logger = logging.getLogger("sft")


def log_run_shape(world_size: int, micro_batch: int, grad_accum: int, n_train: int, max_steps: int,
                  num_epochs: float, device: str = "cpu", backend: Optional[str] = None) -> dict:
    """Derived quantities, computed once and logged at start: global batch = micro batch x gradient accumulation x
    world size (samples; rows with --packing); optimizer steps = ``max_steps`` if > 0, else epochs x
    ``n_train // global batch`` (at least 1 per epoch). Returns them as a dict."""
    global_batch = micro_batch * grad_accum * world_size
    steps_per_epoch = max(1, n_train // global_batch)
    total = max_steps if max_steps > 0 else int(steps_per_epoch * num_epochs)
    logger.info("world size %d (device %s, backend %s); micro batch %d x gradient accumulation %d x world size %d = "
                "global batch %d samples; %d training samples; %d optimizer steps",
                world_size, device, backend or "-", micro_batch, grad_accum, world_size, global_batch, n_train, total)
    return {"global_batch": global_batch, "optimizer_steps": total}


def load_records(data_files: dict[str, Optional[str]], on_bad_record: str, tok,
                 system_message: Optional[str] = None, eval_split_ratio: Optional[float] = None,
                 eval_split_seed: int = 0) -> dict[str, Optional[list]]:
    """Validated conversations of each named file (``{"train": path, "eval": path or None}``), with the chat
    template's control tokens refused in every text (``tok``'s template decides which). With
    ``eval_split_ratio`` and no eval file, ``"eval"`` is the records of the train file held out by
    :func:`sft.eval_split.split_records` (and ``"train"`` the rest).

    Raises:
        ConfigError: ``system_message`` holds a control token.
        DataError: a file or record problem (``on_bad_record`` "error"), no record left, or a split that leaves
            one side empty.
    """
    control = chat_control_tokens(tok)
    found = [t for t in control if t in (system_message or "")]
    if found:
        raise ConfigError([f"--system_message contains the control token(s) {', '.join(found)}; remove them (they "
                           "would become real chat-template tokens in every sample)"])
    out = {}
    for name, path in data_files.items():
        convs = load_conversations(path, on_bad_record) if path else None
        out[name] = reject_control_tokens(convs, control, path, on_bad_record) if convs is not None else None
    if eval_split_ratio is not None and out.get("eval") is None:
        out["train"], out["eval"] = split_records(out["train"], eval_split_ratio, eval_split_seed, data_files["train"])
    return out


def data_paths(data_args) -> dict[str, Optional[str]]:
    """The file each dataset is read from: ``--eval_data_path``, or ``--data_path`` itself with ``--eval_split_ratio``."""
    split = data_args.data_path if data_args.eval_split_ratio is not None else None
    return {"train": data_args.data_path, "eval": data_args.eval_data_path or split}


def check_data(model_args, data_args, training_args) -> list[str]:
    """What ``sft-check`` and the launchers check before starting several processes: the tokenizer loads and every
    record of ``--data_path`` / ``--eval_data_path`` is valid. Returns one summary line per file.

    Raises:
        SFTError: as :func:`load_records` and :func:`sft.modeling.load_tokenizer`.
    """
    tok, _, _ = load_tokenizer(model_args.model_name_or_path, model_args.trust_remote_code, training_args.cache_dir)
    files = {"train": data_args.data_path, "eval": data_args.eval_data_path}
    convs = load_records(files, data_args.on_bad_record, tok, data_args.system_message, data_args.eval_split_ratio,
                         data_args.eval_split_seed)
    if data_args.eval_split_ratio is not None and not data_args.eval_data_path:
        n_train, n_eval = len(convs["train"]), len(convs["eval"])
        return [f"{files['train']}: {n_train + n_eval} valid conversations ({n_train} for training, {n_eval} held out "
                f"for evaluation by --eval_split_ratio {data_args.eval_split_ratio})"]
    return [f"{files[name]}: {len(c)} valid conversations" for name, c in convs.items() if c is not None]


def make_dataset(name: str, convs, path: str, tok, eot: int, *, max_len: int, system_message: Optional[str] = None,
                 lazy: bool = False, cache_dir: Optional[str] = None, num_proc: Optional[int] = None,
                 main_process_first=None, rank: int = 0, long_conversations: str = "split"):
    """The tokenized dataset for ``convs`` (lazy, or cached: see :func:`sft.dataset.build_dataset` for the rank
    coordination), with its report logged."""
    if lazy:
        logger.info("%s: %d conversations, tokenized on access (--lazy_preprocess)", name, len(convs))
        return LazySupervisedDataset(convs, tok, eot, max_len, system_message, path)
    ds, report = build_dataset(convs, path, tok, eot, max_len, system_message, cache_dir, num_proc, name,
                               main_process_first, rank, long_conversations)
    for line in report.lines(name, max_len):
        logger.info("%s", line)
    if name == "train":
        shown = visualize(tok, ds[0]["input_ids"], ds[0]["labels"])
        more = f"\n... ({len(shown) - 1200} more characters; sft-show-sample prints it all)" if len(shown) > 1200 else ""
        logger.info("first training sample (supervised tokens in «»):\n%s%s", shown[:1200], more)
    return ds


def pack_datasets(train_ds, eval_ds, max_len: int):
    """``--packing``: rows of several conversations (:mod:`sft.packing`). Returns ``(train, eval, collator)``."""
    packed = []
    for name, ds in (("train", train_ds), ("eval", eval_ds)):
        if ds is not None:
            ds, report = pack_dataset(ds, max_len)
            logger.info("%s", report.line(name))
        packed.append(ds)
    return packed[0], packed[1], PackedCollator()


def check_optimizer_and_scheduler(training_args, model) -> None:
    """Build the optimizer class and the LR scheduler once on a dummy parameter, so that a missing optional
    package or a scheduler without its required kwargs is reported before training starts.

    Raises:
        ConfigError: naming --optim / --lr_scheduler_type and the library's reason.
    """
    import torch

    try:
        transformers.Trainer.get_optimizer_cls_and_kwargs(training_args, model)
    except (ImportError, ValueError, KeyError) as e:
        raise ConfigError([f"--optim {getattr(training_args.optim, 'value', training_args.optim)}: {str(e).strip().splitlines()[0][:300]}"]) from None
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=training_args.learning_rate)
    try:
        transformers.get_scheduler(training_args.lr_scheduler_type, dummy, num_warmup_steps=0, num_training_steps=10,
                                   scheduler_specific_kwargs=training_args.lr_scheduler_kwargs)
    except (ImportError, ValueError, TypeError, KeyError) as e:
        name = getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)
        raise ConfigError([f"--lr_scheduler_type {name}: "
                           f"{str(e).strip().splitlines()[0][:300]} (give them with --lr_scheduler_kwargs)"]) from None


def build_trainer(model_args, data_args, training_args, lora_args, callbacks=None):
    """Everything up to a ready ``transformers.Trainer`` (the orchestrator: it unpacks the argument objects into
    the values each step takes). Needs :func:`sft.distributed.process_group.setup_runtime` first.
    Returns ``(trainer, tokenizer, eot_id)``."""
    tok, eot, grew = load_tokenizer(model_args.model_name_or_path, model_args.trust_remote_code,
                                    training_args.cache_dir)
    files = {"train": data_args.data_path, "eval": data_args.eval_data_path}
    convs = load_records(files, data_args.on_bad_record, tok, data_args.system_message, data_args.eval_split_ratio,
                         data_args.eval_split_seed)
    files = data_paths(data_args)  # the eval dataset of a split is read from --data_path
    ranks = {"main_process_first": functools.partial(training_args.main_process_first, local=False),
             "rank": training_args.process_index}
    datasets = {name: make_dataset(name, convs[name], files[name], tok, eot, max_len=training_args.model_max_length,
                                   system_message=data_args.system_message, lazy=data_args.lazy_preprocess,
                                   cache_dir=data_args.data_cache_dir, num_proc=data_args.preprocessing_num_workers,
                                   long_conversations=data_args.long_conversations_mode, **ranks)
                if convs[name] is not None else None
                for name in ("train", "eval")}
    train_ds, eval_ds = datasets["train"], datasets["eval"]
    collator = make_collator(tok)
    if data_args.packing:
        train_ds, eval_ds, collator = pack_datasets(train_ds, eval_ds, training_args.model_max_length)
    # Seed before the model exists (Trainer seeds only later, in its __init__): LoRA's A matrices (and any new
    # embedding rows) are drawn from the global RNG, and how much of it data preparation consumed differs
    # between a cache miss and a cache hit; the same --seed then gives the same adapter on any number of nodes.
    (transformers.enable_full_determinism if training_args.full_determinism else transformers.set_seed)(training_args.seed)
    model, grew = load_model(
        model_args.model_name_or_path, tok, grew, dtype=torch_dtype(training_args.bf16, training_args.fp16),
        trust_remote_code=model_args.trust_remote_code, cache_dir=training_args.cache_dir,
        quantize_4bit=lora_args.q_lora, device=training_args.device,
        activation_checkpointing=bool(training_args.activation_checkpointing),
        activation_checkpointing_kwargs=training_args.activation_checkpointing_kwargs)
    if training_args.use_lora:
        model = apply_lora(model, tok, grew, r=lora_args.lora_r, alpha=lora_args.lora_alpha,
                           dropout=lora_args.lora_dropout, target_modules=lora_args.lora_target_modules,
                           bias=lora_args.lora_bias, train_embeddings=model_args.train_embeddings,
                           activation_checkpointing=bool(training_args.activation_checkpointing))
    if data_args.packing:
        logger.info("packing: attention implementation '%s' (block-diagonal causal mask from restarting position ids)",
                    check_packing_support(model))
    check_optimizer_and_scheduler(training_args, model)
    from .sampling import Trainer  # transformers.Trainer whose --group_by_length order resumes exactly

    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
        data_collator=collator, processing_class=tok, callbacks=callbacks,
    )
    install_throughput_callback(trainer, training_args.peak_tflops)
    log_run_shape(training_args.world_size, training_args.per_device_train_batch_size,
                  training_args.gradient_accumulation_steps, len(train_ds), training_args.max_steps,
                  training_args.num_train_epochs, str(training_args.device), training_args.ddp_backend)
    return trainer, tok, eot


def save(trainer, tok, eot_id: int, output_dir: str) -> None:
    """Rank 0 writes weights (adapter or full, safetensors), tokenizer with chat template, generation config."""
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.generation_config = generation_config_for(base, tok, eot_id)
    trainer.save_model(output_dir)  # barrier-safe: only the main process writes
    if trainer.is_world_process_zero():
        base.generation_config.save_pretrained(output_dir)
        trainer.save_state()
    trainer.accelerator.wait_for_everyone()


def run(model_args, data_args, training_args, lora_args, step_checks: Sequence[Callable] = ()) -> str:
    """Train and save (after :func:`sft.distributed.process_group.setup_runtime`). Returns the output folder.

    Compares the inputs of every rank first (:func:`sft.distributed.fingerprints.check_same_inputs`, unless
    ``SFT_PREFLIGHT=0``), resumes from :func:`sft.checkpoint.resolve_resume` (``auto`` by default), writes
    checkpoints with a completion marker (:mod:`sft.checkpoint`), and stops cleanly on SIGTERM/SIGINT or when
    one of ``step_checks`` (run on every rank at every optimizer step end) gives a reason (:mod:`sft.preemption`).

    Raises:
        Preempted: a signal stopped training after a checkpoint was saved (exit code 75).
        PeerLost: another process of the job went away or a collective timed out (exit code 1).
    """
    from .checkpoint import install, resolve_resume, warn_if_different
    from .preemption import Preempted, PreemptionHandler

    setup_logging()
    # Installed before loading (a signal then still ends in a checkpoint after the first step) and kept
    # through the final save (a signal there only starts the watchdog that bounds the time to exit).
    preemption = PreemptionHandler(training_args.preemption_timeout, step_checks).install()
    peers: dict = {}
    try:
        if preflight_enabled():  # several processes: same data, model config, tokenizer and version everywhere
            peers = check_same_inputs(model_args.model_name_or_path, {"--data_path": data_args.data_path,
                                                                      "--eval_data_path": data_args.eval_data_path})
        resume = resolve_resume(training_args.output_dir, training_args.resume_from_checkpoint,
                                training_args.overwrite_output_dir)
        callbacks = [install(training_args), preemption]
        trainer, tok, eot = build_trainer(model_args, data_args, training_args, lora_args, callbacks=callbacks)
        if resume:
            logger.info("resuming from %s", os.path.abspath(resume))
            warn_if_different(resume, run_info(training_args))
        trainer.train(resume_from_checkpoint=resume)
        if preemption.preempted and trainer.state.global_step < trainer.state.max_steps:
            where = os.path.join(os.path.abspath(training_args.output_dir), f"checkpoint-{preemption.stopped_at}")
            raise Preempted(f"stopped by {preemption.cause or signal_name(preemption.signum)} at step {preemption.stopped_at} of "
                            f"{trainer.state.max_steps}; checkpoint {where}; run the same command again to resume")
        if trainer.eval_dataset is not None:
            log_eval_change(trainer.state.log_history, trainer.evaluate(), trainer.state.global_step)
        save(trainer, tok, eot, training_args.output_dir)
    except Exception as e:  # a lost node or a timed-out collective: say which node, not a 100-line traceback
        raise_if_peer_lost(e, training_args.ddp_timeout, peers)
        raise
    finally:
        preemption.uninstall()
    if trainer.is_world_process_zero():
        kind = "adapter" if training_args.use_lora else "model"
        logger.info("saved %s, tokenizer and generation config to %s", kind, os.path.abspath(training_args.output_dir))
    return training_args.output_dir


def log_eval_change(log_history: list[dict], final: dict, step: int) -> Optional[str]:
    """Log ``eval loss BEFORE (before training) -> AFTER (after step N)``: BEFORE is the first ``eval_loss`` of the
    Trainer's ``log_history`` (``--eval_on_start True`` puts one at step 0; kept across a resume), AFTER the
    ``eval_loss`` of ``final`` (``Trainer.evaluate()``). Returns the line (None when ``final`` has no loss)."""
    after = final.get("eval_loss")
    if after is None:
        return None
    first = next((h for h in log_history if "eval_loss" in h), None)
    if first is None or first.get("step") == step:  # only the final evaluation (evaluate() logs it too)
        line = f"eval loss {after:.4f} after step {step} (pass --eval_on_start True for the loss before training)"
    else:
        when = "before training" if first.get("step", 0) == 0 else f"at step {first['step']}"
        line = f"eval loss {first['eval_loss']:.4f} ({when}) -> {after:.4f} (after step {step})"
    logger.info("%s", line)
    return line


def signal_name(signum) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except (ValueError, TypeError):
        return "a signal (received by another rank)"
