"""One training run: data -> tokenizer -> datasets -> model (LoRA) -> transformers.Trainer -> save."""
from __future__ import annotations

import logging
import os

import transformers

from .callbacks import install as install_throughput_callback
from .chat import chat_control_tokens, visualize
from .data import load_conversations, reject_control_tokens
from .errors import ConfigError
from .dataset import LazySupervisedDataset, build_dataset, make_collator
from .distributed import check_same_inputs, preflight_enabled
from .logs import setup_logging
from .modeling import apply_lora, generation_config_for, load_model, load_tokenizer
from .packing import PackedCollator, check_packing_support, pack_dataset

logger = logging.getLogger("sft")


def log_run_shape(training_args, n_train: int) -> None:
    """Derived quantities, computed once and logged at start (global batch = micro x accumulation x world)."""
    world = training_args.world_size
    micro = training_args.per_device_train_batch_size
    accum = training_args.gradient_accumulation_steps
    global_batch = micro * accum * world
    steps_per_epoch = max(1, n_train // global_batch)
    total = training_args.max_steps if training_args.max_steps > 0 else int(steps_per_epoch * training_args.num_train_epochs)
    logger.info("world size %d (device %s, backend %s); micro batch %d x gradient accumulation %d x world size %d = "
                "global batch %d samples; %d training samples; %d optimizer steps",
                world, training_args.device, training_args.ddp_backend or "-", micro, accum, world, global_batch,
                n_train, total)


def load_data(model_args, data_args, training_args):
    """Validated conversations (train, eval or None) and the tokenizer. Returns ``(train, eval, tok, eot, grew)``."""
    convs = {name: load_conversations(path, data_args.on_bad_record) if path else None
             for name, path in (("train", data_args.data_path), ("eval", data_args.eval_data_path))}
    tok, eot, grew = load_tokenizer(model_args, training_args)
    control = chat_control_tokens(tok)
    found = [t for t in control if t in (data_args.system_message or "")]
    if found:
        raise ConfigError([f"--system_message contains the control token(s) {', '.join(found)}; remove them (they "
                           "would become real chat-template tokens in every sample)"])
    for name, path in (("train", data_args.data_path), ("eval", data_args.eval_data_path)):
        if convs[name] is not None:
            convs[name] = reject_control_tokens(convs[name], control, path, data_args.on_bad_record)
    return convs["train"], convs["eval"], tok, eot, grew


def make_dataset(name, convs, path, tok, eot, data_args, training_args):
    """The tokenized dataset for ``convs`` (lazy or cached), with its report logged."""
    max_len = training_args.model_max_length
    if data_args.lazy_preprocess:
        logger.info("%s: %d conversations, tokenized on access (--lazy_preprocess)", name, len(convs))
        return LazySupervisedDataset(convs, tok, eot, max_len, data_args.system_message, path)
    ds, report = build_dataset(convs, path, tok, eot, max_len, data_args.system_message, training_args,
                               data_args.data_cache_dir, data_args.preprocessing_num_workers, name)
    for line in report.lines(name, max_len):
        logger.info("%s", line)
    if name == "train":
        shown = visualize(tok, ds[0]["input_ids"], ds[0]["labels"])
        more = f"\n... ({len(shown) - 1200} more characters; scripts/show_sample.py prints it all)" if len(shown) > 1200 else ""
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
    """Everything up to a ready ``transformers.Trainer``. Returns ``(trainer, tokenizer, eot_id)``."""
    if preflight_enabled():  # several processes: same data, model config, tokenizer and version everywhere
        check_same_inputs(model_args.model_name_or_path, {"--data_path": data_args.data_path,
                                                          "--eval_data_path": data_args.eval_data_path})
    train_convs, eval_convs, tok, eot, grew = load_data(model_args, data_args, training_args)
    train_ds = make_dataset("train", train_convs, data_args.data_path, tok, eot, data_args, training_args)
    eval_ds = (make_dataset("eval", eval_convs, data_args.eval_data_path, tok, eot, data_args, training_args)
               if eval_convs is not None else None)
    collator = make_collator(tok)
    if getattr(data_args, "packing", False):
        train_ds, eval_ds, collator = pack_datasets(train_ds, eval_ds, training_args.model_max_length)
    # Seed before the model exists (Trainer seeds only later, in its __init__): LoRA's A matrices (and any new
    # embedding rows) are drawn from the global RNG, and how much of it data preparation consumed differs
    # between a cache miss and a cache hit; the same --seed then gives the same adapter on any number of nodes.
    (transformers.enable_full_determinism if training_args.full_determinism else transformers.set_seed)(training_args.seed)
    model, grew = load_model(model_args, training_args, tok, grew, lora_args)
    if training_args.use_lora:
        model = apply_lora(model, tok, model_args, lora_args, training_args, grew)
    if getattr(data_args, "packing", False):
        logger.info("packing: attention implementation '%s' (block-diagonal causal mask from restarting position ids)",
                    check_packing_support(model))
    check_optimizer_and_scheduler(training_args, model)
    from .sampling import Trainer  # transformers.Trainer whose --group_by_length order resumes exactly

    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
        data_collator=collator, processing_class=tok, callbacks=callbacks,
    )
    install_throughput_callback(trainer, getattr(training_args, "peak_tflops", None))
    log_run_shape(training_args, len(train_ds))
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


def run(model_args, data_args, training_args, lora_args) -> str:
    """Train and save. Returns the output folder.

    Resumes from :func:`sft.checkpoint.resolve_resume` (``auto`` by default), writes checkpoints with a
    completion marker (:mod:`sft.checkpoint`), and stops cleanly on SIGTERM/SIGINT (:mod:`sft.preemption`).

    Raises:
        Preempted: a signal stopped training after a checkpoint was saved (exit code 75).
    """
    from .checkpoint import install, resolve_resume, warn_if_different
    from .preemption import Preempted, PreemptionHandler

    setup_logging()
    # Installed before loading (a signal then still ends in a checkpoint after the first step) and kept
    # through the final save (a signal there only starts the watchdog that bounds the time to exit).
    preemption = PreemptionHandler(training_args.preemption_timeout).install()
    try:
        resume = resolve_resume(training_args)
        callbacks = [install(training_args), preemption]
        trainer, tok, eot = build_trainer(model_args, data_args, training_args, lora_args, callbacks=callbacks)
        if resume:
            logger.info("resuming from %s", os.path.abspath(resume))
            warn_if_different(resume, training_args)
        trainer.train(resume_from_checkpoint=resume)
        if preemption.preempted and trainer.state.global_step < trainer.state.max_steps:
            where = os.path.join(os.path.abspath(training_args.output_dir), f"checkpoint-{preemption.stopped_at}")
            raise Preempted(f"stopped by {preemption.cause or signal_name(preemption.signum)} at step {preemption.stopped_at} of "
                            f"{trainer.state.max_steps}; checkpoint {where}; run the same command again to resume")
        save(trainer, tok, eot, training_args.output_dir)
    finally:
        preemption.uninstall()
    if trainer.is_world_process_zero():
        kind = "adapter" if training_args.use_lora else "model"
        logger.info("saved %s, tokenizer and generation config to %s", kind, os.path.abspath(training_args.output_dir))
    return training_args.output_dir


def signal_name(signum) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except (ValueError, TypeError):
        return "a signal (received by another rank)"
