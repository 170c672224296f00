"""One training run: data -> tokenizer -> datasets -> model (LoRA) -> transformers.Trainer -> save."""
from __future__ import annotations

import logging
import os

import transformers

from .chat import chat_control_tokens, visualize
from .data import load_conversations, reject_control_tokens
from .dataset import LazySupervisedDataset, build_dataset, make_collator
from .logs import setup_logging
from .modeling import apply_lora, generation_config_for, load_model, load_tokenizer

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


def build_trainer(model_args, data_args, training_args, lora_args, callbacks=None):
    """Everything up to a ready ``transformers.Trainer``. Returns ``(trainer, tokenizer, eot_id)``."""
    max_len = training_args.model_max_length
    train_convs = load_conversations(data_args.data_path, data_args.on_bad_record)
    eval_convs = (load_conversations(data_args.eval_data_path, data_args.on_bad_record)
                  if data_args.eval_data_path else None)

    tok, eot, grew = load_tokenizer(model_args, training_args)
    control = chat_control_tokens(tok)
    train_convs = reject_control_tokens(train_convs, control, data_args.data_path, data_args.on_bad_record)
    if eval_convs is not None:
        eval_convs = reject_control_tokens(eval_convs, control, data_args.eval_data_path, data_args.on_bad_record)
    datasets_ = {}
    for name, convs, path in (("train", train_convs, data_args.data_path), ("eval", eval_convs, data_args.eval_data_path)):
        if convs is None:
            continue
        if data_args.lazy_preprocess:
            datasets_[name] = LazySupervisedDataset(convs, tok, eot, max_len, data_args.system_message, path)
            logger.info("%s: %d conversations, tokenized on access (--lazy_preprocess)", name, len(convs))
        else:
            ds, report = build_dataset(convs, path, tok, eot, max_len, data_args.system_message, training_args,
                                       data_args.data_cache_dir, data_args.preprocessing_num_workers, name)
            datasets_[name] = ds
            for line in report.lines(name, max_len):
                logger.info("%s", line)
            if name == "train":
                shown = visualize(tok, ds[0]["input_ids"], ds[0]["labels"])
                more = f"\n... ({len(shown) - 1200} more characters; scripts/show_sample.py prints it all)" if len(shown) > 1200 else ""
                logger.info("first training sample (supervised tokens in «»):\n%s%s", shown[:1200], more)

    model, grew = load_model(model_args, training_args, tok, grew)
    if training_args.use_lora:
        model = apply_lora(model, tok, model_args, lora_args, training_args, grew)
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=datasets_["train"], eval_dataset=datasets_.get("eval"),
        data_collator=make_collator(tok), processing_class=tok, callbacks=callbacks,
    )
    log_run_shape(training_args, len(datasets_["train"]))
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
    """Train and save. Returns the output folder."""
    setup_logging()
    trainer, tok, eot = build_trainer(model_args, data_args, training_args, lora_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    save(trainer, tok, eot, training_args.output_dir)
    if trainer.is_world_process_zero():
        kind = "adapter" if training_args.use_lora else "model"
        logger.info("saved %s, tokenizer and generation config to %s", kind, os.path.abspath(training_args.output_dir))
    return training_args.output_dir
