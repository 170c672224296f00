"""One training run, in one straight line: parse -> validate -> runtime (started once) -> plan -> train -> save.

:func:`train` parses and :func:`begin` starts (validation, then the runtime: the one call of
:func:`sft.distributed.process_group.start_runtime`); :func:`run` decides the resume (:func:`sft.train.resume.
plan_resume`) and the run's settings (:func:`sft.app.settings.derive`), builds the Trainer in steps
(:func:`build_trainer`: :func:`sft.app.data.prepare_data` -> :func:`prepare_model` -> :func:`plan_memory` ->
:func:`make_trainer`), trains and saves. Tests and benchmarks build the same Trainer through :func:`trainer_for`.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Callable, Optional, Sequence

import torch
import transformers

from sft.app.data import PreparedData, prepare_data
from sft.app.settings import apply_memory_plan, apply_run_shape, derive, with_memory_plan
from sft.app.specs import data_sources, load_spec, lora_spec
from sft.app.validation import validate
from sft.config.arguments import parse_args
from sft.config.settings import RunSettings
from sft.data.batches.packing import PaddingFreeCollator, SequenceParallelSplit
from sft.data.store.cache_key import preparation_code_fingerprint
from sft.distributed import expert_parallel
from sft.distributed.failures import raise_if_peer_lost
from sft.distributed.fingerprints import check_same_inputs
from sft.distributed.process_group import Runtime, elastic_start_line, start_runtime
from sft.distributed.rendezvous import preflight_enabled
from sft.distributed.watchdog import RECORD
from sft.errors import ConfigError
from sft.logs import setup_logging
from sft.model.attention import PACKED_ATTENTION, attention_implementation, check_packing_support, use_packed_attention
from sft.model.expert_parallel import spread_experts
from sft.model.experts import mark_zero3_leaf_blocks
from sft.model.loading import apply_lora, generation_config_for, load_model
from sft.model.loss import use_supervised_head
from sft.model.routing import model_aux_coef, resolve_aux_coef
from sft.model.sequence_parallel import use_sequence_parallel_attention
from sft.model.token_mixers import keep_documents_apart, sequence_parallel_problem
from sft.train import checkpoint, metrics, routing_health, stragglers
from sft.train.checkpoint import CheckpointError, latest_complete, run_info, warn_if_different
from sft.train.integrity import is_checkpoint_failure, is_out_of_space, out_of_space_message
from sft.train.memory_plan import ParallelShape, choose_checkpointing, held_and_available, plan, probe_logged
from sft.train.preemption import Preempted, PreemptionHandler
from sft.train.resume import plan_resume
from sft.train.trainer import Trainer, micro_batches

logger = logging.getLogger("sft")


def train(argv: Optional[Sequence[str]] = None, extra: tuple = (), step_checks: Sequence[Callable] = ()) -> str:
    """Parse -> :func:`begin` (validate, start the runtime) -> :func:`run`. Returns the output folder.

    ``extra``: a launcher's own flag dataclasses (parsed and ignored here, so one command line / YAML serves both).
    ``step_checks``: callables run on every rank at every optimizer step end
    (:class:`sft.train.preemption.PreemptionHandler`).

    Raises:
        SFTError: any problem the user can fix (exit code 2), ``Preempted`` (75), ``PeerLost`` (1).
    """
    try:
        model_args, data_args, training_args, lora_args = parse_args(argv, extra)[:4]
        runtime = begin(model_args, data_args, training_args, lora_args)
    except Exception as e:  # a peer lost before training: named like one lost during it (run() does that)
        raise_if_peer_lost(e, None, {})
        raise
    return run(model_args, data_args, training_args, lora_args, runtime, step_checks=step_checks)


def begin(model_args, data_args, training_args, lora_args) -> Runtime:
    """Validate every flag (:func:`sft.app.validation.validate`: one error listing every problem), then start this
    process's runtime -- the one call of :func:`sft.distributed.process_group.start_runtime` (the bounded process
    group under torchrun, the device, DeepSpeed's communication). Returns the :class:`Runtime`.

    Raises:
        ConfigError: a flag problem, or torchrun's variables incomplete.
    """
    validate(model_args, data_args, training_args, lora_args)
    return start_runtime(training_args)


def run(model_args, data_args, training_args, lora_args, runtime: Runtime,
        step_checks: Sequence[Callable] = ()) -> str:
    """Train and save on a started ``runtime`` (:func:`begin`). Returns the output folder.

    Compares the inputs of every rank first (:func:`sft.distributed.fingerprints.check_same_inputs`, unless
    ``SFT_PREFLIGHT=0``), resumes as :func:`sft.train.resume.plan_resume` decides (``auto`` by default: the newest
    verified checkpoint), writes checkpoints with a completion marker and checksums (:mod:`sft.train.checkpoint`),
    and stops cleanly on SIGTERM/SIGINT or when one of ``step_checks`` (run on every rank at every optimizer step
    end) gives a reason (:mod:`sft.train.preemption`).

    Raises:
        Preempted: a signal stopped training after a checkpoint was saved (exit code 75).
        PeerLost: another process of the job went away or a collective timed out (exit code 1).
        CheckpointError: no checkpoint in ``--output_dir`` verifies, or a save ran out of disk space (exit code 2).
    """
    setup_logging()
    # Installed before loading (a signal then still ends in a checkpoint after the first step) and kept
    # through the final save (a signal there only starts the watchdog that bounds the time to exit).
    preemption = PreemptionHandler(training_args.preemption_timeout, step_checks).install()
    peers: dict = {}
    out = training_args.output_dir
    try:
        RECORD.set("checking every rank's inputs")
        if preflight_enabled():  # several processes: same data, model config, tokenizer and version everywhere
            sources = data_sources(data_args)
            files = {f"--data_path {p}" if len(sources["train"]) > 1 else "--data_path": p for p in sources["train"]}
            files.update({"--eval_data_path": p for p in sources["eval"]})
            code = {"data preparation code (sft/data)": preparation_code_fingerprint()[:16]}
            peers = check_same_inputs(model_args.model_name_or_path, files, code)
        resume = plan_resume(out, training_args.resume_from_checkpoint, training_args.overwrite_output_dir, runtime,
                             saver=training_args.should_save, micro_batch=training_args.per_device_train_batch_size,
                             grad_accum=training_args.gradient_accumulation_steps,
                             deepspeed=bool(training_args.deepspeed), timeout_s=training_args.ddp_timeout)
        line = elastic_start_line(os.environ, runtime.world_size, resume.checkpoint)
        if line and runtime.local_rank == 0:  # one line per node, every round
            logger.warning(line)
        if resume.line():
            logger.info("%s", resume.line())
        # before the Trainer exists: its accelerator and the checkpoint marker's run shape read it
        settings = derive(training_args, runtime, resume, sft_rotation=True)
        apply_run_shape(training_args, settings)
        callbacks = [checkpoint.callback(settings, training_args.seed, training_args.use_lora,
                                         background_saves(training_args)), preemption]
        RECORD.set("loading the model and the data (data preparation)")
        trainer, tok, eot = build_trainer(model_args, data_args, training_args, lora_args, runtime, settings,
                                          callbacks=callbacks)
        if resume.checkpoint:
            logger.info("resuming from %s", os.path.abspath(resume.checkpoint))
            warn_if_different(resume.checkpoint, run_info(settings, training_args.seed, training_args.use_lora))
        trainer.train(resume_from_checkpoint=resume.checkpoint)
        if preemption.preempted and trainer.state.global_step < trainer.state.max_steps:
            where = os.path.join(os.path.abspath(out), f"checkpoint-{preemption.stopped_at}")
            raise Preempted(f"stopped by {preemption.cause or signal_name(preemption.signum)} at step "
                            f"{preemption.stopped_at} of {trainer.state.max_steps}; checkpoint {where}; run the same "
                            "command again to resume")
        RECORD.set("finishing (final evaluation and save)", trainer.state.global_step)
        if trainer.eval_dataset is not None:
            log_eval_change(trainer.state.log_history, trainer.evaluate(), trainer.state.global_step)
        save(trainer, tok, eot, out)
    except BaseException as e:  # a lost node or a timed-out collective: say which node, not a 100-line traceback
        if not isinstance(e, Exception) and not is_checkpoint_failure(e):  # KeyboardInterrupt, SystemExit
            raise
        if is_out_of_space(e, out):  # the checkpoint being written has no marker: ignored
            raise CheckpointError(out_of_space_message(e, out, latest_complete(out))) from e
        raise_if_peer_lost(e, training_args.ddp_timeout, peers)
        raise
    finally:
        preemption.uninstall()
    if runtime.is_main:
        kind = "adapter" if training_args.use_lora else "model"
        logger.info("saved %s, tokenizer and generation config to %s", kind, os.path.abspath(out))
    return out


def build_trainer(model_args, data_args, training_args, lora_args, runtime: Runtime, settings: RunSettings,
                  callbacks: Sequence = ()):
    """A ready :class:`sft.train.trainer.Trainer` on a started ``runtime``, in four steps:
    :func:`sft.app.data.prepare_data` ->
    :func:`prepare_model` -> :func:`plan_memory` (the ``settings`` of :func:`sft.app.settings.derive`, already applied
    with :func:`sft.app.settings.apply_run_shape`, completed and applied) -> :func:`make_trainer`. Returns
    ``(trainer, tokenizer, eot_id)``."""
    data = prepare_data(model_args, data_args, training_args)
    model, collator = prepare_model(model_args, data_args, training_args, lora_args, runtime, data)
    if training_args.deepspeed and training_args.parsed.zero_stage == 3:
        log_zero3_leaf_blocks(mark_zero3_leaf_blocks(model))
    head = use_supervised_head(model, training_args.lm_head_supervised_only, fsdp=bool(training_args.fsdp))
    settings, sampler, n_micro = plan_memory(model, data.train, data_args, training_args, lora_args, settings, head)
    # LoRA trains the router only with --lora_router True (read with a default: the flag comes with expert LoRA)
    router_trained = not training_args.use_lora or bool(getattr(lora_args, "lora_router", False))
    aux = resolve_aux_coef(model, training_args.moe_aux_loss_coef, router_trained)
    trainer = make_trainer(model, data, collator, training_args, settings, head, sampler, callbacks,
                           aux if model_aux_coef(model) is not None else None)
    log_run_shape(settings, runtime, len(data.train), training_args.max_steps, training_args.num_train_epochs, n_micro)
    return trainer, data.tok, data.eot


def log_zero3_leaf_blocks(blocks: list) -> None:
    """One line naming the mixture-of-experts blocks ZeRO-3 gathers whole (:func:`sft.model.experts.
    mark_zero3_leaf_blocks`); nothing for a dense model."""
    if blocks:
        kinds = ", ".join(sorted({type(b).__name__ for _, b in blocks}))
        logger.info("ZeRO-3: %d mixture-of-experts blocks are leaf modules (%s): each gathers all its experts' "
                    "parameters on entry, also on a rank whose tokens reach no token of some expert", len(blocks),
                    kinds)


def trainer_for(model_args, data_args, training_args, lora_args, callbacks: Sequence = (),
                sft_checkpoints: bool = False):
    """The Trainer of tests and benchmarks, derived as :func:`run` derives it for a fresh start: :func:`begin`,
    :func:`sft.app.settings.derive`, :func:`build_trainer`. ``sft_checkpoints``: sft's checkpoint callback (marker,
    rotation once complete) is added, as in :func:`run`; otherwise the Trainer rotates its own checkpoints.
    Returns ``(trainer, tokenizer, eot_id)``."""
    runtime = begin(model_args, data_args, training_args, lora_args)
    settings = derive(training_args, runtime, sft_rotation=sft_checkpoints)
    apply_run_shape(training_args, settings)
    if sft_checkpoints:
        callbacks = [checkpoint.callback(settings, training_args.seed, training_args.use_lora,
                                         background_saves(training_args)), *callbacks]
    return build_trainer(model_args, data_args, training_args, lora_args, runtime, settings, callbacks)


def prepare_model(model_args, data_args, training_args, lora_args, runtime: Runtime, data: PreparedData):
    """The model on this process's device (LoRA applied with ``--use_lora``), seeded first, and the collator its
    attention allows (padding-free rows by default); under ``--sequence_parallel_size`` N > 1 the attention over the
    whole row (:func:`sft.model.sequence_parallel.use_sequence_parallel_attention`) and this rank's slice of every
    row (:class:`sft.data.batches.packing.SequenceParallelSplit`); under ``--expert_parallel_size`` N > 1 this rank's
    E/N experts (:func:`sft.model.expert_parallel.spread_experts`). Returns ``(model, collator)``.

    Raises:
        ConfigError: ``--optim`` / ``--lr_scheduler_type`` cannot be built (:func:`check_optimizer_and_scheduler`), or
            sequence parallelism cannot run with this model's attention.
    """
    # Seed before the model exists (Trainer seeds only later, in its __init__): LoRA's A matrices (and any new
    # embedding rows) are drawn from the global RNG, and how much of it data preparation consumed differs
    # between a cache miss and a cache hit; the same --seed then gives the same adapter on any number of nodes.
    seed = transformers.enable_full_determinism if training_args.full_determinism else transformers.set_seed
    seed(training_args.seed)
    model, grew = load_model(model_args.model_name_or_path, data.tok, data.vocab_grew,
                             load_spec(model_args, training_args, lora_args), device=torch.device(runtime.device))
    if training_args.use_lora:
        model = apply_lora(model, data.tok, grew, lora_spec(model_args, lora_args),
                           activation_checkpointing=bool(training_args.activation_checkpointing))
    if expert_parallel.current().enabled:  # E/N routed experts per rank, their LoRA too (validation checked E)
        spread_experts(model, expert_parallel.current())
    collator = data.collator
    if data_args.packing:
        impl = check_packing_support(model)
        logger.info("packing: attention implementation '%s' (%s)", impl,
                    "causal attention per conversation, split where position ids restart, no mask"
                    if impl == PACKED_ATTENTION else "block-diagonal causal mask from restarting position ids")
    elif data_args.padding_free:
        collator = padding_free_collator(model, collator)
    sp = runtime.sequence_parallel
    if data_args.packing or collator is not data.collator:  # rows of several documents: stateful layers told too
        problems = sequence_parallel_problem(sp.size if sp.enabled else 1, kinds=keep_documents_apart(model))
        if problems:  # validation reads the config first; this is the loaded model's word
            raise ConfigError(problems)
    if sp.enabled:  # each rank of the group: its slice of the row; attention sees the whole row
        use_sequence_parallel_attention(model, sp, training_args.sequence_parallel_mode)
        collator = SequenceParallelSplit(collator, sp.size, sp.rank, data.tok.pad_token_id or 0)
    check_optimizer_and_scheduler(training_args, model)
    return model, collator


def plan_memory(model, train_ds, data_args, training_args, lora_args, settings: RunSettings, supervised_head: bool):
    """The memory plan for the largest micro batch (:mod:`sft.train.memory_plan`: logged; an unset budget lowered,
    then an unset ``--gradient_checkpointing`` turned on, where the run does not fit), and the micro batches again
    under the budget it chose. Returns ``(settings completed by the plan, batch sampler or None, micro batches per
    rank or None)``; the plan's outcome is written for the Trainer (:func:`sft.app.settings.apply_memory_plan`).

    Raises:
        SFTError: the plan does not fit on some rank and ``--memory_check refuse`` (the default).
    """
    t = training_args
    sampler, tokens = micro_batches(train_ds, data_args, t)
    floor = t.model_max_length if sampler is not None and t.max_tokens_per_micro_batch is None else None
    fsdp_own = bool(t.fsdp and isinstance(t.fsdp_config, dict) and t.fsdp_config.get("activation_checkpointing"))
    parallel = ParallelShape(world_size=settings.world_size, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE",
                             "1")), zero_stage=t.parsed.zero_stage if t.deepspeed else 0, deepspeed=bool(t.deepspeed),
                             fsdp=bool(t.fsdp), sequence_parallel=settings.sequence_parallel)
    fixes = [] if t.use_lora else ["--use_lora True (adapters only: no gradients or optimizer state for the base "
                                   "weights)"]
    if parallel.world_size > 1 and not t.deepspeed and not t.fsdp and t.expert_parallel_size == 1:  # EP: DDP only
        fixes.append(f"--deepspeed finetune/ds_config_zero2.json (optimizer state and gradients sharded over the "
                     f"{parallel.world_size} processes)")
    held = held_and_available(torch.device(t.device), parallel.local_world_size, model)  # before the probe: the step
    measured = None if t.deepspeed and t.parsed.zero_stage == 3 else probe_logged(model)  # reuses the probe's memory
    lora_dropout = bool(t.use_lora and lora_args.lora_dropout > 0)

    def make(on: bool, micro_batch_tokens: Optional[int] = None):  # this rank's plan (sft.train.memory_plan.plan)
        return plan(model, tokens=micro_batch_tokens or tokens, checkpointing=on, optim=t.optim, parallel=parallel,
                    supervised_head=supervised_head, lora_dropout=lora_dropout, device=t.device, held_available=held,
                    measured=measured, staged_checkpoint=t.save_async)

    requested = True if fsdp_own else t.parsed.activation_checkpointing
    turn_on, _, budget = choose_checkpointing(make, requested, t.memory_check, tuple(fixes), floor)
    settings = with_memory_plan(settings, budget, turn_on and not fsdp_own and not t.activation_checkpointing)
    apply_memory_plan(training_args, settings)
    if budget is not None:  # the micro batches again, under the budget the plan chose
        sampler, tokens = micro_batches(train_ds, data_args, training_args)
    return settings, sampler, len(sampler) if sampler is not None else None


def make_trainer(model, data: PreparedData, collator, training_args, settings: RunSettings, supervised_head: bool,
                 sampler, callbacks: Sequence, moe_aux_loss_coef: Optional[float] = None) -> Trainer:
    """The :class:`sft.train.trainer.Trainer` with the throughput, routing (mixture of experts) and straggler figures
    attached, and the decisions logged (precision under ``--bf16 auto``, where the LM head runs)."""
    trainer = Trainer(
        model=model, args=training_args, train_dataset=data.train, eval_dataset=data.eval,
        data_collator=collator, processing_class=data.tok, callbacks=list(callbacks),
        supervised_head=supervised_head, train_batch_sampler=sampler, moe_aux_loss_coef=moe_aux_loss_coef,
        background_saves=next((c.saves for c in callbacks if isinstance(c, checkpoint.AtomicCheckpoints)), None),
    )
    if settings.bf16_reason:
        logger.info("--bf16 auto: %s (%s)", "bf16" if settings.bf16 else "fp32", settings.bf16_reason)
    if training_args.lm_head_supervised_only:
        model_type = getattr(model.config, "model_type", "?")
        logger.info("LM head and loss: %s", "at supervised positions only (--lm_head_supervised_only)"
                    if supervised_head else "every position (FSDP)" if training_args.fsdp else
                    f"every position (model type '{model_type}' has no plain LM head, see sft/model/loss.py)")
    routing_health.attach(trainer)  # its line after the step line: metrics' callback goes ahead of it
    metrics.attach(trainer, training_args.peak_tflops)
    stragglers.attach(trainer, training_args.straggler_factor, training_args.straggler_window)
    return trainer


def log_run_shape(settings: RunSettings, runtime: Runtime, n_train: int, max_steps: int, num_epochs: float,
                  micro_batches_per_rank: Optional[int] = None) -> dict:
    """Log the run's shape once at start: world size, device, backend, micro batch x gradient accumulation x world
    size (data-parallel size under sequence parallelism) = global batch (:attr:`RunSettings.global_batch`; samples,
    rows with --packing, at most that many under a token budget), training samples and optimizer steps =
    ``max_steps`` if > 0, else epochs x ``n_train // global batch`` (at least 1 per epoch), or with
    ``micro_batches_per_rank`` (a :class:`sft.train.trainer.TokenBudgetBatchSampler`'s length) epochs x
    ``ceil(micro_batches_per_rank / grad_accum)``. Returns ``{"global_batch", "optimizer_steps"}``."""
    s, global_batch = settings, settings.global_batch
    steps_per_epoch = max(1, n_train // global_batch) if micro_batches_per_rank is None else \
        max(1, -(-micro_batches_per_rank // s.grad_accum))
    total = max_steps if max_steps > 0 else int(steps_per_epoch * num_epochs)
    dp = (f"data-parallel size {s.data_parallel_size} (world size {s.world_size} / sequence-parallel size "
          f"{s.sequence_parallel})" if s.sequence_parallel > 1 else f"world size {s.world_size}")
    logger.info("world size %d (device %s, backend %s); micro batch %d x gradient accumulation %d x %s = "
                "global batch %d samples; %d training samples; %d optimizer steps",
                s.world_size, runtime.device, runtime.backend or "-", s.micro_batch, s.grad_accum, dp,
                global_batch, n_train, total)
    return {"global_batch": global_batch, "optimizer_steps": total}


def padding_free_collator(model, padding_collator):
    """``--padding_free True`` (the default, without ``--packing``):
    :class:`sft.data.batches.packing.PaddingFreeCollator` when
    the model can run :data:`sft.model.attention.PACKED_ATTENTION`; otherwise ``padding_collator`` (logged)."""
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
    try:
        transformers.Trainer.get_optimizer_cls_and_kwargs(training_args, model)
    except (ImportError, ValueError, KeyError) as e:
        optim = getattr(training_args.optim, "value", training_args.optim)
        raise ConfigError([f"--optim {optim}: {str(e).strip().splitlines()[0][:300]}"]) from None
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=training_args.learning_rate)
    try:
        transformers.get_scheduler(training_args.lr_scheduler_type, dummy, num_warmup_steps=0, num_training_steps=10,
                                   scheduler_specific_kwargs=training_args.lr_scheduler_kwargs)
    except (ImportError, ValueError, TypeError, KeyError) as e:
        name = getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)
        raise ConfigError([f"--lr_scheduler_type {name}: "
                           f"{str(e).strip().splitlines()[0][:300]} (give them with --lr_scheduler_kwargs)"]) from None


def background_saves(training_args):
    """The run's :class:`sft.train.async_save.BackgroundSaves` under ``--save_async True`` (its gloo process group
    made now: call on every rank), else None."""
    if not training_args.save_async:
        return None
    from sft.distributed.collectives import new_gloo_group
    from sft.train.async_save import BackgroundSaves

    return BackgroundSaves(new_gloo_group())


def save(trainer, tok, eot_id: int, output_dir: str) -> None:
    """Rank 0 writes weights (adapter or full, safetensors), tokenizer with chat template, generation config, and after
    the last collective ``loss_curve.png`` (no rank waits on matplotlib past ``--ddp_timeout``). Under FSDP2 with
    ``SHARDED_STATE_DICT`` the final weights are gathered once, here, as ``FULL_STATE_DICT`` (accelerate's
    ``set_state_dict_type``; transformers 5.24's ``save_model`` writes no weights for sharded state dicts)."""
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.generation_config = generation_config_for(base, tok, eot_id)
    if trainer.sharded_checkpoints:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(output_dir)  # barrier-safe: only the main process writes
    if trainer.is_world_process_zero():
        base.generation_config.save_pretrained(output_dir)
        trainer.save_state()
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero() and (path := metrics.plot_loss_curve(trainer.state.log_history, output_dir)):
        logger.info("loss curve: %s", path)


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
    try:
        return signal.Signals(signum).name
    except (ValueError, TypeError):
        return "a signal (received by another rank)"
