"""Experts spread across ranks (``--expert_parallel_size N``): each rank of an expert-parallel group keeps E/N of
every layer's routed experts, and the tokens travel to their experts and back by all-to-all.

**Placement** (:func:`shard_experts`, after loading and LoRA, before the Trainer): every experts module's 3-D
parameters [E, ...] and its per-expert biases [E, out] are cut to this rank's experts ``[first, first + E/N)``
(:meth:`sft.distributed.expert_parallel.ExpertParallel.experts`), and so are their LoRA factors in peft's layout
(``lora_A`` [r·E, in]: expert e's ``r`` rows; ``lora_B`` [out, r·E]: columns ``r_i·E + e``, interleaved). The router
stays whole on every rank: routing is decided where the token is.

**Forward** (:func:`expert_parallel_forward`, the experts module's forward, and the expert LoRA wrapper's,
:mod:`sft.model.expert_lora`): the token -> expert pairs are sorted by expert (so by owning rank), the counts are
exchanged (one all-to-all of N integers and one host read per layer: the buffers' sizes), the rows go to their
experts' ranks (all-to-all), each rank runs its experts over the rows it received with the grouped projections and
their LoRA (:func:`sft.model.expert_lora.expert_rows`), the results come back by the reverse all-to-all, and the
routing weights and the sum over the top-k are applied where the token is. The exchanges are autograd-aware
(:func:`sft.distributed.collectives.all_to_all_rows`): gradients return the same way. Every rank runs both exchanges
of every layer in forward and backward whatever its tokens chose (a rank that receives no row still sends back an
empty gradient), so no rank waits alone.

**Saving** (:func:`gathered`): the slices are gathered over the group into whole tensors for the length of a save,
so the adapter or model written is the one-process one (``sft-merge`` and loading at N = 1 work).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Optional

import torch

from sft.compat.torch_ddp import ddp_ignore
from sft.distributed import collectives
from sft.errors import ConfigError
from sft.model.expert_lora import expert_rows, group_offsets
from sft.model.experts import expert_parameter_names, experts_blocks

logger = logging.getLogger(__name__)


def experts_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list]]:
    """``[(experts module, [peft wrappers around it, outermost first])]`` of ``model``'s mixture-of-experts blocks."""
    from sft.model.experts import is_experts_module

    found = []
    for _, block in experts_blocks(model):
        for child in block.children():
            chain = []
            while isinstance(getattr(child, "base_layer", None), torch.nn.Module):
                chain.append(child)
                child = child.base_layer
            if is_experts_module(child):
                found.append((child, chain))
    return found


def routed_expert_counts(model: torch.nn.Module) -> set[int]:
    """The numbers of routed experts per layer (E) of ``model`` (empty for a model without routed experts)."""
    return {int(m.num_experts) for m, _ in experts_modules(model)}


def _cut(owner: torch.nn.Module, name: str, piece: torch.Tensor) -> torch.nn.Parameter:
    old = getattr(owner, name)
    new = torch.nn.Parameter(piece.detach().clone(), requires_grad=old.requires_grad)  # a copy: the whole is freed
    setattr(owner, name, new)
    return new


def shard_experts(model: torch.nn.Module, ep) -> list[tuple[torch.nn.Parameter, str, int]]:
    """Keep this rank's experts (``ep``: :class:`sft.distributed.expert_parallel.ExpertParallel`) in every experts
    module of ``model`` and its LoRA, and route its forward through :func:`expert_parallel_forward`. Returns the
    parameters cut ``[(parameter, layout, E)]``: layout ``"rows"`` (expert ``e``'s block of rows along dim 0: 3-D
    weights, biases, ``lora_A``) or ``"lora_B"`` (columns interleaved by expert); the list :func:`gathered` and the
    gradient reduction (:mod:`sft.train.expert_parallel`) use. Nothing is cut for ``ep.size`` 1.

    Raises:
        ConfigError: a layer's E is not divisible by ``ep.size``, or its experts are stored 4-bit (Q-LoRA).
    """
    cut: list = []
    if not ep.enabled:
        return cut
    for experts, chain in experts_modules(model):
        total = int(experts.num_experts)
        if total % ep.size:
            raise ConfigError([f"--expert_parallel_size {ep.size}: does not divide the model's {total} routed experts "
                               f"per layer; give a divisor of {total}"])
        if getattr(experts, "parametrizations", None):
            raise ConfigError([f"--expert_parallel_size {ep.size}: the experts are stored 4-bit (--q_lora True), which "
                               "is not cut across ranks; use --q_lora False or --expert_parallel_size 1"])
        first, count = ep.experts(total)
        names = expert_parameter_names(experts) + [n for n, p in experts.named_parameters(recurse=False)
                                                  if n.endswith("_bias") and p.dim() == 2 and p.shape[0] == total]
        for name in names:
            cut.append((_cut(experts, name, getattr(experts, name)[first:first + count]), "rows", total))
        for wrapper in chain:
            for adapter, lin in wrapper.lora_A.items():
                r = int(wrapper.r[adapter])
                cut.append((_cut(lin, "weight", lin.weight[first * r:(first + count) * r]), "rows", total))
                b = wrapper.lora_B[adapter]
                out = b.weight.shape[0]
                piece = b.weight.reshape(out, r, total)[:, :, first:first + count].reshape(out, r * count)
                cut.append((_cut(b, "weight", piece), "lora_B", total))
                lin.out_features = b.in_features = r * count  # nn.Linear's own record of the shapes
            wrapper.num_experts = count
        experts.num_experts = count
        experts.sft_expert_slice = (first, count, total)
        spread = functools.partial(expert_parallel_forward, experts, ep=ep)
        experts.sft_expert_parallel_forward = spread
        experts.forward = spread  # without a LoRA wrapper (full fine-tuning, experts not targeted) too
    return cut


def spread_experts(model: torch.nn.Module, ep) -> list:
    """:func:`shard_experts` on ``model`` (the module the Trainer will wrap), the cut parameters left out of DDP
    (:func:`sft.compat.torch_ddp.ddp_ignore`: their gradients are reduced over the replica group instead,
    :mod:`sft.train.expert_parallel`), kept as ``model.sft_expert_shards``, and one log line. Returns the cut list.

    Raises:
        ConfigError: as :func:`shard_experts`; or ``model`` has no routed experts (one line each, exit 2).
    """
    cut = shard_experts(model, ep)
    if not cut:
        raise ConfigError([f"--expert_parallel_size {ep.size}: the model has no routed experts (3-D expert "
                           "parameters) to spread; use --expert_parallel_size 1"])
    ids = {id(p) for p, _, _ in cut}
    ddp_ignore(model, [n for n, p in model.named_parameters() if id(p) in ids])
    model.sft_expert_shards = cut
    counts = sorted({total for _, _, total in cut})
    logger.info("expert parallelism: %d ranks per group (this rank: %d), %s of %s routed experts per layer on each "
                "rank; tokens exchanged by all-to-all; expert gradients summed over %d replica(s)", ep.size, ep.rank,
                "/".join(str(e // ep.size) for e in counts), "/".join(map(str, counts)), ep.world_size // ep.size)
    return cut


def expert_parallel_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, *, ep, loras: Optional[dict] = None,
                            adapter: Optional[str] = None) -> torch.Tensor:
    """The experts' forward with E/N experts on this rank (see the module docstring).

    Args:
        experts: an experts module cut by :func:`shard_experts` (``sft_expert_slice``: first, count, E).
        hidden_states: [T, hidden] this rank's tokens; top_k_index: [T, k] global expert ids (0..E-1);
            top_k_weights: [T, k] routing weights.
        ep: this rank's :class:`sft.distributed.expert_parallel.ExpertParallel`.
        loras: parameter name -> expert LoRA wrapper (:class:`sft.model.expert_lora.ExpertLoraWrapper`); None: none.
        adapter: the active adapter's name.

    Returns:
        [T, hidden] in ``hidden_states``' dtype: each token's sum over its top-k experts, as at N = 1.
    """
    first, count, _ = experts.sft_expert_slice
    k, tokens = top_k_index.size(-1), hidden_states.size(0)
    ids_sorted, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    edges = torch.searchsorted(ids_sorted, torch.arange(ep.size + 1, device=ids_sorted.device) * count)
    send = edges[1:] - edges[:-1]  # rows for each rank of the group (sorted ids: no atomics, deterministic on CUDA)
    recv = collectives.all_to_all_counts(send, ep.group)
    send_n, recv_n = send.tolist(), recv.tolist()  # one host read per layer: the exchanged buffers' sizes
    x_in = collectives.all_to_all_rows(hidden_states[perm // k], send_n, recv_n, ep.group)
    ids_in = collectives.all_to_all_rows(ids_sorted, send_n, recv_n, ep.group) - first
    local, order = torch.sort(ids_in, stable=True)  # the rows received, by this rank's expert
    y = expert_rows(experts, x_in[order], local, group_offsets(local, count), loras or {}, adapter)
    params = [*experts.parameters(), *(p for w in (loras or {}).values() for p in w.parameters())]
    if torch.is_grad_enabled() and not y.requires_grad and (
            hidden_states.requires_grad or any(p.requires_grad for p in params)):
        y = y.detach().requires_grad_(True)  # no row here: the reverse exchange's backward must still run (no hang)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    out = collectives.all_to_all_rows(y[back], recv_n, send_n, ep.group)  # rows back in this rank's sorted order
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(out.dtype)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv].view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def whole_tensor(piece: torch.Tensor, layout: str, total: int, group) -> torch.Tensor:
    """The whole tensor of E = ``total`` experts from every rank's ``piece`` of it (``layout`` as in
    :func:`shard_experts`; collective: an all-gather over ``group``, every rank of it calls this)."""
    parts = collectives.all_gather_tensors(piece.detach(), group)
    if layout == "rows":
        return torch.cat(parts, dim=0)
    out = piece.shape[0]
    return torch.cat([p.reshape(out, -1, total // len(parts)) for p in parts], dim=2).reshape(out, -1)


@contextlib.contextmanager
def gathered(cut: list, ep):
    """Inside: every parameter of ``cut`` (:func:`shard_experts`) holds the whole tensor (all E experts, gathered
    over the expert-parallel group: collective, every rank of the group enters), as at N = 1; on leaving, this rank's
    slice again. For saving a model or adapter whole."""
    slices = [p.data for p, _, _ in cut]
    try:
        for (p, layout, total), piece in zip(cut, slices):
            p.data = whole_tensor(piece, layout, total, ep.group)
        yield
    finally:
        for (p, _, _), piece in zip(cut, slices):
            p.data = piece
