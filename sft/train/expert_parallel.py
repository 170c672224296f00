"""The Trainer's steps under ``--expert_parallel_size N`` (:mod:`sft.model.expert_parallel` cuts the experts).

Gradients: DDP leaves the cut expert parameters alone (:func:`sft.compat.torch_ddp.ddp_ignore`, set when they are
cut) and averages every other one over the world of W ranks as before. Each rank's loss is its share of the global
batch's loss times W (transformers 5.24 under ``average_tokens_across_devices``: DDP's average then gives the sum), and
a rank's expert gradient already holds what the N ranks of its group sent it (the exchange's backward). Summed over
the W / N ranks that keep the same experts (the replica group) and divided by W -- DDP's own divisor -- it is the
one-process gradient: :func:`reduce_expert_gradients`, once per optimizer step, after the last micro batch's backward
(linear, so accumulation is unchanged). With W == N nothing is exchanged; the division by W remains.

Clipping (:func:`clip_norm`): the norm is the whole model's -- every non-expert gradient once (equal on every rank
after DDP) and every expert's once (their squares summed over the expert-parallel group) -- so the clip, and the norm
logged (also with ``--max_grad_norm 0``), are the ones a single process has.

Saving: the slices are gathered into whole tensors for the length of :meth:`ExpertParallelSteps.save_model`.
"""
from __future__ import annotations

import torch

from sft.distributed import collectives, expert_parallel
from sft.model.expert_parallel import gathered


def reduce_expert_gradients(cut: list, ep) -> None:
    """Sum the trainable cut parameters' gradients (``cut``: :func:`sft.model.expert_parallel.shard_experts`) over
    ``ep``'s replica group and divide them by the world size (module docstring); a parameter that got no gradient
    (no token of this group reached its experts) counts as zeros, as in one process."""
    params = [p for p, _, _ in cut if p.requires_grad]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params]) if ep.replica_group is not None else None
    if flat is not None:
        collectives.all_reduce_sum(flat, ep.replica_group)
        for p, piece in zip(params, torch.split(flat, [p.numel() for p in params])):
            p.grad.copy_(piece.view_as(p.grad))
    for p in params:
        p.grad.div_(ep.world_size)


def clip_norm(parameters, cut: list, max_norm: float, ep) -> torch.Tensor:
    """Clip every gradient of ``parameters`` (the whole model's on this rank) to the whole model's 2-norm
    ``max_norm`` and return that norm before clipping (fp32 scalar): non-expert gradients counted once, the cut
    experts' squares summed over ``ep``'s group."""
    cut_ids = {id(p) for p, _, _ in cut}
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    dense = torch.zeros((), device=device, dtype=torch.float32)
    experts = torch.zeros((), device=device, dtype=torch.float32)
    for p in params:
        sq = p.grad.detach().float().pow(2).sum()
        if id(p) in cut_ids:
            experts += sq
        else:
            dense += sq
    total = (dense + collectives.all_reduce_sum(experts, ep.group)).sqrt()
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class ExpertParallelSteps:
    """A mixin ahead of :class:`sft.compat.trainer.TrainerHooks` in :class:`sft.train.trainer.Trainer`: under expert
    parallelism (:func:`sft.distributed.expert_parallel.current` enabled, the model carrying ``sft_expert_shards``
    from :func:`sft.model.expert_parallel.spread_experts`) the expert gradients reduced after the last micro batch,
    the clip norm (and the logged norm) over every rank's experts, and the saved model or adapter whole. Without it:
    the Trainer's own."""

    def _expert_shards(self):
        ep = expert_parallel.current()
        cut = getattr(self.model, "sft_expert_shards", None)
        return (ep, cut) if ep.enabled and cut else (None, None)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        ep, cut = self._expert_shards()
        if ep is not None and self.accelerator.sync_gradients:  # the last micro batch of the optimizer step
            reduce_expert_gradients(cut, ep)
        return loss

    def clip_gradients(self, model, default):
        ep, cut = self._expert_shards()
        if ep is None:
            return default()
        self.accelerator.unscale_gradients()  # fp16's loss scale, as accelerate's clip_grad_norm_ does first
        return clip_norm(model.parameters(), cut, self.args.max_grad_norm, ep)

    def gradient_norm(self, model, grad_norm, default):
        ep, cut = self._expert_shards()
        if ep is not None and grad_norm is None:  # --max_grad_norm 0: the whole model's norm, nothing clipped
            grad_norm = clip_norm(model.parameters(), cut, 0.0, ep)
        return default(grad_norm)

    def save_model(self, output_dir=None, _internal_call: bool = False) -> None:
        ep, cut = self._expert_shards()
        if ep is None:
            return super().save_model(output_dir, _internal_call)
        with gathered(cut, ep):  # collective over the group: every rank calls save_model
            return super().save_model(output_dir, _internal_call)
