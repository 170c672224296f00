"""How a base model loads (:class:`LoadSpec`) and which LoRA adapter it gets (:class:`LoraSpec`): frozen values
:func:`sft.model.loading.load_model` and :func:`sft.model.loading.apply_lora` read; the app builds them once from the
parsed flags (:mod:`sft.app.specs`), the model wing never reads the flags itself.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """How :func:`sft.model.loading.load_model` loads a base model. The defaults are those of the flags, so that a
    test or a benchmark names only what it changes: ``LoadSpec(dtype=torch.bfloat16)``.

    Attributes:
        dtype: the training dtype of the weights (:func:`sft.model.loading.torch_dtype` of ``--bf16`` / ``--fp16``;
            default float32).
        trust_remote_code: run model code shipped in the folder (``--trust_remote_code``; default False).
        cache_dir: transformers' ``cache_dir`` for ``from_pretrained`` (``--cache_dir``; default None).
        quantize_4bit: Q-LoRA's 4-bit base (``--q_lora``; default False): NF4 through bitsandbytes, or a
            pre-quantized folder as saved.
        activation_checkpointing: checkpointing on (peft's k-bit preparation enables it; default False).
        activation_checkpointing_kwargs: its kwargs (e.g. ``{"use_reentrant": False}``; default None).
        load_on_device: on a CUDA device, load straight onto it (default False: not under DeepSpeed or FSDP, which
            place the model themselves).
    """

    dtype: torch.dtype = torch.float32
    trust_remote_code: bool = False
    cache_dir: Optional[str] = None
    quantize_4bit: bool = False
    activation_checkpointing: bool = False
    activation_checkpointing_kwargs: Optional[dict] = None
    load_on_device: bool = False


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapter :func:`sft.model.loading.apply_lora` adds; the defaults are those of the flags.

    Attributes:
        r: the rank (``--lora_r``; default 64).
        alpha: the update is scaled by ``alpha / r`` (``--lora_alpha``; default 16).
        dropout: dropout on the adapter's input, in [0, 1) (``--lora_dropout``; default 0.05).
        target_modules: names to adapt (``--lora_target_modules``: linear modules, expert parameters such as
            ``gate_up_proj``); None (default): attention, routed experts, shared experts and dense MLPs
            (:mod:`sft.model.experts`; lm_head excluded).
        router: adapt the experts' routers too (``--lora_router``; default False).
        bias: which biases train: ``"none"`` (default), ``"all"`` or ``"lora_only"`` (``--lora_bias``).
        train_embeddings: ``"auto"`` (default: only when the chat template's tokens are new to the model),
            ``"true"`` or ``"false"`` (``--train_embeddings``): also train the input embeddings and lm_head.
    """

    r: int = 64
    alpha: int = 16
    dropout: float = 0.05
    target_modules: Optional[tuple[str, ...]] = None
    router: bool = False
    bias: str = "none"
    train_embeddings: str = "auto"
