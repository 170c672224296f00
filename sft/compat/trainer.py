"""``transformers.Trainer`` with the private steps sft changes turned into named hooks (checked against transformers
5.24). :class:`sft.train.trainer.Trainer` overrides the hooks, never a private method:

* ``Trainer._load_rng_state(checkpoint)`` -> :meth:`TrainerHooks.load_rng_state` (return True when it restored the
  state itself; else the Trainer's own runs: ``rng_state_{process_index}.pth`` at world size > 1, ``rng_state.pth``
  at 1, only a log line when the file is missing);
* ``Trainer._run_epoch(model, epoch, train_dataloader, ...)`` -> :meth:`TrainerHooks.before_epoch` (epoch) first;
* ``Trainer._get_train_sampler(train_dataset=None)`` -> :meth:`TrainerHooks.train_sampler` (given the Trainer's
  choice as a callable: a ``LengthGroupedSampler(batch_size, lengths=...)`` for ``group_by_length``);
* ``Trainer._get_eval_sampler(eval_dataset)`` -> :meth:`TrainerHooks.eval_sampler` (the same, for evaluation; a
  ``transformers.trainer_pt_utils.BatchRebalanceSampler`` is passed as the data loader's ``batch_sampler`` and not
  dealt to the ranks again by accelerate);
* ``Trainer._load_best_model()`` (``--load_best_model_at_end``, after the last step) ->
  :meth:`TrainerHooks.before_loading_best_model` first;
* ``Trainer._save(output_dir, state_dict)`` (weights or adapter, tokenizer, training arguments; the saving process) is
  called as :meth:`TrainerHooks.write_model_files`;
* ``Trainer._save_optimizer_and_scheduler(output_dir)`` -> :meth:`TrainerHooks.save_optimizer_and_scheduler` (given the
  Trainer's own as a callable: optimizer state by the engine's rules, the scheduler by the saving process).
* ``Trainer._clip_grad_norm(model)`` (after the last micro batch's backward, only with ``max_grad_norm`` > 0) ->
  :meth:`TrainerHooks.clip_gradients` (given the Trainer's own as a callable; returns the norm before clipping);
* ``Trainer._get_grad_norm(model, grad_norm=None)`` (the logged norm: the clip's, or computed when it is None) ->
  :meth:`TrainerHooks.gradient_norm` (given the Trainer's own as a callable of the norm).
"""
from __future__ import annotations

from typing import Callable

import transformers


class TrainerHooks(transformers.Trainer):
    """See the module docstring. The hooks' defaults leave the Trainer's behaviour unchanged."""

    def load_rng_state(self, checkpoint) -> bool:
        """Restore the RNG states of ``checkpoint`` (a folder or None) yourself and return True, or return False."""
        return False

    def before_epoch(self, epoch: int) -> None:
        """Called at the start of every training epoch (0-based), resumed ones included."""

    def train_sampler(self, train_dataset, default: Callable):
        """The training data's sampler; ``default()`` is the Trainer's own."""
        return default()

    def eval_sampler(self, eval_dataset, default: Callable):
        """The evaluation data's sampler; ``default()`` is the Trainer's own."""
        return default()

    def write_model_files(self, output_dir: str, state_dict: dict) -> None:
        """Write ``state_dict`` as the Trainer writes a checkpoint's model: ``save_pretrained`` (weights or adapter),
        the tokenizer and ``training_args.bin``, on the saving process."""
        super()._save(output_dir, state_dict=state_dict)

    def before_loading_best_model(self) -> None:
        """Called before the Trainer loads the best checkpoint at the end of training."""

    def _load_best_model(self):
        self.before_loading_best_model()
        return super()._load_best_model()

    def save_optimizer_and_scheduler(self, output_dir: str, default: Callable) -> None:
        """Write a checkpoint's optimizer and scheduler state into ``output_dir``; ``default()``: the Trainer's own."""
        default()

    def _save_optimizer_and_scheduler(self, output_dir):
        self.save_optimizer_and_scheduler(
            output_dir, lambda: super(TrainerHooks, self)._save_optimizer_and_scheduler(output_dir))

    def clip_gradients(self, model, default: Callable):
        """Clip the gradients to ``args.max_grad_norm``; return their norm before clipping. ``default()``: the
        Trainer's own."""
        return default()

    def _clip_grad_norm(self, model):
        return self.clip_gradients(model, lambda: super(TrainerHooks, self)._clip_grad_norm(model))

    def gradient_norm(self, model, grad_norm, default: Callable):
        """The gradient norm to log: ``default(grad_norm)`` (the Trainer's own computes it where ``grad_norm`` is
        None)."""
        return default(grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.gradient_norm(model, grad_norm,
                                  lambda g: super(TrainerHooks, self)._get_grad_norm(model, grad_norm=g))

    def _get_eval_sampler(self, eval_dataset):
        return self.eval_sampler(eval_dataset, lambda: super(TrainerHooks, self)._get_eval_sampler(eval_dataset))

    def _load_rng_state(self, checkpoint):
        if not self.load_rng_state(checkpoint):
            return super()._load_rng_state(checkpoint)

    def _run_epoch(self, model, epoch, *args, **kwargs):
        self.before_epoch(epoch)
        return super()._run_epoch(model, epoch, *args, **kwargs)

    def _get_train_sampler(self, train_dataset=None):
        return self.train_sampler(train_dataset, lambda: super(TrainerHooks, self)._get_train_sampler(train_dataset))
