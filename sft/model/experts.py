"""What LoRA adapts, decided by what the layers are (not by model names).

An **experts module** holds 3-D parameters [E, ...] that transformers runs as experts: the layout
``use_experts_implementation`` gives it (``num_experts``, ``has_gate``, ``is_transposed``), or 3-D parameters beside a
router of E rows reading one of their dimensions (Llama 4, LongCat-Flash, JetMoE, whose experts transformers runs with
its own ``bmm`` or loop); never a convolution (the depthwise ``Conv1d`` weights of hybrid layers are 3-D too).
:func:`experts_modules` is the one rule: LoRA, Q-LoRA, ZeRO-3's leaf blocks, the routers
(:mod:`sft.model.routing`) and the FLOPs count (:mod:`sft.train.counting`) all take their experts from it. Its parent
is a mixture-of-experts block; the block's other children are its **router** (a ``weight`` [E, hidden], its own or
its one linear's, or a linear gate with one output: a shared expert's gate) and its **shared** experts (everything
else with linear layers). Every other linear layer is **mlp** when it sits in a
module whose class is an MLP, else **attention** (attention, linear attention, state-space and convolution
projections: the token mixers). The output embedding is never a target.

:func:`lora_candidates` lists them; :func:`choose_targets` applies the rule of ``--use_lora True`` (everything but
routers; routers with ``--lora_router True``) or ``--lora_target_modules``; :func:`peft_targets` writes the choice as
peft's ``target_modules`` / ``target_parameters`` so that peft matches exactly the chosen set.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import torch

from sft.errors import SFTError

KINDS = ("attention", "experts", "shared", "router", "mlp")


@dataclasses.dataclass(frozen=True)
class Target:
    """One thing LoRA can adapt.

    Attributes:
        path: the module path (``model.layers.0.self_attn.q_proj``) or, for a parameter, the parameter path
            (``model.layers.0.mlp.experts.gate_up_proj``).
        name: the name ``--lora_target_modules`` uses: a module's last name, or an expert parameter's name.
        kind: one of :data:`KINDS`.
        parameter: a parameter target (peft's ``target_parameters``), not a module.
    """

    path: str
    name: str
    kind: str
    parameter: bool = False


def is_experts_module(module: torch.nn.Module, parent: Optional[torch.nn.Module] = None) -> bool:
    """True for a module whose own 3-D parameters [E, ...] are experts (see the module docstring): transformers'
    experts layout (``is_transposed``, ``num_experts`` = every 3-D parameter's E), or, with the module's ``parent``
    (the mixture-of-experts block) given, 3-D parameters [E >= 2, >= 2, >= 2] beside a router: another child of
    ``parent`` shaped as a router (:func:`_router_shape`) whose weight is [E, d], d one of the first 3-D parameter's
    other dimensions (the hidden size the experts read; Llama 4, LongCat-Flash, JetMoE: experts that transformers
    runs with its own loop or ``bmm``). A convolution is never one."""
    if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
        return False
    shapes = [expert_shape(module, n) for n in expert_parameter_names(module)]
    if not shapes:
        return False
    if hasattr(module, "is_transposed"):
        e = getattr(module, "num_experts", None)
        return all(s[0] == e for s in shapes)
    e = shapes[0][0]
    if parent is None or e < 2 or any(min(s[1:]) < 2 for s in shapes):
        return False
    for child in parent.children():
        child = _unwrapped(child)
        if child is module or expert_parameter_names(child):
            continue
        shape = _router_shape(child)
        if shape is not None and shape[0] == e and shape[1] in shapes[0][1:]:
            return True
    return False


def num_experts(module: torch.nn.Module) -> int:
    """E of an experts module (:func:`is_experts_module`): its ``num_experts``, else its first 3-D parameter's leading
    dimension."""
    e = getattr(module, "num_experts", None)
    if isinstance(e, int):
        return e
    return int(expert_shape(module, expert_parameter_names(module)[0])[0])


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """Every experts module of ``model`` (any wrapper around a transformers model, peft's included), the one rule of
    this package: ``[(qualified name, experts module, name of its block)]`` in module order. A child wrapped by peft
    (``base_layer`` chains) is found as the module it wraps, named with its ``.base_layer`` path. Found also when
    ZeRO-3 has partitioned the parameters (their ``ds_shape``) or bitsandbytes holds them in 4-bit."""
    found, seen = [], set()
    for name, parent in model.named_modules():
        if isinstance(getattr(parent, "base_layer", None), torch.nn.Module):
            continue  # a peft wrapper (around an experts module, or around another wrapper), not a block
        for cname, child in parent.named_children():
            path = f"{name}.{cname}" if name else cname
            while isinstance(getattr(child, "base_layer", None), torch.nn.Module):  # peft's wrappers
                child, path = child.base_layer, f"{path}.base_layer"
            if id(child) not in seen and is_experts_module(child, parent):
                seen.add(id(child))
                found.append((path, child, name))
    return found


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(module, "base_layer", None), torch.nn.Module):  # peft's wrappers
        module = module.base_layer
    return module


def _router_shape(child: torch.nn.Module) -> Optional[tuple]:
    """The shape of a router's 2-D ``weight`` when ``child`` is shaped as one: the weight held by ``child`` itself
    without submodules, or by its one submodule holding parameters (a router class around a linear layer: JetMoE,
    LongCat-Flash); else None. A ZeRO-3 partitioned weight's ``ds_shape``."""
    holders = [(n, m) for n, m in child.named_modules() if any(True for _ in m.parameters(recurse=False))]
    if len(holders) != 1 or (holders[0][0] == "" and any(True for _ in child.children())):
        return None
    w = getattr(holders[0][1], "weight", None)
    shape = tuple(getattr(w, "ds_shape", getattr(w, "shape", ())))
    return shape if isinstance(w, torch.Tensor) and len(shape) == 2 else None


def expert_parameter_names(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s own 3-D parameters (also those replaced by a parametrization, e.g. 4-bit)."""
    # a parameter partitioned by ZeRO-3 (deepspeed.zero.Init) is an empty placeholder; its shape is in ``ds_shape``
    own = [n for n, p in module.named_parameters(recurse=False) if len(getattr(p, "ds_shape", p.shape)) == 3]
    parametrized = getattr(module, "parametrizations", None) or {}
    return own + [n for n in parametrized.keys() if n not in own and len(expert_shape(module, n)) == 3]


def expert_shape(module: torch.nn.Module, name: str) -> torch.Size:
    """The logical shape of parameter ``name`` (a 4-bit parametrized one: the shape it stands for)."""
    plists = getattr(module, "parametrizations", None)
    plist = plists[name] if plists is not None and name in plists else None
    if plist is not None:
        for p in plist:
            qs = getattr(p, "quant_state", None)
            if qs is not None:
                return torch.Size(qs.shape)
        return getattr(module, name).shape
    p = getattr(module, name)
    return getattr(p, "ds_shape", p.shape)


def experts_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The mixture-of-experts blocks of ``model`` (any wrapper around a transformers model, peft's included):
    ``[(qualified name in model, block)]`` in module order, a block being the parent of an experts module
    (:func:`experts_modules`); empty for a dense model."""
    found, names = [], set()
    for _, _, block in experts_modules(model):
        if block not in names:
            names.add(block)
            found.append((block, model.get_submodule(block)))
    return found


def mark_zero3_leaf_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Flag every mixture-of-experts block of ``model`` (:func:`experts_blocks`) as a ZeRO-3 leaf module; call it
    before ``deepspeed.initialize`` (the Trainer's ``train``), which installs ZeRO-3's hooks.

    ZeRO-3 gathers a module's parameters in that module's forward hook and prefetches in the order it traced. A
    leaf module (``deepspeed.utils.set_z3_leaf_modules_by_name``, deepspeed 0.19.8: sets ``module._z3_leaf``; no
    hook below it) gathers every parameter under it on entry: the whole expert stack and its LoRA factors, which
    the expert LoRA forward (:mod:`sft.model.expert_lora`) reads as tensors, never by calling their modules; and a
    rank whose tokens reach no token of some expert gathers what the other ranks gather, so no collective waits
    for it. DeepSpeed flags three classes by default (Mixtral, Qwen2-MoE, Qwen3-MoE); this flags every block found
    by structure, whatever its class. Returns the blocks flagged ``[(name, block)]`` (empty for a dense model)."""
    from deepspeed.utils import set_z3_leaf_modules_by_name

    blocks = experts_blocks(model)
    if blocks:
        set_z3_leaf_modules_by_name(model, [name for name, _ in blocks])
    return blocks


def _is_router(child: torch.nn.Module, num_experts: int) -> bool:
    """``child`` (of a mixture-of-experts block of ``num_experts`` experts) is its router (:func:`_router_shape`):
    E rows, or 1 (a shared expert's gate)."""
    shape = _router_shape(child)
    return shape is not None and shape[0] in (num_experts, 1)


def lora_candidates(model: torch.nn.Module, is_linear: Callable[[torch.nn.Module], bool]) -> list[Target]:
    """Everything LoRA can adapt in ``model``, classified (module order). ``is_linear``: what counts as a linear layer
    (``torch.nn.Linear`` and its subclasses; gptqmodel's quantized linears)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    modules = dict(model.named_modules())
    special: dict[str, str] = {}  # module path -> kind, for the parts of mixture-of-experts blocks
    expert_targets = []
    found = experts_modules(model)
    experts_ids = {id(m) for _, m, _ in found}
    for path, m, block_path in found:
        for n in expert_parameter_names(m):
            expert_targets.append(Target(f"{path}.{n}", n, "experts", parameter=True))
        for cname, child in modules[block_path].named_children():
            cpath = f"{block_path}.{cname}" if block_path else cname
            if id(child) in experts_ids:
                continue
            kind = "router" if _is_router(child, num_experts(m)) else "shared"
            for sub, _ in child.named_modules():
                special[f"{cpath}.{sub}" if sub else cpath] = kind
    targets = []
    for path, m in modules.items():
        own = getattr(m, "weight", None)
        if special.get(path) == "router" and not is_linear(m) and isinstance(own, torch.Tensor):
            targets.append(Target(f"{path}.weight", path.rpartition(".")[2], "router", parameter=True))
        elif is_linear(m) and m is not out_emb and path:
            kind = special.get(path) or _dense_kind(path, modules)
            targets.append(Target(path, path.rpartition(".")[2], kind))
    return targets + expert_targets


def _dense_kind(path: str, modules: dict) -> str:
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if type(modules[".".join(parts[:i])]).__name__.lower().endswith("mlp"):
            return "mlp"
    return "attention"


def choose_targets(candidates: list[Target], names: Optional[tuple[str, ...]], router: bool) -> list[Target]:
    """The targets of ``--lora_target_modules names`` (None or ``all-linear``: attention, experts, shared experts and
    dense MLPs; routers too with ``router``, i.e. ``--lora_router True``).

    Raises:
        SFTError: a name matches nothing (naming what exists, by kind), or names a router without ``router``.
    """
    if not names or tuple(names) == ("all-linear",):
        return [t for t in candidates if t.kind != "router" or router]
    known = {t.name for t in candidates}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SFTError(f"--lora_target_modules {' '.join(names)}: {', '.join(unknown)} not in this model; "
                       + describe_candidates(candidates))
    chosen = [t for t in candidates if t.name in names]
    routers = sorted({t.name for t in chosen if t.kind == "router"})
    if routers and not router:
        raise SFTError(f"--lora_target_modules {' '.join(names)}: {', '.join(routers)} is the experts' router; "
                       "it is adapted only with --lora_router True")
    return chosen


def describe_candidates(candidates: list[Target]) -> str:
    """``linear modules of this model: ...; expert parameters: ...; routers: ...`` (names by kind)."""
    linear = sorted({t.name for t in candidates if not t.parameter and t.kind != "router"})
    text = f"linear modules of this model: {', '.join(linear) or 'none'}"
    experts = sorted({t.name for t in candidates if t.kind == "experts"})
    routers = sorted({t.name for t in candidates if t.kind == "router"})
    if experts:
        text += f"; expert parameters: {', '.join(experts)}"
    if routers:
        text += f"; routers (with --lora_router True): {', '.join(routers)}"
    return text


def peft_targets(model: torch.nn.Module, chosen: list[Target]) -> tuple[object, Optional[list[str]]]:
    """peft's ``(target_modules, target_parameters)`` for ``chosen``: short names (``q_proj``,
    ``experts.gate_up_proj``) where peft's suffix match finds exactly the chosen set, else an anchored regex of the
    module paths / the full parameter paths."""
    mods = sorted(t.path for t in chosen if not t.parameter)
    params = sorted(t.path for t in chosen if t.parameter)
    module_paths = [n for n, _ in model.named_modules() if n]
    short = sorted({p.rpartition(".")[2] for p in mods})
    hit = {n for n in module_paths if any(n == s or n.endswith("." + s) for s in short)}
    target_modules = short if hit == set(mods) else "^(" + "|".join(re.escape(p) for p in mods) + ")$"
    param_paths = [f"{n}.{p}" for n, m in model.named_modules() for p in expert_parameter_names(m)] + [
        n for n, p in model.named_parameters() if len(getattr(p, "ds_shape", p.shape)) == 2]
    short_p = sorted({".".join(p.split(".")[-2:]) for p in params})
    hit_p = {n for n in param_paths if any(n.endswith("." + s) for s in short_p)}
    parametrized = any(hasattr(model.get_submodule(p.rpartition(".")[0]), "parametrizations") for p in params)
    # peft matches a parametrized (4-bit) module's parameter by its full path only
    target_parameters = short_p if hit_p == set(params) and not parametrized else params
    return (target_modules if mods else None), (target_parameters or None)


def count_by_kind(model: torch.nn.Module, chosen: list[Target]) -> dict[str, int]:
    """Trainable LoRA numbers per kind after peft wrapped ``model`` (``lora_A`` and ``lora_B`` of each target; an
    expert tensor's is exactly r·E·(in + out))."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    kind_of = {t.path: t.kind for t in chosen}
    counts = {k: 0 for k in KINDS}
    for path, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        plain = re.sub(r"(^|\.)base_model\.model\.", r"\1", path)
        plain = plain.replace(".base_layer", "")
        if isinstance(m, ParamWrapper):
            plain = f"{plain}.{m.parameter_name}"
        kind = kind_of.get(plain)
        if kind is None:
            continue
        for d in (m.lora_A, m.lora_B):
            counts[kind] += sum(p.numel() for mod in d.values() for p in mod.parameters() if p.requires_grad)
    return counts


def summary(chosen: list[Target], counts: dict[str, int], router_candidates: list[str]) -> str:
    """``attention q_proj,k_proj 1,024 · experts gate_up_proj,down_proj 8,192 · router frozen (gate)``."""
    parts = []
    for kind in KINDS:
        names = sorted({t.name for t in chosen if t.kind == kind})
        if names:
            parts.append(f"{kind} {','.join(names)} {counts.get(kind, 0):,}")
        elif kind == "router" and router_candidates:
            parts.append(f"router frozen ({','.join(sorted(set(router_candidates)))})")
    return " · ".join(parts) or "nothing"


def quantize_experts(model: torch.nn.Module) -> int:
    """Store every experts module's 3-D parameters in 4-bit NF4 (bitsandbytes' ``replace_parameter_4bit``: packed
    uint8 with a per-64-value absmax, dequantized to their dtype on access), for Q-LoRA: bitsandbytes' loading
    replaces ``nn.Linear`` only, and routed experts are most of a mixture-of-experts model. Call it before peft's
    k-bit preparation (which would cast 16-bit experts to fp32). Returns the number of values now stored 4-bit."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    done = 0
    for _, m, _ in experts_modules(model):
        for name in [n for n, p in m.named_parameters(recurse=False) if p.ndim == 3]:
            done += getattr(m, name).numel()
            replace_parameter_4bit(m, name, quant_type="nf4")
    return done


def four_bit_values(model: torch.nn.Module) -> tuple[int, int]:
    """``(values stored 4-bit, all values)`` of ``model``: bitsandbytes' 4-bit linear weights and 4-bit expert
    parameters at the shape they stand for, against every parameter so counted."""
    from torch.nn.utils.parametrize import ParametrizationList

    four = total = 0
    for m in model.modules():
        if isinstance(m, ParametrizationList):
            continue  # its packed ``original`` is counted at the shape it stands for, below
        for n, p in m.named_parameters(recurse=False):
            qs = getattr(p, "quant_state", None)
            size = int(torch.Size(qs.shape).numel()) if qs is not None else p.numel()
            four += size if qs is not None else 0
            total += size
        for n in (getattr(m, "parametrizations", None) or {}):
            shape = expert_shape(m, n)
            if getattr(m.parametrizations[n], "original", None) is not None and shape.numel():
                packed = m.parametrizations[n].original
                four += shape.numel() if packed.dtype == torch.uint8 else 0
                total += shape.numel()
    return four, total
