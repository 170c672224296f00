"""``sft-export --for vllm``: a LoRA adapter whose routed experts are laid out as vLLM reads a 3-D expert adapter.

What vLLM reads (``vllm/lora/model_manager.py``, ``LoRAModelManager._stack_moe_lora_weights`` and
``_convert_3d_to_2d_moe_lora``, vllm-project/vllm at 01533aa8): per experts module ``P`` (``...mlp.experts``) two
flat pairs, peft's own tensors,

* ``P.base_layer.lora_A.weight`` ``[r·E, hidden]`` and ``P.base_layer.lora_B.weight`` ``[2·I, r·E]``: the fused
  ``gate_up_proj`` (vLLM's ``w13``);
* ``P.lora_A.weight`` ``[r·E, I]`` and ``P.lora_B.weight`` ``[hidden, r·E]``: ``down_proj`` (vLLM's ``w2``);

read as ``A.reshape(E, r, in)`` and ``B.reshape(out, r, E).permute(2, 0, 1)``: expert e's update is
``(alpha / r) · B[e] @ A[e]`` ``[out, in]``, exactly peft's ``ParamWrapper.get_delta_weight`` (peft 0.21.2). Both
pairs must be there (vLLM asserts it). Which factor sits at ``P.base_layer`` is not a name but the nesting of peft's
wrappers: peft wraps a module's targeted parameters in the order the module declares them
(``BaseTuner._inject_parameters``, peft 0.21.2), the first one innermost. transformers 5.24's experts classes declare
``gate_up_proj`` before ``down_proj`` (qwen3_moe, gpt_oss, ... checked in the test), so their adapters already agree
with vLLM; nothing in the file says so, and an experts class declaring them the other way round would have vLLM read
``down_proj``'s factors as ``gate_up_proj``'s. So the export finds each factor's parameter on the base model's skeleton
wrapped by peft (meta device: its config only), checks each against the shapes above, and writes it under vLLM's name;
every other tensor (attention, shared experts, dense MLPs) keeps its name. vLLM reads this layout as it is for models
whose vLLM class sets ``is_3d_moe_weight = True`` (e.g. its Qwen3.5-MoE and gpt-oss classes); for the others
(``is_3d_moe_weight = False``: per-expert 2-D keys) only when started with ``--enable-mixed-moe-lora-format`` and the
adapter loaded with ``is_3d_lora_weight`` (``_convert_3d_to_2d_moe_lora``, same file).

Not written, refused with one line instead (:class:`sft.errors.SFTError`): an experts module with only one of the
two adapted, experts without a fused ``gate_up_proj`` (vLLM's 3-D path has ``w13`` and ``w2`` only), an adapted
router (a LoRA on a 2-D parameter: how vLLM reads one was not established here), and any server but vLLM.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from sft.errors import SFTError

SERVERS = ("vllm",)
GATE_UP, DOWN = "gate_up_proj", "down_proj"


def _skeleton(base: str, adapter_dir: str):
    """The base model with the adapter's peft wrappers, on the meta device (no weight read, no memory)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from sft.compat.peft import without_gptqmodel, without_v4_moe_conversion
    from sft.errors import explain_load_errors
    from sft.model.architecture import auto_class

    with explain_load_errors("base model config", base, "give the base model's folder with --base"):
        config = transformers.AutoConfig.from_pretrained(base)
    with explain_load_errors("adapter config", adapter_dir, "it must be the adapter_config.json peft writes"):
        lora_config = LoraConfig.from_pretrained(adapter_dir)
    lora_config.lora_dropout = 0.0
    with torch.device("meta"):
        model = auto_class(config).from_config(config)
    with without_gptqmodel(), without_v4_moe_conversion(), \
            explain_load_errors("adapter", adapter_dir, "check that it was trained on this base model"):
        return get_peft_model(model, lora_config)


def vllm_expert_keys(base: str, adapter_dir: str, tensors: dict) -> tuple[dict, int]:
    """``(renamed, modules)``: ``tensors`` (the adapter's ``adapter_model.safetensors``) with every experts module's
    factors under vLLM's names (module docstring), and the number of experts modules so renamed (0: a dense model's
    adapter, written unchanged). Shapes: see the module docstring; dtypes unchanged.

    Raises:
        SFTError: a layout vLLM would misread or drop (module docstring), or a tensor missing or of another shape
            than the base model's experts give (an adapter of another base).
    """
    from peft.tuners.lora.layer import ParamWrapper

    groups: dict[str, dict] = {}
    for name, m in _skeleton(base, adapter_dir).named_modules():
        if not isinstance(m, ParamWrapper):
            continue
        if m.num_experts <= 1:
            raise SFTError(f"{adapter_dir}: adapts {name.replace('.base_layer', '')}.{m.parameter_name} (a LoRA on a "
                           "2-D parameter: a router trained with --lora_router True); how vLLM reads one was not "
                           "established, so no vLLM layout is written; serve the merged model instead "
                           "(sft-export --merge)")
        groups.setdefault(name.replace(".base_layer", ""), {})[m.parameter_name] = (name, m)
    renamed = dict(tensors)
    for path, params in groups.items():
        if set(params) != {GATE_UP, DOWN}:
            raise SFTError(f"{adapter_dir}: {path} adapts the expert parameters {', '.join(sorted(params))}; vLLM's "
                           f"3-D expert LoRA needs both {GATE_UP} and {DOWN} (it reads w13 and w2 together and "
                           "asserts both), so an export would be refused or misread by vLLM; train with both "
                           "adapted (the default targets), or serve the merged model (sft-export --merge)")
        (_, gu), (_, dn) = params[GATE_UP], params[DOWN]
        if gu.out_features != 2 * dn.in_features:
            raise SFTError(f"{adapter_dir}: {path}.{GATE_UP} has {gu.out_features} outputs, not twice {DOWN}'s "
                           f"{dn.in_features} inputs (no fused gate and up projection): not vLLM's w13")
        for param, place in ((GATE_UP, f"{path}.base_layer"), (DOWN, path)):
            wrapper_name, m = params[param]
            r, e = next(iter(m.r.values())), m.num_experts
            for factor, shape in (("lora_A", (r * e, m.in_features)), ("lora_B", (m.out_features, r * e))):
                key = f"{wrapper_name}.{factor}.weight"
                got = tensors.get(key)
                if got is None or tuple(got.shape) != shape:
                    have = "missing" if got is None else f"of shape {list(got.shape)}"
                    raise SFTError(f"{adapter_dir}: {key} is {have}, the base model's {path}.{param} gives "
                                   f"{list(shape)} (r={r}, E={e}); is the adapter trained on this base model?")
                renamed[f"{place}.{factor}.weight"] = got
    return renamed, len(groups)


def vllm_delta(tensors: dict, path: str, param: str, num_experts: int, scaling: float) -> torch.Tensor:
    """Expert updates ``[E, out, in]`` (float32) of ``param`` (``gate_up_proj`` or ``down_proj``) of experts module
    ``path``, read from ``tensors`` in vLLM's 3-D layout the way vLLM reads them (module docstring)."""
    place = f"{path}.base_layer" if param == GATE_UP else path
    a = tensors[f"{place}.lora_A.weight"].float()
    b = tensors[f"{place}.lora_B.weight"].float()
    a = a.reshape(num_experts, -1, a.shape[-1])  # (E, r, in)
    b = b.reshape(b.shape[0], -1, num_experts).permute(2, 0, 1)  # (E, out, r)
    return scaling * b @ a


def write_vllm_adapter(adapter_dir: str, base: Optional[str], tmp: str) -> str:
    """Write ``adapter_dir``'s adapter into folder ``tmp`` in vLLM's layout (``adapter_model.safetensors`` renamed by
    :func:`vllm_expert_keys`, ``adapter_config.json`` as it is). ``base``: the base model's folder (default: the
    adapter config's ``base_model_name_or_path``), read for its config only. Returns a one-line description.

    Raises:
        SFTError: as :func:`vllm_expert_keys`; no base model folder.
    """
    from safetensors.torch import load_file, save_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        base = base or json.load(f).get("base_model_name_or_path")
    if not base or not os.path.isdir(base):
        raise SFTError(f"base model {base!r} not found; pass --base with the base model's folder (its config.json "
                       "gives the experts' shapes)")
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    renamed, modules = vllm_expert_keys(base, adapter_dir, tensors)
    save_file(renamed, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = f.read()
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        f.write(config)
    kept = sum(1 for k in renamed if not re.search(r"\.experts\.(base_layer\.)?lora_[AB]\.weight$", k))
    return (f"adapter_model.safetensors in vLLM's 3-D expert layout ({modules} experts modules: gate_up_proj at "
            f"experts.base_layer, down_proj at experts; {kept} other tensors unchanged)")
