"""One training run: data -> tokenizer -> datasets -> model (LoRA) -> transformers.Trainer -> save."""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Optional, Sequence

import transformers

from sft.model.attention import PACKED_ATTENTION
from sft.train.metrics import install as install_throughput_callback
from sft.train.progress import install as install_progress_callback
from sft.data.chat import chat_control_tokens, visualize
from sft.train.checkpoint import run_info
from sft.data.dataset import build_dataset, make_collator
from sft.data.spec import PreparationSpec
from sft.distributed.failures import raise_if_peer_lost
from sft.distributed.fingerprints import check_same_inputs
from sft.distributed.rendezvous import preflight_enabled
from sft.errors import ConfigError
from sft.logs import setup_logging
from sft.model.loading import apply_lora, generation_config_for, load_model, load_tokenizer, torch_dtype
from sft.train.memory_plan import plan_run
from sft.app.settings import apply_memory_plan, apply_run_shape, derive, with_memory_plan
from sft.data.packing import PackedCollator, pack_dataset
from sft.model.attention import check_packing_support
from sft.train.trainer import micro_batches

logger = logging.getLogger("sft")


def log_run_shape(world_size: int, micro_batch: int, grad_accum: int, n_train: int, max_steps: int,
                  num_epochs: float, device: str = "cpu", backend: Optional[str] = None,
                  micro_batches_per_rank: Optional[int] = None) -> dict:
    """Derived quantities, computed once and logged at start: global batch = micro batch x gradient accumulation x
    world size (samples; rows with --packing; at most that many under a token budget); optimizer steps =
    ``max_steps`` if > 0, else epochs x ``n_train // global batch`` (at least 1 per epoch), or with
    ``micro_batches_per_rank`` (a :class:`sft.train.trainer.TokenBudgetBatchSampler`'s length) epochs x
    ``ceil(micro_batches_per_rank / grad_accum)``. Returns them as a dict."""
    global_batch = micro_batch * grad_accum * world_size
    steps_per_epoch = max(1, n_train // global_batch) if micro_batches_per_rank is None else \
        max(1, -(-micro_batches_per_rank // grad_accum))
    total = max_steps if max_steps > 0 else int(steps_per_epoch * num_epochs)
    logger.info("world size %d (device %s, backend %s); micro batch %d x gradient accumulation %d x world size %d = "
                "global batch %d samples; %d training samples; %d optimizer steps",
                world_size, device, backend or "-", micro_batch, grad_accum, world_size, global_batch, n_train, total)
    return {"global_batch": global_batch, "optimizer_steps": total}


def data_sources(data_args) -> dict[str, list[str]]:
    """``{"train": [--data_path sources], "eval": [--eval_data_path] or []}``; with ``--eval_split_ratio`` (and no
    ``--eval_data_path``) ``"eval"`` is the ``--data_path`` sources too, of which :func:`load_records` keeps the
    held-out records."""
    train = data_args.data_path
    train = [train] if isinstance(train, str) else list(train or [])
    split = train if data_args.eval_split_ratio is not None else []
    return {"train": train, "eval": [data_args.eval_data_path] if data_args.eval_data_path else split}


def control_tokens_for(tok, system_message: Optional[str]) -> list[str]:
    """The chat template's control tokens (refused in every text of the data).

    Raises:
        ConfigError: ``system_message`` holds one.
    """
    control = chat_control_tokens(tok)
    found = [t for t in control if t in (system_message or "")]
    if found:
        raise ConfigError([f"--system_message contains the control token(s) {', '.join(found)}; remove them (they "
                           "would become real chat-template tokens in every sample)"])
    return control


def preparation_spec(data_args, training_args) -> PreparationSpec:
    """The run's data preparation settings from the parsed flags (the one place that maps them; see
    :class:`sft.data.spec.PreparationSpec` for each field): ``--model_max_length``, ``--system_message``,
    ``--on_bad_record``, ``--lazy_preprocess``, ``--long_conversations`` (as resolved), ``--data_cache_dir``,
    ``--preprocessing_num_workers``, ``--data_weights``, ``--data_seed`` (else ``--seed``), ``--data_timeout``,
    ``--eval_split_ratio`` and ``--eval_split_seed``."""
    weights = data_args.data_weights
    return PreparationSpec(
        max_len=training_args.model_max_length, system_message=data_args.system_message,
        on_bad_record=data_args.on_bad_record, lazy=data_args.lazy_preprocess,
        long_conversations=data_args.long_conversations_mode, cache_dir=data_args.data_cache_dir,
        num_proc=data_args.preprocessing_num_workers, weights=tuple(weights) if weights is not None else None,
        seed=training_args.data_seed if training_args.data_seed is not None else training_args.seed,
        data_timeout=data_args.data_timeout, eval_split_ratio=data_args.eval_split_ratio,
        eval_split_seed=data_args.eval_split_seed, last_reply_only=data_args.mask_history,
        allow_dropped_content=data_args.allow_dropped_content)


def load_records(sources: dict[str, list[str]], tok, eot: int, spec: PreparationSpec) -> dict:
    """The train / eval datasets of the named sources (``{"train": [paths], "eval": [paths] or []}``): streamed,
    validated (control tokens refused), prepared by every rank into memory-mapped shards as ``spec`` says
    (:func:`preparation_spec`) and, for train, mixed by ``spec.weights`` (:func:`sft.data.dataset.build_dataset`).
    The one place that decides which records train and which evaluate: with ``spec.eval_split_ratio`` (the eval
    sources being the train sources, :func:`data_sources`) a record is held out by
    :func:`sft.data.eval_split.in_eval` of its id and ``spec.eval_split_seed``, in the stream, so each side is
    prepared from its own records only. Every sample keeps its record's ``id`` column (eager mode). Returns
    ``{name: (dataset, report) or None}``; every rank of the job calls it at the same point.

    Raises:
        ConfigError: ``spec.system_message`` holds a control token.
        DataError: a file or record problem (``spec.on_bad_record`` "error"), no record left, a split that leaves
            one side empty, or a shard not ready within ``spec.data_timeout`` seconds.
    """
    from sft.data.shards import JobView, agree
    from sft.data.dataset import default_cache_dir

    control = control_tokens_for(tok, spec.system_message)
    root = spec.cache_dir or default_cache_dir()
    os.makedirs(root, exist_ok=True)
    plan = agree(root, JobView.from_env())
    split = spec.eval_split_ratio is not None and sources.get("eval") == sources["train"]
    out = {}
    for name, paths in sources.items():
        side = dataclasses.replace(spec, cache_dir=root, weights=spec.weights if name == "train" else None)
        out[name] = build_dataset(paths, tok, eot, side, control_tokens=control, plan=plan,
                                  held_out=(name == "eval") if split else None) if paths else None
    return out


def log_dataset(name: str, ds, report, tok, max_len: int) -> None:
    """The truncation report and, for train, the first sample with its supervised tokens marked."""
    if report is None:  # lazy: counted as samples are met
        logger.info("%s: %d conversations, tokenized on access (--lazy_preprocess)", name, len(ds))
        return
    for line in report.lines(name, max_len):
        logger.info("%s", line)
    if name == "train":
        shown = visualize(tok, ds[0]["input_ids"], ds[0]["labels"])
        more = f"\n... ({len(shown) - 1200} more characters; sft-show-sample prints it all)" if len(shown) > 1200 else ""
        logger.info("first training sample (supervised tokens in «»):\n%s%s", shown[:1200], more)


def pack_datasets(train_ds, eval_ds, max_len: int, pad_token_id: int = 0):
    """``--packing``: rows of several conversations (:mod:`sft.data.packing`). Returns ``(train, eval, collator)``."""
    packed = []
    for name, ds in (("train", train_ds), ("eval", eval_ds)):
        if ds is not None:
            ds, report = pack_dataset(ds, max_len)
            logger.info("%s", report.line(name))
        packed.append(ds)
    return packed[0], packed[1], PackedCollator(pad_token_id)


def padding_free_collator(model, padding_collator):
    """``--padding_free True`` (the default, without ``--packing``): :class:`sft.data.packing.PaddingFreeCollator` when
    the model can run :data:`sft.model.attention.PACKED_ATTENTION`; otherwise ``padding_collator`` (logged)."""
    from sft.model.attention import use_packed_attention
    from sft.data.packing import PaddingFreeCollator
    from sft.model.attention import attention_implementation

    if use_packed_attention(model):
        logger.info("padding-free batches: the samples of a micro batch end to end in one row, position ids restart "
                    "per sample, attention '%s' per sample without a mask (--padding_free False pads instead)",
                    PACKED_ATTENTION)
        return PaddingFreeCollator()
    logger.info("padding each micro batch to its longest sample: attention '%s' cannot keep samples apart without "
                "a mask (padding-free batches need sdpa or flash_attention_2, no sliding window, no soft cap)",
                attention_implementation(model))
    return padding_collator


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


def build_trainer(model_args, data_args, training_args, lora_args, callbacks=None, settings=None):
    """Everything up to a ready ``transformers.Trainer`` (the orchestrator: it unpacks the argument objects into
    the values each step takes). Needs :func:`sft.distributed.process_group.setup_runtime` first. ``settings``: the
    run's :class:`sft.app.settings.RunSettings` (default: derived from ``training_args``), completed here by the
    memory plan. Returns ``(trainer, tokenizer, eot_id)``."""
    from sft.distributed.process_group import setup_runtime
    from sft.distributed.progress import RECORD

    setup_runtime(training_args)  # idempotent: the process group before data preparation's collectives
    if settings is None:  # called on its own (tests, benchmarks): the run's shape as given
        settings = derive(training_args)
        apply_run_shape(training_args, settings)
    tok, eot, grew = load_tokenizer(model_args.model_name_or_path, model_args.trust_remote_code,
                                    training_args.cache_dir, model_args.chat_template, model_args.chat_template_kwargs)
    prepared = load_records(data_sources(data_args), tok, eot, preparation_spec(data_args, training_args))
    datasets = {}
    for name, got in prepared.items():
        datasets[name] = got[0] if got else None
        if got:
            log_dataset(name, *got, tok, training_args.model_max_length)
    train_ds, eval_ds = datasets["train"], datasets["eval"]
    collator = make_collator(tok)
    if data_args.packing:
        train_ds, eval_ds, collator = pack_datasets(train_ds, eval_ds, training_args.model_max_length,
                                                    tok.pad_token_id)
    # Seed before the model exists (Trainer seeds only later, in its __init__): LoRA's A matrices (and any new
    # embedding rows) are drawn from the global RNG, and how much of it data preparation consumed differs
    # between a cache miss and a cache hit; the same --seed then gives the same adapter on any number of nodes.
    (transformers.enable_full_determinism if training_args.full_determinism else transformers.set_seed)(training_args.seed)
    model, grew = load_model(
        model_args.model_name_or_path, tok, grew, dtype=torch_dtype(training_args.bf16, training_args.fp16),
        trust_remote_code=model_args.trust_remote_code, cache_dir=training_args.cache_dir,
        quantize_4bit=lora_args.q_lora, device=training_args.device,
        activation_checkpointing=bool(training_args.activation_checkpointing),
        activation_checkpointing_kwargs=training_args.activation_checkpointing_kwargs,
        load_on_device=not (training_args.deepspeed or training_args.fsdp))
    if training_args.use_lora:
        model = apply_lora(model, tok, grew, r=lora_args.lora_r, alpha=lora_args.lora_alpha,
                           dropout=lora_args.lora_dropout, target_modules=lora_args.lora_target_modules,
                           bias=lora_args.lora_bias, train_embeddings=model_args.train_embeddings,
                           activation_checkpointing=bool(training_args.activation_checkpointing))
    if data_args.packing:
        impl = check_packing_support(model)
        logger.info("packing: attention implementation '%s' (%s)", impl,
                    "causal attention per conversation, split where position ids restart, no mask"
                    if impl == PACKED_ATTENTION else "block-diagonal causal mask from restarting position ids")
    elif data_args.padding_free:
        collator = padding_free_collator(model, collator)
    check_optimizer_and_scheduler(training_args, model)
    sampler, tokens = micro_batches(train_ds, data_args, training_args)
    unset_budget = sampler is not None and training_args.max_tokens_per_micro_batch is None
    budget, checkpointing = plan_run(model, tokens, training_args, lora_args,
                                     budget_floor=training_args.model_max_length if unset_budget else None)
    apply_memory_plan(training_args, with_memory_plan(settings, budget, checkpointing))
    if budget is not None:  # the micro batches again, under the budget the plan chose
        sampler, tokens = micro_batches(train_ds, data_args, training_args)
    from sft.train.trainer import Trainer  # transformers.Trainer whose --group_by_length order resumes exactly

    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
        data_collator=collator, processing_class=tok, callbacks=callbacks,
        supervised_head=training_args.lm_head_supervised_only, train_batch_sampler=sampler,
    )
    if settings.bf16_reason:
        logger.info("--bf16 auto: %s (%s)", "bf16" if settings.bf16 else "fp32", settings.bf16_reason)
    if training_args.lm_head_supervised_only:
        logger.info("LM head and loss: %s", "at supervised positions only (--lm_head_supervised_only)"
                    if trainer.supervised_head else "every position (FSDP)" if trainer.is_fsdp_enabled else
                    f"every position (model type '{getattr(model.config, 'model_type', '?')}' has no plain LM head, see sft/model/loss.py)")
    install_throughput_callback(trainer, training_args.peak_tflops)
    install_progress_callback(trainer, training_args.straggler_factor, training_args.straggler_window)
    log_run_shape(training_args.world_size, training_args.per_device_train_batch_size,
                  training_args.gradient_accumulation_steps, len(train_ds), training_args.max_steps,
                  training_args.num_train_epochs, str(training_args.device), training_args.ddp_backend,
                  len(sampler) if sampler is not None else None)
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
    ``SFT_PREFLIGHT=0``), resumes from :func:`sft.train.checkpoint.choose_resume` (``auto`` by default: the newest
    verified checkpoint), writes checkpoints with a completion marker and checksums (:mod:`sft.train.checkpoint`), and stops cleanly on SIGTERM/SIGINT or when
    one of ``step_checks`` (run on every rank at every optimizer step end) gives a reason (:mod:`sft.train.preemption`).

    Raises:
        Preempted: a signal stopped training after a checkpoint was saved (exit code 75).
        PeerLost: another process of the job went away or a collective timed out (exit code 1).
        CheckpointError: no checkpoint in ``--output_dir`` verifies, or a save ran out of disk space (exit code 2).
    """
    from sft.train.checkpoint import CheckpointError, choose_resume, install, latest_complete, warn_if_different, zero_world_size
    from sft.distributed.process_group import elastic_start_line
    from sft.train.integrity import is_out_of_space, out_of_space_message
    from sft.train.preemption import Preempted, PreemptionHandler
    from sft.compat.deepspeed import separate_zero3_universal_steps
    from sft.train.world_size import ensure_universal, plan_world_size_change

    from sft.distributed.process_group import setup_runtime
    from sft.distributed.progress import RECORD

    setup_runtime(training_args)  # idempotent (train() ran it): the process group before the collectives below
    setup_logging()
    # Installed before loading (a signal then still ends in a checkpoint after the first step) and kept
    # through the final save (a signal there only starts the watchdog that bounds the time to exit).
    preemption = PreemptionHandler(training_args.preemption_timeout, step_checks).install()
    peers: dict = {}
    try:
        RECORD.set("checking every rank's inputs")
        if preflight_enabled():  # several processes: same data, model config, tokenizer and version everywhere
            sources = data_sources(data_args)
            files = {f"--data_path {p}" if len(sources["train"]) > 1 else "--data_path": p for p in sources["train"]}
            files.update({"--eval_data_path": p for p in sources["eval"]})
            peers = check_same_inputs(model_args.model_name_or_path, files)
        resume = choose_resume(training_args.output_dir, training_args.resume_from_checkpoint,
                               training_args.overwrite_output_dir, training_args.process_index, training_args.should_save)
        line = elastic_start_line(os.environ, training_args.world_size, resume)
        if line and training_args.local_process_index == 0:  # one line per node, every round
            logger.warning(line)
        configured_grad_accum = training_args.gradient_accumulation_steps  # recorded in every checkpoint's marker
        change = plan_world_size_change(resume, training_args.world_size, training_args.per_device_train_batch_size,
                                        configured_grad_accum)
        rebuild = "accumulation" if change and training_args.deepspeed else None  # DeepSpeed's "auto" values follow
        if training_args.deepspeed and resume and zero_world_size(resume) not in (None, training_args.world_size):
            # ZeRO's optimizer state partitioned at another world size: through a universal checkpoint
            universal = ensure_universal(resume, training_args.process_index, training_args.ddp_timeout)
            separate_zero3_universal_steps()  # ZeRO-3 loads one Adam step counter shared by every parameter group
            rebuild = "universal"
            if change:
                change.universal = universal
            else:
                logger.info("resuming %s: ZeRO's optimizer state re-partitioned from the universal checkpoint %s",
                            resume, universal)
        if change:
            logger.info("%s", change.line())
        # before the Trainer exists: its accelerator and the checkpoint marker's run shape read it
        settings = derive(training_args, resume, change.grad_accum if change else None, rebuild, sft_rotation=True)
        apply_run_shape(training_args, settings)
        callbacks = [install(training_args, configured_grad_accum, settings.save_total_limit), preemption]
        RECORD.set("loading the model and the data (data preparation)")
        trainer, tok, eot = build_trainer(model_args, data_args, training_args, lora_args, callbacks=callbacks,
                                          settings=settings)
        if resume:
            logger.info("resuming from %s", os.path.abspath(resume))
            warn_if_different(resume, run_info(training_args, configured_grad_accum))
        trainer.train(resume_from_checkpoint=resume)
        if preemption.preempted and trainer.state.global_step < trainer.state.max_steps:
            where = os.path.join(os.path.abspath(training_args.output_dir), f"checkpoint-{preemption.stopped_at}")
            raise Preempted(f"stopped by {preemption.cause or signal_name(preemption.signum)} at step {preemption.stopped_at} of "
                            f"{trainer.state.max_steps}; checkpoint {where}; run the same command again to resume")
        RECORD.set("finishing (final evaluation and save)", trainer.state.global_step)
        if trainer.eval_dataset is not None:
            log_eval_change(trainer.state.log_history, trainer.evaluate(), trainer.state.global_step)
        save(trainer, tok, eot, training_args.output_dir)
    except Exception as e:  # a lost node or a timed-out collective: say which node, not a 100-line traceback
        if is_out_of_space(e, training_args.output_dir):  # the checkpoint being written has no marker: ignored
            out = training_args.output_dir
            raise CheckpointError(out_of_space_message(e, out, latest_complete(out))) from e
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


def train(argv: Optional[Sequence[str]] = None, extra: tuple = (), step_checks: Sequence[Callable] = ()) -> str:
    """Parse -> validate -> runtime setup -> :func:`run`. Returns the output folder.

    ``extra``: a launcher's own flag dataclasses (parsed and ignored here, so one command line / YAML serves both).
    ``step_checks``: callables run on every rank at every optimizer step end (:class:`sft.train.preemption.PreemptionHandler`).

    Raises:
        SFTError: any problem the user can fix (exit code 2), ``Preempted`` (75), ``PeerLost`` (1).
    """
    from sft.app.validation import validate
    from sft.config.arguments import parse_args
    from sft.distributed.process_group import setup_runtime

    try:  # parsing starts the process group under torchrun, setup_runtime DeepSpeed's communication on it
        model_args, data_args, training_args, lora_args = parse_args(argv, extra)[:4]
        validate(model_args, data_args, training_args, lora_args)
        setup_runtime(training_args)
    except Exception as e:  # a peer lost before training: named like one lost during it (run() does that)
        raise_if_peer_lost(e, None, {})
        raise
    return run(model_args, data_args, training_args, lora_args, step_checks=step_checks)
