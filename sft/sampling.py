"""Training samplers whose order is a function of (seed, epoch), so that a resumed run sees the same batches.

transformers' ``RandomSampler`` is replaced by accelerate's ``SeedableRandomSampler`` (seed + epoch) by
default, but ``--group_by_length``'s ``LengthGroupedSampler`` shuffles with the global torch RNG at the
start of each epoch. A run resumed in the middle of epoch e >= 1 draws that shuffle from a different
RNG state than the uninterrupted run did (the Trainer restores the checkpoint's RNG only after
skipping the consumed batches), so it would train on other batches.
"""
from __future__ import annotations

import os

import torch
import transformers
from transformers.trainer_pt_utils import LengthGroupedSampler


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


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` with an epoch-seeded length-grouped sampler (see the module docstring), FSDP2 on
    CPU process groups (:func:`sft.distributed.process_group.enable_fsdp`), and, in training with
    ``supervised_head`` on, the LM head and loss at supervised positions only (:mod:`sft.loss`).

    Args:
        supervised_head: use :func:`sft.loss.compute_supervised_loss` for training steps when the model has a plain
            LM head (:func:`sft.loss.supports_supervised_head`) and FSDP is off; evaluation, label smoothing and a
            ``compute_loss_func`` keep the Trainer's own loss.
        **kwargs: ``transformers.Trainer``'s.
    """

    def __init__(self, *args, supervised_head: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        from .loss import supports_supervised_head

        # Not under FSDP2: the head module runs outside the root module's forward, where FSDP2 has resharded its
        # weight again (measured here: the 2-process FSDP2 run died with SIGSEGV); FSDP keeps the full path.
        self.supervised_head = bool(supervised_head) and supports_supervised_head(self.model) and not self.is_fsdp_enabled
        self.supervised_counter = None  # set by sft.callbacks.install: counts the supervised targets it sees

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # transformers 5.24 Trainer.compute_loss(model, inputs, return_outputs, num_items_in_batch) with a causal LM
        # that accepts loss kwargs: model(**inputs, num_items_in_batch=...) -> sum / num_items_in_batch, then
        # x num_processes under average_tokens_across_devices. The same normalisation here, the head only where
        # labels are.
        if (not self.supervised_head or return_outputs or not model.training or self.label_smoother is not None
                or self.compute_loss_func is not None or "labels" not in inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        from .loss import compute_supervised_loss, shifted_labels

        if self.supervised_counter is not None:
            self.supervised_counter.add_supervised(shifted_labels(inputs))
        # The head runs outside the model's forward, which accelerate wraps in its mixed-precision autocast (bf16 on
        # CPU: bf16 base weights, fp32 LoRA adapters): the same autocast here, or F.linear meets fp32 x bf16.
        with self.accelerator.autocast():
            loss = compute_supervised_loss(model, inputs, num_items_in_batch if self.model_accepts_loss_kwargs else None,
                                           head=self.model.get_output_embeddings())
        if self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu)
        return loss

    def create_accelerator_and_postprocess(self):
        # transformers 5.24 calls this from __init__; the checks that follow in __init__ read is_fsdp_enabled,
        # and the model is prepared (fully_shard) only in train(), so the FSDP2 state is complete before both.
        super().create_accelerator_and_postprocess()
        from .distributed.process_group import enable_fsdp

        enable_fsdp(self)

    def _load_rng_state(self, checkpoint):
        # Adapter over a private method: transformers 5.24 Trainer._load_rng_state(checkpoint) reads
        # rng_state_{process_index}.pth at world size > 1 and rng_state.pth at 1 (python, numpy, torch CPU, CUDA
        # states), and only logs when the file is missing. A checkpoint written at world size > 1 resumed by one
        # process (sft.world_size) has no rng_state.pth: rank 0 then takes rng_state_0.pth, as it would at any
        # world size; ranks without a file keep the state --seed gave them.
        single = os.path.join(checkpoint, "rng_state.pth") if checkpoint else None
        rank0 = os.path.join(checkpoint, "rng_state_0.pth") if checkpoint else None
        if self.args.world_size > 1 or not single or os.path.isfile(single) or not os.path.isfile(rank0):
            return super()._load_rng_state(checkpoint)
        import random

        import numpy as np

        from transformers.trainer_pt_utils import safe_globals  # the numpy state's globals, allowed as the Trainer does

        with safe_globals():
            state = torch.load(rank0, weights_only=True)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.random.set_rng_state(state["cpu"])
        if torch.cuda.is_available() and "cuda" in state:  # saved by a distributed run: every device's state
            cuda = state["cuda"]
            set_state = torch.cuda.random.set_rng_state_all if isinstance(cuda, (list, tuple)) else \
                torch.cuda.random.set_rng_state
            set_state(cuda)

    def _get_train_sampler(self, train_dataset=None):
        # Adapter over a private method: transformers 5.24 Trainer._get_train_sampler(train_dataset=None)
        # returns a LengthGroupedSampler(batch_size, lengths=...) for train_sampling_strategy='group_by_length'.
        sampler = super()._get_train_sampler(train_dataset)
        if type(sampler) is LengthGroupedSampler:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            sampler = EpochSeededLengthGroupedSampler(sampler.batch_size, sampler.lengths, seed)
        return sampler
