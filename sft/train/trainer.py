"""Training samplers whose order is a function of (seed, epoch), so that a resumed run sees the same batches.

transformers' ``RandomSampler`` is replaced by accelerate's ``SeedableRandomSampler`` (seed + epoch) by default, but
``--group_by_length``'s ``LengthGroupedSampler`` shuffles with the global torch RNG at the start of each epoch. A run
resumed in the middle of epoch e >= 1 draws that shuffle from a different RNG state than the uninterrupted run did
(the Trainer restores the checkpoint's RNG only after skipping the consumed batches), so it would train on other
batches.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler, LengthGroupedSampler

from sft.compat.trainer import TrainerHooks
from sft.distributed import sequence_parallel
from sft.distributed.process_group import enable_fsdp
from sft.model.loss import compute_supervised_loss, shifted_labels
from sft.model.routing import disable_model_aux, weighted_aux
from sft.train.expert_parallel import ExpertParallelSteps


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """``LengthGroupedSampler`` shuffled by ``torch.Generator().manual_seed(seed + epoch)``.

    ``set_epoch`` is called by accelerate's data loader at the start of every epoch (as for
    ``SeedableRandomSampler``, whose convention ``seed + epoch`` this follows).
    """

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths)
        self.seed, self.epoch = int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return super().__iter__()


def sample_lengths(ds) -> Optional[list[int]]:
    """Tokens per sample (row with ``--packing``) of a tokenized dataset, in its order: from the Arrow column
    ``input_ids`` of a ``datasets.Dataset`` without reading the ids into Python; ``None`` for a dataset without
    that column (``--lazy_preprocess``: samples are encoded only when the sampler asks for them)."""
    import datasets

    if isinstance(ds, datasets.Dataset) and "input_ids" in ds.column_names:
        import pyarrow.compute as pc

        column = ds.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
        return pc.list_value_length(column).to_pylist()
    return None


class TokenBudgetBatchSampler(BatchRebalanceSampler):
    """Padding-free micro batches of at most ``micro_batch`` samples and at most ``max_tokens`` tokens, the most
    expensive micro batch first in every epoch, dealt to the ranks as accelerate deals micro batches.

    Composition (once, from ``seed``): the samples in ``torch.randperm`` order (``torch.Generator().manual_seed(seed)``)
    fill micro batches greedily; a micro batch closes when the next sample would exceed either limit. The number of
    micro batches is therefore fixed for the whole run (the Trainer sizes epochs and ``max_steps`` from it once);
    which samples share a micro batch does not change between epochs.
    Order (every epoch ``e``): the micro batches in ``randperm`` order from ``seed + e`` (accelerate's
    ``SeedableRandomSampler`` convention), then the one with the most tokens moved to the front, so that the step
    with the largest activation memory is step 1 of every epoch and a run that does not fit fails there, not hours
    in (transformers' ``LengthGroupedSampler`` puts its longest group first for the same reason). Padded with the
    epoch's first micro batches to a multiple of ``world_size`` (accelerate's ``even_batches``).
    Dealing: micro batch ``i`` of that order goes to rank ``i % world_size`` (accelerate's ``BatchSamplerShard``),
    so the order of micro batches is the same at any world size and a resume at another world size
    (:mod:`sft.train.world_size`) continues at the same micro batch.

    A subclass of transformers' ``BatchRebalanceSampler`` only for its type: ``Trainer._get_dataloader`` (5.24) passes
    such a sampler as the data loader's ``batch_sampler`` and keeps accelerate from dealing its micro batches again.

    Args:
        lengths: tokens per sample, ``len(lengths)`` = the dataset's length.
        micro_batch: most samples per micro batch (``--per_device_train_batch_size``), >= 1.
        max_tokens: most tokens per micro batch (``--max_tokens_per_micro_batch``), >= 1.
        seed: ``--data_seed``, else ``--seed``.
        world_size, rank: data-parallel processes and this one's global rank.
    Raises:
        ValueError: a sample longer than ``max_tokens``, or a limit below 1.
    """

    def __init__(self, lengths: Sequence[int], micro_batch: int, max_tokens: int, seed: int, world_size: int = 1,
                 rank: int = 0):
        if micro_batch < 1 or max_tokens < 1:
            raise ValueError(f"micro batch {micro_batch} and token budget {max_tokens} must be >= 1")
        lengths = [int(n) for n in lengths]
        longest = max(lengths, default=0)
        if longest > max_tokens:
            raise ValueError(f"sample {lengths.index(longest)} has {longest} tokens, more than the token budget "
                             f"{max_tokens} of a micro batch")
        self.micro_batch, self.max_tokens = int(micro_batch), int(max_tokens)
        self.seed, self.epoch = int(seed), 0
        self.world_size, self.rank = max(1, int(world_size)), int(rank)
        self.drop_last = False  # read by accelerate's BatchSamplerShard
        self.batches: list[list[int]] = []
        current, tokens = [], 0
        for i in torch.randperm(len(lengths), generator=torch.Generator().manual_seed(self.seed)).tolist():
            if current and (len(current) == self.micro_batch or tokens + lengths[i] > self.max_tokens):
                self.batches.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += lengths[i]
        if current:
            self.batches.append(current)
        self.tokens = [sum(lengths[i] for i in b) for b in self.batches]

    @property
    def largest_tokens(self) -> int:
        """Tokens of the largest micro batch (0 for an empty dataset)."""
        return max(self.tokens, default=0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def epoch_order(self) -> list[int]:
        """Indices into ``self.batches`` in this epoch's global order (all ranks), padded to a multiple of the world
        size."""
        n = len(self.batches)
        if n == 0:
            return []
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        top = max(range(n), key=lambda b: (self.tokens[b], -b))
        order.remove(top)
        order.insert(0, top)
        while len(order) % self.world_size:
            order.append(order[len(order) - n])  # the epoch's first micro batches again
        return order

    def __iter__(self):
        order = self.epoch_order()
        for position in range(self.rank, len(order), self.world_size):
            yield list(self.batches[order[position]])

    def __len__(self) -> int:
        return -(-len(self.batches) // self.world_size)


def micro_batches(train_ds, data_args, training_args):
    """The training batch sampler and the tokens of the largest micro batch: ``(sampler or None, tokens)``.

    Padding-free (the default, without ``--packing`` or ``--group_by_length``): a
    :class:`sft.train.trainer.TokenBudgetBatchSampler` with ``--max_tokens_per_micro_batch`` (unset: micro batch x
    ``--model_max_length``, what a padded micro batch of the longest samples holds: no micro batch is split) and
    its largest micro batch. Otherwise the Trainer's own sampler (None) and the most
    tokens one of its micro batches can hold: padded, micro batch x the longest sample (rounded up to the collator's
    multiple of 8); packed, micro batch x the longest row; padding-free by length groups, the micro batch's longest
    samples together. Without lengths (``--lazy_preprocess``): micro batch x ``--model_max_length``.
    """
    mb, max_len = training_args.per_device_train_batch_size, training_args.model_max_length
    sp = max(1, int(training_args.sequence_parallel_size))
    lengths = sample_lengths(train_ds)
    if not lengths:
        return None, mb * max_len
    seed = training_args.data_seed if training_args.data_seed is not None else training_args.seed
    if data_args.packing:
        if sp == 1:
            return None, mb * max(lengths)
        budget = mb * max(lengths)  # the rows of a micro batch, as the Trainer's sampler would deal them
    elif not data_args.padding_free:
        return None, mb * (-(-max(lengths) // 8) * 8)
    elif training_args.group_by_length:
        return None, sum(sorted(lengths)[-mb:])
    else:
        budget = training_args.max_tokens_per_micro_batch or mb * max_len
    # Sequence parallelism: the N ranks of a group read the same micro batch (data-parallel rank = rank // N).
    sampler = TokenBudgetBatchSampler(lengths, mb, budget, seed, training_args.world_size // sp,
                                      training_args.process_index // sp)
    return sampler, sampler.largest_tokens


def eval_batches(eval_ds, micro_batch: int, world_size: int, rank: int, sequence_parallel: int):
    """Under sequence parallelism (``sequence_parallel`` N > 1): the evaluation's micro batches, the same for the N
    ranks of a group (a :class:`TokenBudgetBatchSampler` with no token limit, dealt by data-parallel rank ``rank //
    N`` over ``world_size // N``; its order does not matter to the loss). None otherwise (the Trainer's own)."""
    lengths = sample_lengths(eval_ds) if sequence_parallel > 1 else None
    if not lengths:
        return None
    return TokenBudgetBatchSampler(lengths, micro_batch, micro_batch * max(lengths), 0, world_size // sequence_parallel,
                                   rank // sequence_parallel)


def checkpoint_tensors(model) -> dict:
    """What a checkpoint's weights file holds, as references into ``model``: the whole state dict, or for a PEFT
    model the adapter's tensors (names with ``lora_`` or ``modules_to_save``, and every trainable parameter), which
    ``PeftModel.save_pretrained(state_dict=...)`` filters to the adapter file exactly as it filters the whole state
    dict (tests/unit/train/test_async_save.py compares the two files)."""
    state = model.state_dict()
    if not hasattr(model, "peft_config"):
        return state
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if "lora_" in k or "modules_to_save" in k or k in trainable}


class Trainer(ExpertParallelSteps, TrainerHooks):
    """``transformers.Trainer`` with an epoch-seeded length-grouped sampler (see the module docstring), FSDP2 on
    CPU process groups (:func:`sft.distributed.process_group.enable_fsdp`), in training with ``supervised_head`` on,
    the LM head and loss at supervised positions only (:mod:`sft.model.loss`), and expert parallelism's steps
    (:class:`sft.train.expert_parallel.ExpertParallelSteps`).

    Args:
        background_saves: a :class:`sft.train.async_save.BackgroundSaves` (``--save_async True``): a checkpoint's
            weights or adapter and optimizer state are staged into it (copied to host memory), and written in the
            background (:class:`sft.train.checkpoint.AtomicCheckpoints` starts the write); None: the Trainer's own.
        supervised_head: use :func:`sft.model.loss.compute_supervised_loss` for training steps, as decided by
            :func:`sft.model.loss.use_supervised_head`; evaluation, label smoothing and a ``compute_loss_func`` keep the
            Trainer's own loss.
        train_batch_sampler: the training data's batch sampler (a :class:`TokenBudgetBatchSampler`), or None for the
            Trainer's own choice (random, or ``--group_by_length``).
        moe_aux_loss_coef: None for a model without an aux loss; else training runs with ``output_router_logits``,
            the model's own ``coef x aux`` switched off, and :meth:`aux_term` added to each micro batch's loss.
        **kwargs: ``transformers.Trainer``'s.
    """

    def __init__(self, *args, supervised_head: bool = False,
                 train_batch_sampler: Optional[TokenBudgetBatchSampler] = None, background_saves=None,
                 moe_aux_loss_coef: Optional[float] = None, **kwargs):
        self.train_batch_sampler = train_batch_sampler
        self.background_saves = background_saves  # sft.train.async_save.BackgroundSaves under --save_async
        super().__init__(*args, **kwargs)
        self.supervised_head = bool(supervised_head)  # decided by sft.model.loss.use_supervised_head
        self.supervised_counter = None  # set by sft.train.metrics.attach: counts the supervised targets it sees
        self.routing_counter = None  # set by sft.train.routing_health.attach: the aux losses for the log line
        if moe_aux_loss_coef is not None:
            disable_model_aux(self.model)
        self.moe_aux_loss_coef = moe_aux_loss_coef

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # transformers 5.24 Trainer.compute_loss(model, inputs, return_outputs, num_items_in_batch) with a causal LM
        # that accepts loss kwargs: model(**inputs, num_items_in_batch=...) -> sum / num_items_in_batch, then
        # x num_processes under average_tokens_across_devices. The same normalisation here, the head only where
        # labels are.
        sp = sequence_parallel.current()
        if sp.enabled and not model.training and "shift_labels" in inputs:
            return self.group_loss(model, inputs, return_outputs, sp)
        own = (return_outputs or not model.training or self.label_smoother is not None
               or self.compute_loss_func is not None or "labels" not in inputs)
        aux = self.moe_aux_loss_coef is not None and not own
        if own or not self.supervised_head:
            if not aux:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss, outputs = super().compute_loss(model, {**inputs, "output_router_logits": True}, True,
                                                 num_items_in_batch)  # x the world scale already
            return loss + self.aux_term(outputs, inputs, num_items_in_batch) * self.loss_scale(num_items_in_batch)

        if self.supervised_counter is not None:
            self.supervised_counter.add_supervised(shifted_labels(inputs))
        # The head runs outside the model's forward, which accelerate wraps in its mixed-precision autocast (bf16 on
        # CPU: bf16 base weights, fp32 LoRA adapters): the same autocast here, or F.linear meets fp32 x bf16.
        n, head = num_items_in_batch if self.model_accepts_loss_kwargs else None, self.model.get_output_embeddings()
        with self.accelerator.autocast():
            loss, outputs = compute_supervised_loss(model, inputs, n, head, return_outputs=True,
                                                    **({"output_router_logits": True} if aux else {}))
        loss = loss + self.aux_term(outputs, inputs, num_items_in_batch) if aux else loss
        return loss * self.loss_scale(num_items_in_batch)

    def loss_scale(self, num_items_in_batch) -> int:
        """transformers 5.24's factor on a loss / ``num_items_in_batch`` under ``average_tokens_across_devices``: the
        data-parallel processes (their gradients are then averaged: a sum over the global batch); else 1."""
        if (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                and num_items_in_batch is not None):
            return self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu
        return 1

    def aux_term(self, outputs, inputs, num_items_in_batch):
        """``coef x`` the aux loss weighed as the cross entropy (:func:`sft.model.routing.weighted_aux`), before
        :meth:`loss_scale`, and counted for the log line (:mod:`sft.train.routing_health`); 0 if there is none."""
        aux = getattr(outputs, "aux_loss", None)
        if not torch.is_tensor(aux):
            return 0.0
        if self.routing_counter is not None:
            self.routing_counter.add_aux(aux)
        n = num_items_in_batch if self.model_accepts_loss_kwargs else None
        return self.moe_aux_loss_coef * weighted_aux(aux, shifted_labels(inputs), n) if self.moe_aux_loss_coef else 0.0

    @staticmethod
    def group_loss(model, inputs, return_outputs: bool, sp):
        """Evaluation under sequence parallelism: the micro batch's mean loss over every supervised target of the
        group's slices (the sum over the group's ranks divided by their count; the same on every rank of the group),
        where each rank's own mean would weigh the slices equally, and be NaN on a slice with no target."""
        import torch.distributed as dist

        targets = (inputs["shift_labels"] != -100).sum()
        outputs = model(**inputs, num_items_in_batch=torch.ones((), device=targets.device))  # the loss is the sum
        both = torch.stack([outputs.loss.detach().float(), targets.float()])
        dist.all_reduce(both, group=sp.group)
        loss = both[0] / both[1].clamp(min=1)
        return (loss, outputs) if return_outputs else loss

    def create_accelerator_and_postprocess(self):
        # transformers 5.24 calls this from __init__; the checks that follow in __init__ read is_fsdp_enabled,
        # and the model is prepared (fully_shard) only in train(), so the FSDP2 state is complete before both.
        super().create_accelerator_and_postprocess()

        enable_fsdp(self)

    @property
    def sharded_checkpoints(self) -> bool:
        """True under FSDP2 with ``SHARDED_STATE_DICT``: checkpoints hold each rank's shards (written with the
        optimizer's), not a gathered model."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None) if self.is_fsdp_enabled else None
        return plugin is not None and "SHARDED" in str(plugin.state_dict_type)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        saves = self.background_saves
        if not _internal_call:  # the final save (sft.app.train.save)
            return super().save_model(output_dir, _internal_call)
        # a checkpoint's weights (Trainer._save_checkpoint calls this first): the save in flight finishes first
        if saves is not None:
            saves.wait("before the next checkpoint")
            saves.reset_staging()
        if self.sharded_checkpoints:  # the shards are written with the optimizer's; what describes them, now
            return self.save_model_description(output_dir)
        if saves is None:
            return super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            tensors = saves.stage(checkpoint_tensors(self.model))
            saves.add("weights", lambda: self.write_model_files(output_dir, tensors))

    def save_model_description(self, output_dir: str) -> None:
        """The saving process writes what a checkpoint of weight shards needs beside them to be loaded or exported
        (``sft-export``): the model's ``config.json`` and generation config, the adapter's ``adapter_config.json``
        (LoRA), and the tokenizer, as ``save_pretrained`` writes them next to gathered weights."""
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        for adapter, config in getattr(model, "peft_config", {}).items():
            config.save_pretrained(output_dir if adapter == "default" else os.path.join(output_dir, adapter))
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.config.save_pretrained(output_dir)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def before_loading_best_model(self) -> None:
        if self.background_saves is not None:  # the best checkpoint may be the one still being written
            self.background_saves.wait("loading the best checkpoint")

    def save_optimizer_and_scheduler(self, output_dir: str, default) -> None:
        saves = self.background_saves
        if saves is None:
            return default()
        import warnings

        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        if self.is_fsdp_enabled:  # SHARDED_STATE_DICT (sft.app.validation): every rank writes its shards
            import torch.distributed.checkpoint as dcp

            from sft.compat.accelerate import fsdp_shard_folders, fsdp_sharded_state

            model_state, optim_state = saves.stage(fsdp_sharded_state(self.accelerator, self.model, self.optimizer))
            group = saves.group
            for folder, key, state in zip(fsdp_shard_folders(), ("model", "optimizer"), (model_state, optim_state)):
                target = os.path.join(output_dir, folder)
                os.makedirs(target, exist_ok=True)
                saves.add(folder, lambda t=target, k=key, sd=state: dcp.save(
                    {k: sd}, storage_writer=dcp.FileSystemWriter(t), process_group=group))
        elif self.args.should_save:
            state = saves.stage(self.optimizer.state_dict())
            saves.add("optimizer", lambda: torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME)))
        if self.args.should_save:  # small: written now, as the Trainer writes it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def load_rng_state(self, checkpoint) -> bool:
        # The Trainer's own (transformers 5.24) reads rng_state_{process_index}.pth at world size > 1 and
        # rng_state.pth at 1 (python, numpy, torch CPU, CUDA states), and only logs when the file is missing. A
        # checkpoint written at world size > 1 resumed by one process (sft.train.world_size) has no rng_state.pth:
        # rank 0 then takes rng_state_0.pth, as it would at any world size; ranks without a file keep the state
        # --seed gave them.
        single = os.path.join(checkpoint, "rng_state.pth") if checkpoint else None
        rank0 = os.path.join(checkpoint, "rng_state_0.pth") if checkpoint else None
        if self.args.world_size > 1 or not single or os.path.isfile(single) or not os.path.isfile(rank0):
            return False
        import random

        import numpy as np
        from transformers.trainer_pt_utils import safe_globals  # the numpy state's globals, allowed as the Trainer does

        with safe_globals():
            state = torch.load(rank0, weights_only=True)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.random.set_rng_state(state["cpu"])
        if torch.cuda.is_available() and "cuda" in state:  # saved by a distributed run: every device's state
            cuda, rng = state["cuda"], torch.cuda.random
            (rng.set_rng_state_all if isinstance(cuda, (list, tuple)) else rng.set_rng_state)(cuda)
        return True

    def before_epoch(self, epoch: int) -> None:
        # The Trainer sets the epoch on a batch sampler wrapped once (accelerate's BatchSamplerShard), but a resumed
        # epoch's loader (skip_first_batches) wraps it twice: the token-budget sampler would replay epoch 0's order.
        if self.train_batch_sampler is not None:
            self.train_batch_sampler.set_epoch(epoch)

    def eval_sampler(self, eval_dataset, default):
        sampler = eval_batches(eval_dataset, self.args.per_device_eval_batch_size, self.args.world_size,
                               self.args.process_index, self.args.sequence_parallel_size)
        return sampler if sampler is not None else default()

    def train_sampler(self, train_dataset, default):
        # The Trainer's own is a LengthGroupedSampler(batch_size, lengths=...) for group_by_length
        if self.train_batch_sampler is not None:  # built on the training set (the Trainer passes its column subset)
            return self.train_batch_sampler
        sampler = default()
        if type(sampler) is LengthGroupedSampler:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            sampler = EpochSeededLengthGroupedSampler(sampler.batch_size, sampler.lengths, seed)
        return sampler
