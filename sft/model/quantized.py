"""Pre-quantized base models: what a model folder's ``config.json`` says about its weights, and the decision
taken before anything loads (the standard library only, and huggingface_hub's cache lookup for a hub id).

A pre-quantized base (GPTQ, AWQ, bitsandbytes-serialized, compressed-tensors, FP8, ...) is never quantized
again: transformers refuses a second quantization config, and re-quantizing packed integers would be
meaningless. What is supported for training:

- **GPTQ** (``quant_method: gptq``, e.g. Qwen-7B-Chat-Int4): LoRA on the frozen quantized weights through
  transformers' own integration (optimum + gptqmodel; gptqmodel's torch kernel also runs on CPU), with
  ``--use_lora True --q_lora True`` (the Q-LoRA presets). Refused when optimum or gptqmodel is missing.
- **bitsandbytes 4-bit** (``quant_method: bitsandbytes``, ``load_in_4bit``, written by ``save_pretrained`` of
  a Q-LoRA base): loaded as saved (NF4/FP4 stays as it is) with ``--use_lora True --q_lora True``.

Everything else is refused with the reason and the way on (the 16-bit base with ``--q_lora True``).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Optional

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name of a Hugging Face hub model
# The 16-bit base is the way on for every refused format: --q_lora quantizes it to NF4 with bitsandbytes.
SIXTEEN_BIT_WAY = ("the 16-bit (bf16/fp16/fp32) model it was quantized from, with --q_lora True (bitsandbytes "
                   "4-bit NF4 quantization of that base, on CPU or GPU)")
# Module names by which optimum/gptqmodel are imported; pip names are the same.
GPTQ_PACKAGES = ("optimum", "gptqmodel")


@dataclass(frozen=True)
class Quantization:
    """A model folder's quantization, as written in its ``config.json`` (``quantization_config``) or in the
    AutoGPTQ-era ``quantize_config.json``.

    Attributes:
        method: ``quant_method`` in lower case (``gptq``, ``awq``, ``bitsandbytes``, ``compressed-tensors``,
            ``fp8``, ...); ``unknown`` when the block has none.
        bits: weight bits when the config states them (``bits``, or 4/8 from bitsandbytes' ``load_in_*``).
        source: the file it was read from (for messages).
    """

    method: str
    bits: Optional[int]
    source: str

    @property
    def label(self) -> str:
        """E.g. ``GPTQ 4-bit``, ``bitsandbytes 8-bit``, ``compressed-tensors``."""
        name = {"gptq": "GPTQ", "awq": "AWQ", "fp8": "FP8"}.get(self.method, self.method)
        return f"{name} {self.bits}-bit" if self.bits else name

    @property
    def bnb_4bit(self) -> bool:
        return self.method == "bitsandbytes" and self.bits == 4

    @property
    def trainable_here(self) -> bool:
        """LoRA on this base is supported by sft (GPTQ, bitsandbytes 4-bit)."""
        return self.method == "gptq" or self.bnb_4bit


def model_folder(name: Optional[str]) -> Optional[str]:
    """The local folder of a ``--model_name_or_path`` value: the folder itself, or a cached hub model's snapshot
    (None when neither exists)."""
    if not name:
        return None
    if os.path.isdir(name):
        return name
    if HUB_ID.match(name):
        from huggingface_hub import try_to_load_from_cache

        cfg = try_to_load_from_cache(name, "config.json")
        return os.path.dirname(cfg) if isinstance(cfg, str) else None
    return None


def read_quantization(model_dir: str) -> Optional[Quantization]:
    """The quantization of the model folder ``model_dir``; None for an unquantized model, or when
    ``config.json`` is missing or not valid JSON (the loader reports those with their own fix)."""
    cfg_path = os.path.join(model_dir, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    source = cfg_path
    if not isinstance(q, dict):
        legacy = os.path.join(model_dir, "quantize_config.json")  # AutoGPTQ's file, beside a plain config.json
        try:
            with open(legacy, encoding="utf-8") as f:
                q = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(q, dict):
            return None
        q, source = {"quant_method": "gptq", **q}, legacy
    method = str(q.get("quant_method") or "unknown").lower()
    bits = q.get("bits") if isinstance(q.get("bits"), int) else None
    if method == "bitsandbytes":
        bits = 4 if q.get("load_in_4bit") or q.get("_load_in_4bit") else 8 if (
            q.get("load_in_8bit") or q.get("_load_in_8bit")) else None
    return Quantization(method=method, bits=bits, source=source)


def tensor_names(model_dir: str) -> Optional[set[str]]:
    """Names of the tensors in the folder's safetensors weights, from ``model.safetensors.index.json`` or the
    JSON header of ``model.safetensors`` (8-byte little-endian length, then JSON; nothing else is read).
    None when the folder has neither (e.g. ``pytorch_model.bin``) or they cannot be read."""
    import struct

    try:
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                return set(json.load(f)["weight_map"])
        with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:  # no real header is that large: not a safetensors file
                return None
            return set(json.loads(f.read(size))) - {"__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def importable(*modules: str) -> bool:
    """True when at least one of the top-level modules named (``"bitsandbytes"``; ``"tensorboard", "tensorboardX"``)
    is installed: found by ``importlib.util.find_spec``, without importing it."""
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in modules)


def training_problems(flag: str, q: Quantization, *, use_lora: bool, q_lora: bool) -> list[str]:
    """The problems of training on the pre-quantized base ``q`` (given as ``--model_name_or_path flag``), one
    line each with the reason and the way on; empty when the run can go ahead. (Q-LoRA with ZeRO-3 is refused
    for every quantized base by the Q-LoRA rule of :mod:`sft.app.validation`.)"""
    head = f"--model_name_or_path {flag}: a pre-quantized {q.label} model ({os.path.basename(q.source)})"
    if not q.trainable_here:
        why = {"awq": "LoRA on AWQ weights needs gptqmodel's AWQ kernels, which sft has not been able to test "
                      "(gptqmodel quantizes AWQ only on CUDA, so no AWQ test model can be made on CPU)",
               "bitsandbytes": "sft's Q-LoRA trains on 4-bit bitsandbytes bases only"}.get(
            q.method, "sft trains LoRA only on GPTQ and bitsandbytes 4-bit pre-quantized bases")
        return [f"{head}: not supported for training: {why}; use {SIXTEEN_BIT_WAY}"]
    p = []
    if not use_lora:
        p.append(f"{head}: full fine-tuning cannot update quantized integer weights; train a LoRA adapter on it "
                 "with --use_lora True --q_lora True (finetune_qlora_ds.sh / finetune_qlora_single_gpu.sh), or "
                 f"fine-tune {SIXTEEN_BIT_WAY.split(', with')[0]} fully")
    elif not q_lora:
        p.append(f"{head}: LoRA on quantized weights is Q-LoRA; add --q_lora True (the base is loaded as saved, "
                 "not quantized again), or give the 16-bit model it was quantized from for plain LoRA")
    if q.method == "gptq":
        missing = [m for m in GPTQ_PACKAGES if not importable(m)]
        if missing:
            p.append(f"{head}: loading GPTQ weights needs {' and '.join(missing)}, not installed; pip install "
                     f"{' '.join(missing)}, or use {SIXTEEN_BIT_WAY}")
    names = tensor_names(os.path.dirname(q.source)) if q.method == "gptq" else None
    if names is not None and not any(n.endswith(".qweight") for n in names):
        # transformers would load it with every quantized tensor missing (a warning), and training would crash
        p.append(f"{head}, but its safetensors weights hold no quantized tensors (no *.qweight): 16-bit weights "
                 "beside a GPTQ config; remove quantization_config from config.json to use them as a 16-bit base "
                 "(with --q_lora True), or copy the quantizer's complete output into the folder")
    return p


def loading_fix(q: Optional[Quantization]) -> Optional[str]:
    """The fix to name when a pre-quantized folder fails to load (None: not pre-quantized, use the usual one)."""
    if q is None:
        return None
    if q.method in ("gptq", "awq"):
        return (f"the folder is a {q.label} model: loading it needs optimum and gptqmodel (pip install optimum "
                f"gptqmodel) and its quantized weights as the quantizer saved them; or use {SIXTEEN_BIT_WAY}")
    return (f"the folder is a pre-quantized {q.label} model; check that its quantizer's package is installed and "
            f"its weights are complete, or use {SIXTEEN_BIT_WAY}")


def merge_problem(base: str, q: Quantization, given_with_base: bool) -> str:
    """Why an adapter cannot be merged into the pre-quantized base folder ``base``, and the way on."""
    where = "given with --base" if given_with_base else "recorded in the adapter's adapter_config.json"
    return (f"{base} ({where}): is a pre-quantized {q.label} model; merging the adapter into its quantized "
            "weights would have to quantize the sum again (a different, lossy model) or cannot be done at all; "
            "pass --base with the 16-bit model it was quantized from (e.g. Qwen/Qwen-7B-Chat for "
            "Qwen-7B-Chat-Int4) to write a 16-bit merged model, or serve the adapter on top of the quantized base")
