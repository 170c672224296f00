"""Which transformers class a model folder loads as, and which of its parts text-only training leaves alone.

A checkpoint released as one multimodal model (Qwen3.5 and Qwen3.5-MoE: ``Qwen3_5ForConditionalGeneration`` with its
vision tower) is known by what its config holds, a text and a vision sub-config (``text_config``,
``vision_config``), not by its name. ``AutoModelForCausalLM`` would load only its language model ("VLM
compatibility" classes) and save a text-only model under another architecture; here such a folder loads as its own
architecture (``AutoModelForImageTextToText``), trains its language model, and keeps the vision tower as it was
(frozen; LoRA never targets it), so the saved folder has the original architecture and key names.
"""
from __future__ import annotations

import torch


def is_multimodal(config) -> bool:
    """True for a config holding both a text and a vision sub-config whose model type transformers builds as an
    image-text-to-text model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None
            and getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def auto_class(config):
    """``transformers.AutoModelForImageTextToText`` for a multimodal config (:func:`is_multimodal`), else
    ``transformers.AutoModelForCausalLM``. ``config``: a transformers config, or None (causal LM)."""
    import transformers

    if config is not None and is_multimodal(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def auto_class_of(path: str, **kwargs):
    """:func:`auto_class` of the folder (or hub id) ``path``; a config that cannot be read gives the causal-LM class
    (its loader then reports the problem). ``kwargs``: ``AutoConfig.from_pretrained``'s (``trust_remote_code``,
    ``cache_dir``)."""
    import transformers

    try:
        return auto_class(transformers.AutoConfig.from_pretrained(path, **kwargs))
    except Exception:  # noqa: BLE001 - the loader reports an unreadable config with its own fix
        return transformers.AutoModelForCausalLM


def non_text_modules(model) -> list[str]:
    """Qualified names (in ``model``, a transformers model or a peft model around one) of the modules outside the
    language model and its output head: a multimodal model's vision tower and merger; empty for a causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_multimodal(base.config):
        return []
    keep = [m for m in (base.get_decoder(), base.get_output_embeddings()) if m is not None]

    def walk(module, prefix: str) -> list[str]:
        names = []
        for name, child in module.named_children():
            if any(child is k for k in keep):
                continue
            full = f"{prefix}{name}"
            if any(k is m for m in child.modules() for k in keep):
                names += walk(child, full + ".")
            elif any(True for _ in child.parameters()):
                names.append(full)
        return names

    return walk(base, "")


def freeze_non_text(model) -> int:
    """Freeze (``requires_grad = False``) the parameters of :func:`non_text_modules`; returns how many parameters
    (elements) were frozen."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    frozen = 0
    for name in non_text_modules(base):
        for p in base.get_submodule(name).parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    return frozen


def inside_text(model, candidates: list) -> list:
    """``candidates`` (objects with a ``path``: a qualified module or parameter name in ``model``) less those inside
    :func:`non_text_modules` (a multimodal model's vision tower and merger); all of them for a causal LM."""
    outside = tuple(f"{p}." for p in non_text_modules(model))
    return [c for c in candidates if not c.path.startswith(outside)] if outside else list(candidates)


def linear_names_outside_text(model) -> list[str]:
    """Qualified names of the ``nn.Linear`` modules inside :func:`non_text_modules` (for peft's ``exclude_modules``:
    LoRA never targets the vision tower)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = []
    for prefix in non_text_modules(base):
        out += [f"{prefix}.{n}" for n, m in base.get_submodule(prefix).named_modules()
                if isinstance(m, torch.nn.Linear) and n]
    return out
