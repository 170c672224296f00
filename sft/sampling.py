"""Training samplers whose order is a function of (seed, epoch), so that a resumed run sees the same batches.

transformers' ``RandomSampler`` is replaced by accelerate's ``SeedableRandomSampler`` (seed + epoch) by
default, but ``--group_by_length``'s ``LengthGroupedSampler`` shuffles with the global torch RNG at the
start of each epoch. A run resumed in the middle of epoch e >= 1 draws that shuffle from a different
RNG state than the uninterrupted run did (the Trainer restores the checkpoint's RNG only after
skipping the consumed batches), so it would train on other batches.
"""
from __future__ import annotations

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
    """``transformers.Trainer`` with an epoch-seeded length-grouped sampler (see the module docstring), and
    FSDP2 on CPU process groups (:func:`sft.distributed.process_group.enable_fsdp`)."""

    def create_accelerator_and_postprocess(self):
        # transformers 5.24 calls this from __init__; the checks that follow in __init__ read is_fsdp_enabled,
        # and the model is prepared (fully_shard) only in train(), so the FSDP2 state is complete before both.
        super().create_accelerator_and_postprocess()
        from .distributed.process_group import enable_fsdp

        enable_fsdp(self)

    def _get_train_sampler(self, train_dataset=None):
        # Adapter over a private method: transformers 5.24 Trainer._get_train_sampler(train_dataset=None)
        # returns a LengthGroupedSampler(batch_size, lengths=...) for train_sampling_strategy='group_by_length'.
        sampler = super()._get_train_sampler(train_dataset)
        if type(sampler) is LengthGroupedSampler:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            sampler = EpochSeededLengthGroupedSampler(sampler.batch_size, sampler.lengths, seed)
        return sampler
