"""The uses of peft internals: keep gptqmodel unimported when the model has no GPTQ layers; custom LoRA layers
for experts; no v4 -> v5 MoE rewriting of our targets.

peft 0.21.2's LoRA dispatch (``peft.tuners.lora.gptq.dispatch_gptq``, ``...awq``, ``peft.utils.other``) imports
gptqmodel for every layer whenever gptqmodel is installed (``peft.import_utils.is_gptqmodel_available``). Importing
gptqmodel prints its banner and "Auto setting PYTORCH_ALLOC_CONF / CUDA_DEVICE_ORDER" lines and sets those
variables, in every LoRA run and merge of a 16-bit model, where no GPTQ layer can exist. Checked against
peft 0.21.2 (the modules below each bind ``is_gptqmodel_available`` by name) and gptqmodel 7.6.0.
"""
from __future__ import annotations

import contextlib
import importlib

# peft modules that bind is_gptqmodel_available by name (peft 0.21.2)
_PEFT_MODULES = ("peft.tuners.lora.gptq", "peft.tuners.lora.awq", "peft.utils.other", "peft.utils.quantization_utils")


@contextlib.contextmanager
def without_gptqmodel(active: bool = True):
    """Within the block, peft sees gptqmodel as not installed (``active`` False: no change). Use it only around
    peft calls on a model without GPTQ layers. A peft without one of these modules or names is left as it is."""
    saved = []
    if active:
        for name in _PEFT_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(mod, "is_gptqmodel_available"):
                saved.append((mod, mod.is_gptqmodel_available))
                mod.is_gptqmodel_available = lambda: False
    try:
        yield
    finally:
        for mod, fn in saved:
            mod.is_gptqmodel_available = fn


def register_custom_lora_layer(config, mapping: dict) -> None:
    """Have peft build ``mapping[type(base)]`` (a LoRA layer class) for every target whose base module is of that type,
    also for ``target_parameters`` (``LoraConfig._register_custom_module``, peft 0.21.2's experimental custom-layer
    dispatch, tried before its own layers: ``peft.tuners.lora.model.LoraModel._create_new_module``)."""
    config._register_custom_module(mapping)


@contextlib.contextmanager
def without_v4_moe_conversion():
    """Within the block, peft does not rewrite a LoRA config or adapter state dict for transformers v4 -> v5 MoE
    renames (peft 0.21.2, ``peft.utils.transformers_weight_conversion``: for qwen3_moe, qwen3_next, deepseek_v3 and
    mixtral it moves the names ``gate_proj``/``up_proj``/``down_proj``/``w1``-``w3``/``gate`` out of ``target_modules``
    into ``target_parameters`` and doubles the rank of ``gate_up_proj``, which takes LoRA off shared experts and dense
    MLPs named so). Our targets are already v5 names; an adapter trained with v4 names is not ours to convert."""
    mod = importlib.import_module("peft.utils.transformers_weight_conversion")
    saved = (mod.convert_peft_config_for_transformers, mod.convert_peft_adapter_state_dict_for_transformers)
    mod.convert_peft_config_for_transformers = lambda peft_config, model, conversions: None
    mod.convert_peft_adapter_state_dict_for_transformers = (
        lambda model, peft_config, adapter_state_dict, adapter_name="default": adapter_state_dict)
    try:
        yield
    finally:
        mod.convert_peft_config_for_transformers, mod.convert_peft_adapter_state_dict_for_transformers = saved


def param_ndim(wrapper) -> int:
    """The number of dimensions of the parameter a ``peft.tuners.lora.layer.ParamWrapper`` adapts (3 for an expert
    stack, 2 for a matrix): its private ``_param_ndim`` (peft 0.21.2); 0 where a peft has no such attribute."""
    return int(getattr(wrapper, "_param_ndim", 0) or 0)
