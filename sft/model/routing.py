"""Mixture-of-experts routing: the load-balancing (auxiliary) loss and how the routers spread tokens.

Routers are found by what they are, not by model name: in a module that holds experts (a child that
:func:`sft.model.experts.experts_modules` finds: 3-D parameters ``[E, out, in]``, transformers 5.24's fused expert
storage), the router is the sibling child with a 2-D parameter of ``E`` rows (``[E, hidden]``), whose forward
returns a tuple holding an integer tensor of top-k expert indices ``[tokens, k]`` (qwen3_moe, qwen3_next,
qwen3_5_moe, mixtral, gpt_oss, deepseek_v3, glm4_moe, kimi_linear ...).

Aux loss (``--moe_aux_loss_coef``): the value the model's own forward returns as ``aux_loss`` with
``output_router_logits=True`` (e.g. ``load_balancing_loss_func`` of qwen3_moe: Switch Transformer's
``E * sum_i f_i * P_i`` over the micro batch's non-pad tokens, all MoE layers together), computed per micro batch.
transformers adds ``coef * aux`` to each micro batch's loss when labels are given, un-normalised, so its weight grows
with gradient accumulation and world size (the cross entropy is divided by the supervised targets of the whole
global batch). Here the model's own addition is switched off (:func:`disable_model_aux`) and
:func:`weighted_aux` weighs each micro batch's aux by its share of the global batch's supervised targets, the weight
its cross entropy has: the update is the same at any gradient accumulation and world size for the same samples.

Models that balance without an aux loss (DeepSeek-V3, GLM-4.5, Kimi: a score-correction bias buffer ``[E]`` added to
the routing scores, updated by their own pre-training recipe) are told by that buffer (:func:`aux_free_routers`);
it stays as loaded (a buffer: no gradient, the optimizer never sees it).
"""
from __future__ import annotations

import inspect
import logging
from typing import Optional

import torch

from sft.errors import ConfigError
from sft.model.experts import experts_modules, num_experts

logger = logging.getLogger("sft")


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(module, "base_layer", None), torch.nn.Module):  # peft's wrappers
        module = module.base_layer
    return module


def _shapes(module: torch.nn.Module):
    """The shapes of a module's own parameters (a ZeRO-3 partitioned one's ``ds_shape``); a parametrized one's as it
    stands for (torch's parametrize: the ``original``'s, or a bitsandbytes 4-bit parametrization's
    ``quant_state.shape``)."""
    for p in module.parameters(recurse=False):
        yield tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 leaves an empty placeholder, the shape in ds_shape
    for plist in getattr(module, "parametrizations", {}).values():
        state = next((q.quant_state for q in plist if getattr(q, "quant_state", None) is not None), None)
        yield tuple(state.shape) if getattr(state, "shape", None) is not None else tuple(plist.original.shape)


def routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """The router modules of ``model`` (any wrapper around a transformers model) in layer order:
    ``[(qualified name, module, E)]``; empty for a dense model. A router wrapped by peft (its ``base_layer``) is
    found as the wrapper's inner module, so hooks see the router's own output."""
    found, seen, blocks = [], set(), {}
    experts = experts_modules(model)  # the one rule (sft.model.experts), in module order
    for _, m, block in experts:
        blocks.setdefault(block, num_experts(m))
    ids = {id(m) for _, m, _ in experts}
    for name, n_experts in blocks.items():
        for child_name, child in model.get_submodule(name).named_children():
            inner = _unwrapped(child)
            if id(inner) in ids or id(inner) in seen or isinstance(inner, torch.nn.Linear):
                continue
            if any(len(shape) == 2 and shape[0] == n_experts for shape in _shapes(inner)):
                seen.add(id(inner))
                found.append((f"{name}.{child_name}" if name else child_name, inner, int(n_experts)))
    return found


def aux_free_routers(model: torch.nn.Module) -> int:
    """How many routers carry a score-correction bias: a float buffer of ``E`` entries added to the routing scores
    (DeepSeek-V3's ``e_score_correction_bias``), balancing without an aux loss."""
    return sum(any(b.dim() == 1 and b.shape[0] == e and b.is_floating_point() for b in r.buffers(recurse=False))
               for _, r, e in routers(model))


def _text_config(model):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_aux_coef(model) -> Optional[float]:
    """The model's own aux-loss coefficient: its (text) config's ``router_aux_loss_coef`` or another attribute named
    ``*aux_loss_coef`` / ``*aux_loss_alpha``, where its forward takes ``output_router_logits`` (it computes the aux
    loss); None for a dense or aux-free model."""
    if not routers(model):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "output_router_logits" not in inspect.signature(base.forward).parameters:
        return None
    config = _text_config(base)
    names = sorted(k for k in vars(config) if k.endswith(("aux_loss_coef", "aux_loss_alpha")))
    for key in ["router_aux_loss_coef"] + names:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def resolve_aux_coef(model, requested: Optional[float], router_trained: bool) -> float:
    """The aux-loss coefficient in force, logged in one line: ``requested`` (``--moe_aux_loss_coef``) when given, else
    the model's own (:func:`model_aux_coef`) when the router is trained (full fine-tuning, or LoRA with
    ``--lora_router True``), else 0 (a frozen router cannot learn to balance). 0 for a dense model.

    Raises:
        ConfigError: ``requested`` > 0 on a model that computes no aux loss (dense, or aux-free).
    """
    if not routers(model):
        if requested:
            raise ConfigError([f"--moe_aux_loss_coef {requested}: the model has no experts (no router found); leave "
                               "it unset"])
        return 0.0
    own, free = model_aux_coef(model), aux_free_routers(model)
    if own is None:
        if requested:
            raise ConfigError([f"--moe_aux_loss_coef {requested}: this model computes no load-balancing loss"
                               + (" (it balances with its routers' score-correction bias)" if free else "")
                               + "; leave it unset"])
        logger.info("routing: no aux loss; %s", f"aux-loss-free balancing by the score-correction bias of {free} "
                    "router(s), kept as loaded (a buffer: not trained, not updated)" if free else
                    "the model defines none")
        return 0.0
    coef = float(requested) if requested is not None else own if router_trained else 0.0
    why = (f"--moe_aux_loss_coef; the model's is {own:g}" if requested is not None else "the model's own"
           if router_trained else f"the router is frozen: LoRA without --lora_router True; the model's is {own:g}")
    logger.info("routing: aux loss coefficient %g (%s)%s", coef, why, ", weighted like the cross entropy over the "
                "global batch" if coef else ": the aux loss is logged, not trained")
    return coef


def disable_model_aux(model) -> None:
    """Switch off the model's own ``coef * aux`` addition to its loss (the causal LM's ``router_aux_loss_coef``
    attribute, read by its forward; the config, and so the saved ``config.json``, keep the model's value)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "router_aux_loss_coef"):
        base.router_aux_loss_coef = 0.0


def weighted_aux(aux: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """A micro batch's aux loss weighed as its cross entropy is: ``aux * supervised targets of the micro batch /
    num_items_in_batch`` (the global batch's supervised targets, across gradient accumulation and ranks), or ``aux``
    when ``num_items_in_batch`` is None (the Trainer then divides every micro batch's loss by the accumulation
    steps). ``aux``: 0-d float; ``shift_labels``: ``[batch, seq]``, -100 where not supervised. Returns a 0-d fp32
    tensor."""
    aux = aux.float()
    if num_items_in_batch is None:
        return aux
    mine = (shift_labels != -100).sum().to(aux.device, torch.float32)
    total = num_items_in_batch.to(aux.device, torch.float32) if torch.is_tensor(num_items_in_batch) else \
        torch.tensor(float(num_items_in_batch), device=aux.device)
    return aux * mine / total
