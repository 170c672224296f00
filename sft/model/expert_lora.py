"""LoRA on experts stored as 3-D parameters, computed over the token -> expert grouping, never as ``W + s·B·A``.

peft adapts a 3-D expert parameter ``W`` [E, out, in] (or [E, in, out] where the experts module says
``is_transposed``) with ``lora.ParamWrapper``: ``lora_A`` [r·E, in] and ``lora_B`` [out, r·E], expert ``e``'s factors
being ``A_e = lora_A.view(E, r, in)[e]`` and ``B_e = lora_B.view(out, r, E)[:, :, e]``. Its forward builds
``W + s·B·A`` for the whole expert stack on every call (and again in each checkpointed recompute) and refuses
dropout. :class:`ExpertLoraWrapper` keeps peft's layer, parameters, names and saved format (it *is* a
``ParamWrapper``: merge, unload and ``PeftModel.from_pretrained`` work unchanged) and replaces only the forward of
a wrapped experts module:

    out_rows = x_g W_e^T + s · ((dropout(x_g) A_e^T) B_e^T)    for the rows x_g routed to expert e

in two grouped matmuls of rank ``r`` beside the frozen one, over the same sort by expert as transformers'
``grouped_mm`` experts path. The adapter's factors are only reshaped and cast (r·E·(in + out) numbers), never
multiplied out. Why a peft layer and not an implementation in transformers' ``ExpertsInterface``: the factors, their
initialisation, saving, loading and merging are peft's, and the layer is what peft dispatches for a targeted
parameter; an experts function would still need peft's wrapper to stop building ``W + s·B·A``.

A 2-D parameter (a router's ``weight`` under ``--lora_router True``) keeps peft's own forward (the ``r × in``
update is router-sized) without dropout: a custom router's product cannot be split from its weight.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from peft.tuners.lora.layer import ParamWrapper as PeftParamWrapper

from sft.compat.peft import param_ndim
from sft.compat.transformers import experts_apply_gate, experts_are_parallel, grouped_linear


def _aligned(t: torch.Tensor) -> bool:
    """torch's CPU/CUDA ``grouped_mm`` wants 16-byte aligned data and strides and one unit stride."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and 1 in t.stride()[-2:] and all(
        (s * size) % 16 == 0 for s in t.stride() if s != 1)


def _contiguous_grad(g: torch.Tensor) -> torch.Tensor:
    return g.contiguous()  # torch's grouped_mm backward refuses broadcast (stride-0) gradients


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [S, in] times their expert's ``w[e]`` [in, out] (rows sorted by expert, ``offsets`` [E] int32
    cumulative counts); [S, out]. torch's ``grouped_mm`` where shapes are aligned, a loop over experts otherwise."""
    if hasattr(torch.nn.functional, "grouped_mm") and _aligned(x) and _aligned(w):
        out = torch.nn.functional.grouped_mm(x, w, offs=offsets)
        if out.requires_grad:
            out.register_hook(_contiguous_grad)
        return out
    bounds = [0] + offsets.tolist()
    parts = [x[a:b] @ w[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


class ParamWrapper(PeftParamWrapper):
    """:data:`ExpertLoraWrapper`: peft's ``ParamWrapper`` whose forward, on an experts module, runs
    :func:`lora_experts_forward` for every wrapped parameter at once (the outermost wrapper of the nest does it;
    inner ones are not called), with ``config.lora_dropout`` on the adapter's input. Built by peft through
    :func:`sft.compat.peft.register_custom_lora_layer`. Multiple active adapters, merged weights, disabled adapters and
    transformers' own expert parallelism fall back to peft's own forward; under ``--expert_parallel_size``
    (:mod:`sft.model.expert_parallel`) the experts' rows are exchanged and this rank's experts run with their LoRA.

    Named ``ParamWrapper``: peft 0.21.2 nests the wrappers of two parameters of one module only when the outer one's
    class is called so (``peft.tuners.tuners_utils.BaseTuner._inject_parameters`` compares class names)."""

    def __init__(self, base_layer, adapter_name: str, parameter_name: str, config, **kwargs) -> None:
        self._sft_dropout = float(config.lora_dropout or 0.0)
        quiet = copy.copy(config)
        quiet.lora_dropout = 0.0  # peft refuses dropout here: it cannot factor x out of W + s·B·A; we do
        super().__init__(base_layer, adapter_name, parameter_name, quiet, **kwargs)

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs) -> None:
        quiet = copy.copy(config)
        quiet.lora_dropout = 0.0
        super().update_layer(adapter_name, r, lora_alpha, quiet, **kwargs)
        if param_ndim(self) == 3 and self._sft_dropout > 0:
            self.lora_dropout[adapter_name] = torch.nn.Dropout(self._sft_dropout)

    def expert_factors(self, adapter: str, dtype: torch.dtype):
        """``(A [E, in, r], B [E, r, out], scaling, dropout)`` of this wrapper's parameter, in ``dtype``."""
        a = self.lora_A[adapter].weight  # [r·E, in]
        b = self.lora_B[adapter].weight  # [out, r·E]
        e = self.num_experts
        a3 = a.reshape(e, -1, a.shape[-1]).transpose(1, 2).to(dtype)  # [E, in, r] (a view when dtype matches)
        b3 = b.reshape(b.shape[0], -1, e).permute(2, 1, 0).to(dtype).contiguous()  # [E, r, out]: r·E·out numbers
        return a3, b3, self.scaling[adapter], self.lora_dropout[adapter]

    def forward(self, x: torch.Tensor, *args, **kwargs):
        chain, base = [self], self.base_layer
        while isinstance(base, PeftParamWrapper):
            chain.append(base)
            base = base.base_layer
        adapters = self.active_adapters
        plain = (self.disable_adapters or self.merged or len(adapters) != 1 or kwargs.get("adapter_names")
                 or experts_are_parallel(base) or not hasattr(base, "is_transposed")
                 or any(not isinstance(w, ParamWrapper) or param_ndim(w) != 3 for w in chain))
        spread = getattr(base, "sft_expert_parallel_forward", None)  # sft.model.expert_parallel: E/N experts here
        if spread is not None and not (self.disable_adapters or self.merged):
            if len(adapters) != 1 or kwargs.get("adapter_names"):
                raise RuntimeError("expert parallelism runs one active adapter (peft's mixed-batch adapters: no)")
            return spread(x, *args, loras={w.parameter_name: w for w in chain if adapters[0] in w.lora_A},
                          adapter=adapters[0], **kwargs)
        if plain:
            return spread(x, *args, **kwargs) if spread is not None else super().forward(x, *args, **kwargs)
        loras = {w.parameter_name: w for w in chain if adapters[0] in w.lora_A}
        return lora_experts_forward(base, x, *args, loras=loras, adapter=adapters[0], **kwargs)


ExpertLoraWrapper = ParamWrapper


def lora_experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, *, loras: dict, adapter: str) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts forward (5.24, ``integrations.moe.grouped_mm_experts_forward``) with each
    projection in ``loras`` (parameter name -> :class:`ExpertLoraWrapper`) adding ``s · grouped(grouped(dropout(x),
    A), B)`` to its grouped product, before the gate and activation (so gpt-oss's interleaved gate/up columns and
    biases line up as in the base).

    Args:
        experts: the experts module (``use_experts_implementation`` layout: ``has_gate``, ``has_bias``,
            ``is_transposed``, ``num_experts``, ``_apply_gate``, ``act_fn``).
        hidden_states: [T, hidden]; top_k_index: [T, k] expert ids; top_k_weights: [T, k] routing weights.

    Returns:
        [T, hidden] in ``hidden_states``' dtype.
    """
    k = top_k_index.size(-1)
    tokens = hidden_states.size(0)
    weights_flat = top_k_weights.reshape(-1)
    ids_sorted, perm = torch.sort(top_k_index.reshape(-1))
    x_g = hidden_states[perm // k]
    weights_g = weights_flat[perm]
    out = expert_rows(experts, x_g, ids_sorted, group_offsets(ids_sorted, experts.num_experts), loras, adapter)
    out = out * weights_g.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inv].view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def group_offsets(ids_sorted: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int32 cumulative row counts of ``ids_sorted`` (expert ids in 0..E-1, ascending): the ``offsets`` of
    :func:`grouped_mm`."""
    hist_in = ids_sorted.float() if ids_sorted.device.type in ("cpu", "mps") else ids_sorted.int()
    counts = torch.histc(hist_in, bins=num_experts, min=0, max=num_experts - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def expert_rows(experts, x_g: torch.Tensor, ids_sorted: torch.Tensor, offsets: torch.Tensor, loras: dict,
                adapter: Optional[str]) -> torch.Tensor:
    """Each row of ``x_g`` [S, hidden] (sorted by expert: ``ids_sorted`` [S], ids of ``experts``' own parameters)
    through its expert -- up (gate) projection, activation, down projection, each with its LoRA of ``loras`` --
    before the routing weight; [S, hidden] in the experts' dtype. ``offsets``: :func:`group_offsets`."""

    def project(name: str, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        y = grouped_linear(x, getattr(experts, name), offsets, bias=bias, is_transposed=experts.is_transposed)
        wrapper = loras.get(name)
        if wrapper is not None:
            a3, b3, scale, dropout = wrapper.expert_factors(adapter, y.dtype)
            h = grouped_mm(dropout(x).to(y.dtype), a3, offsets)
            y = y + scale * grouped_mm(h, b3, offsets)
        return y

    up = "gate_up_proj" if experts.has_gate else "up_proj"
    bias = getattr(experts, f"{up}_bias")[ids_sorted] if experts.has_bias else None
    h = project(up, x_g, bias)
    h = experts_apply_gate(experts, h) if experts.has_gate else experts.act_fn(h)
    bias = experts.down_proj_bias[ids_sorted] if experts.has_bias else None
    out = project("down_proj", h, bias)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return out


_LAYER_STATE = ("parameter_name", "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                "lora_dropout", "r", "lora_alpha", "scaling", "use_rslora", "use_dora", "lora_bias", "lora_variant",
                "in_features", "out_features", "num_experts", "_param_ndim", "_did_swap_in_out_features",
                "_sft_dropout")


def nest_in_declared_order(model) -> int:
    """Put the adapters of each experts module's nested wrappers in the order a 16-bit model gets them (the first
    declared parameter innermost). peft nests a 4-bit (parametrized) module's wrappers in sorted name order
    (``down_proj`` inside ``gate_up_proj``) and a 16-bit one's in declaration order, so that a Q-LoRA adapter would
    save as ``experts.lora_A`` what a 16-bit run saves as ``experts.base_layer.lora_A``; moved here, a Q-LoRA adapter
    loads onto (and merges into) the 16-bit base. Returns the number of nests reordered."""
    moved = 0
    outers = [m for m in model.modules() if isinstance(m, ParamWrapper)
              and not any(getattr(p, "base_layer", None) is m for p in model.modules())]
    for outer in outers:
        chain, base = [], outer
        while isinstance(base, ParamWrapper):
            chain.append(base)
            base = base.base_layer
        chain.reverse()  # innermost first
        declared = list(getattr(base, "parametrizations", {}).keys()) or [
            n for n, _ in base.named_parameters(recurse=False)]
        want = sorted(chain, key=lambda w: declared.index(w.parameter_name))
        if want == chain:
            continue
        states = [{k: getattr(w, k) for k in _LAYER_STATE if hasattr(w, k)} for w in want]
        for w, state in zip(chain, states):
            for k, v in state.items():
                if isinstance(v, torch.nn.Module):
                    setattr(w, k, v)  # nn.Module.__setattr__: replaces the registered child
                else:
                    object.__setattr__(w, k, v)
        moved += 1
    return moved
