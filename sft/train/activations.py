"""What autograd keeps for backward per token of a micro batch, for the memory plan (:mod:`sft.train.memory_plan`):
measured by a forward probe or counted from the model's shape, and the factors that turn it into a step's peak.

Activations per token. What autograd keeps for backward is measured where the model can run a forward pass on its
training device before the Trainer wraps it (:func:`measure_saved_bytes`: 256 tokens through the real modules, casts,
LoRA dropout and attention kernel; per token and per decoder layer). Elsewhere (DeepSpeed ZeRO-3, whose weights are
partitioned, or a forward that fails) it is counted from the model's shape (:func:`activation_bytes_per_token`), after
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4.1: the tensors each
layer saves for backward, per token), redone for transformers' Llama / Qwen2 / Mistral layers (RMSNorm in fp32, rotary
q and k, grouped KV heads, SwiGLU MLP, SDPA or flash kernels that keep no score matrix) and peft's LoRA (each adapted
layer's input cast to the adapter's dtype, a dropout mask and output when ``lora_dropout > 0``); on SmolLM2-135M in
fp32 the count is within 4% of the probe (1,360 vs 1,311 KiB per token; with LoRA r 16, dropout 0.05: 2,091 vs
2,033). Then:

* without checkpointing, that times :data:`BACKWARD_FACTOR` (:data:`BACKWARD_FACTOR_FROZEN` when the base is frozen,
  by the activations' dtype):
  a step's activations at their peak (the activations' gradients in backward, the allocator's slack) over what the
  probe sees kept;
* with checkpointing of every decoder layer, every layer's input (layers x hidden x the activation dtype's bytes)
  plus :data:`CHECKPOINTED_LAYERS` (:data:`CHECKPOINTED_LAYERS_FROZEN`; by the activations' dtype) layers' worth of
  what the probe sees one layer keep (theory says two: the layer recomputed and its backward; CPU allocators keep
  more), never more than without checkpointing.

The four factors and the head's bytes are measured (``bench/memory_plan.py``: one step per configuration in a
fresh process, its ``VmHWM`` against the plan; table in docs/benchmarks.md#memory-plan) on one CPU, SmolLM2-135M, fp32
and bf16; not yet on a GPU, whose caching allocator keeps other slack.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from sft.train.host_memory import trim_heap

logger = logging.getLogger("sft")

# Measured on a 2-core Intel Xeon with AMX, SmolLM2-135M-Instruct, fp32 and bf16 (weights and autocast), weights paged
# in and the heap trimmed before the step and after each one (docs/benchmarks.md#memory-plan): bench/memory_plan.py's
# worker (one padding-free step of 2,048 or 8,192 tokens in documents of 512, every token supervised, after AdamW's
# state exists) and sft-train runs of one conversation of 1,024 to 8,192 tokens (bench/long_context.py, step 2's
# peak). A step's activations = its VmHWM - the resident set after loading - gradients - AdamW's two moments - the
# LM head (HEAD_BYTES_PER_LOGIT, measured alone). Keyed by the activations' bytes per element (2: bf16/fp16, 4: fp32).
# Without checkpointing, those over what the probe sees autograd keep (the activations' gradients in backward, the
# allocator's slack): full fine-tuning 1.20 (fp32) and 1.36 (bf16) at 2k;
BACKWARD_FACTOR = 1.3
# with a frozen base (LoRA r 64, dropout 0.05) 1.56 (fp32) and 0.99 (bf16) at 2k.
BACKWARD_FACTOR_FROZEN = {2: 1.0, 4: 1.55}
# With gradient checkpointing every layer's input is kept (layers x hidden x activation bytes per token) and one layer
# at a time is recomputed and run backward: theory says 2 layers' worth of what the probe sees one layer keep. Full
# fine-tuning held the inputs plus 2.0-2.5 layers' worth in bf16 (worker at 8k and 2k; sft-train at 4k: 2.5 plans
# within 3%), and 2.7-4.3 (worker at 8k, documents of 512 and one of 8,192) to 6.1 (sft-train at 4k) in fp32;
CHECKPOINTED_LAYERS = {2: 2.5, 4: 6.0}
# with a frozen base 5.4 (sft-train, LoRA r 16 at 4k) and 7.0 (worker, r 64 and dropout at 8k) in bf16; in fp32 11
# (worker) and 18 (sft-train, whose "layer" is smaller: no dropout, r 16): about 840 KiB per token in both, so no
# one count of layers fits both; 13 plans them within 0.83-1.16. On CPU glibc keeps the freed pages of the
# recomputed layers in its heap within a step (with MALLOC_MMAP_THRESHOLD_=1048576, which returns them, the fp32
# worker step at 2,048 tokens held about 4.4 layers, and ran 1.3x slower). Not yet measured on a GPU, whose caching
# allocator keeps other slack.
CHECKPOINTED_LAYERS_FROZEN = {2: 7.0, 4: 13.0}
# Those counts are glibc's heap keeping the freed blocks of the recomputed layers; it serves a block of at least its
# mmap threshold (dynamic, at most 32 MiB on 64-bit: DEFAULT_MMAP_THRESHOLD_MAX) with mmap and unmaps it when freed.
# Once one layer's hidden-sized activation (tokens x hidden x activation bytes) is that large, most of the slack goes:
# LoRA r 64, dropout 0.05, fp32, checkpointing on, 17,901 tokens (41 MB blocks; bench/memory_plan.py, SmolLM2-135M's
# shape) held the inputs plus 2.0 layers' worth with 8 layers (VmHWM 3.69 GiB; 17.96 planned with 13) and 3.2 with 30
# (6.59 GiB; 20.3 planned with 13; the issue-52 sft-train run of that kind planned 20.13 and peaked at 5.7); 2.6 plans
# the three within 0.89-1.18. At 4,096 tokens (9.4 MB blocks) the 8 layers held 4.9 (13 plans 1.49x). bf16 at 17,901
# tokens (20.6 MB blocks, under the threshold) held 6-7 of 30 (9.11 GiB measured, 10.35 planned with 7).
CHECKPOINTED_LAYERS_MMAPPED = 2.6
MMAP_THRESHOLD_MAX = 32 * 2 ** 20


def checkpointed_layers(kept: float, tokens: int, hidden: int, act_bytes: int, device_type: str) -> float:
    """The layers' worth of one layer's saved bytes a checkpointed step holds besides every layer's input: ``kept``
    (the measured constants above), or :data:`CHECKPOINTED_LAYERS_MMAPPED` on CPU once ``tokens x hidden x
    act_bytes`` reaches :data:`MMAP_THRESHOLD_MAX` (glibc then unmaps each freed block)."""
    if device_type == "cpu" and int(tokens) * hidden * act_bytes >= MMAP_THRESHOLD_MAX:
        return min(kept, CHECKPOINTED_LAYERS_MMAPPED)
    return kept
# The LM head at supervised positions (sft.model.loss): bytes per logit of one chunk at the peak of its backward (the
# logits in the compute dtype, their fp32 upcast, the log-softmax and its gradient, less what is freed on the way):
# measured 12.2 (bf16 autocast) and 12.4-12.6 (fp32) with SmolLM2's 49,152-token vocabulary, 1,024 and 4,096 supervised
# positions (VmHWM over supervised_lm_loss forward + backward on random hidden states).
HEAD_BYTES_PER_LOGIT = 12.5
# Mamba2's PyTorch SSD (transformers' torch_forward: segment_sum over the chunks of the sequence it scans) builds
# tensors of heads x (chunks + 1)^2 fp32 per layer, quadratic in the length where the probe (256 tokens) sees almost
# nothing: one kept for backward (the exp of the segment sums, for the chunk-state einsum), a few more alive while it
# is computed and differentiated. Measured (tiny nemotron_h, one Mamba2 layer of 4 heads, chunk 8, fp32, padding-free
# rows of documents of 512 scanned as one sequence; VmHWM of one step less the plan without them): 7.3, 6.5 and 3.9
# such tensors at 4,096, 8,192 and 16,384 tokens (glibc keeps the smaller ones in its heap and returns those over its
# 32 MiB mmap threshold); 5 plans the three steps within 0.87-1.17.
SSD_CHUNK_TENSORS = 5


def chunk_buffer_bytes(mixers, tokens: int, checkpointing: bool) -> int:
    """Bytes of Mamba2's chunk buffers (:data:`SSD_CHUNK_TENSORS`) for ``tokens`` scanned as one sequence (an upper
    bound where a layer scans each document apart): without checkpointing one per layer kept for backward and the rest
    for the largest layer, with it those of the one layer recomputed. ``mixers``: :func:`sft.train.counting.census`'s
    ``(path, kind, heads, chunk)``; gated delta rule and KDA layers keep chunk states linear in the length, which the
    probe measures. 0 without Mamba2 layers."""
    sizes = [h * (-(-int(tokens) // q) + 1) ** 2 * 4 for _, kind, h, q in mixers if kind == "mamba2_ssd" and q]
    if not sizes:
        return 0
    return (0 if checkpointing else sum(sizes)) + (SSD_CHUNK_TENSORS - 1) * max(sizes)


def _dim(config, *names, default=0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def activation_bytes_per_token(config, act_bytes: int, checkpointing: bool, lora_in_bytes: int = 0,
                               lora_dropout: bool = False) -> int:
    """Bytes one token's activations keep for backward in one micro batch (all decoder layers).

    Args:
        config: the model's ``PretrainedConfig`` (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``; a missing size falls back to the
            Llama relations).
        act_bytes: bytes per element of the activations (2 for bf16/fp16, 4 for fp32).
        checkpointing: gradient (activation) checkpointing of every decoder layer.
        lora_in_bytes: bytes per element of the LoRA adapters' input (their dtype; 0 without LoRA).
        lora_dropout: LoRA with ``lora_dropout > 0`` (a dropout output and a 1-byte mask per adapted input).
    Returns:
        int bytes per token (see the module docstring for the count).
    """
    h = _dim(config, "hidden_size", "n_embd", default=1)
    i = _dim(config, "intermediate_size", "ffn_dim", default=4 * h)
    layers = _dim(config, "num_hidden_layers", "n_layer", default=1)
    heads = _dim(config, "num_attention_heads", "n_head", default=1)
    kv_heads = _dim(config, "num_key_value_heads", default=heads)
    d = _dim(config, "head_dim", default=max(1, h // heads))
    p = int(act_bytes)
    q, kv = heads * d, kv_heads * d
    norm = 4 * h + (4 * h if p < 4 else 0) + p * h  # fp32 input copy, fp32 normalised output, the cast back
    attention = p * (2 * (q + 2 * kv) + 2 * q) + 4 * heads  # q/k/v before and after rotary, output and its copy, lse
    mlp = 4 * p * i  # gate, act(gate), up, act(gate) * up
    layer = 2 * norm + attention + mlp
    if lora_in_bytes:  # q, k, v, gate, up read the normed hidden state; o reads q-sized, down reads i-sized inputs
        inputs = 5 * h + q + i
        layer += ((lora_in_bytes if lora_in_bytes != p else 0) * inputs
                  + ((lora_in_bytes + 1) * inputs if lora_dropout else 0))
    final = norm + p * h
    if checkpointing:
        return layers * p * h + layer + final
    return layers * layer + final + p * h



PROBE_TOKENS = 256


def measure_saved_bytes(model, tokens: int = PROBE_TOKENS) -> Optional[tuple[float, float]]:
    """``(bytes per token, bytes per token of one decoder layer)`` that autograd keeps for backward in ``model``'s
    decoder, measured by one forward pass in training mode over ``tokens`` random token ids (one document, position
    ids 0..tokens-1; no LM head, no backward) under ``torch.autograd.graph.saved_tensors_hooks``: the distinct storages
    saved, parameters and buffers left out. Every module, dtype cast, LoRA dropout and attention kernel of the real
    step is in it. None where it cannot run: no decoder module (``base_model_prefix``), weights not on one device or
    partitioned (DeepSpeed ZeRO-3), gradient checkpointing already on, or the forward fails. The RNG is left as it was.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, getattr(base, "base_model_prefix", "") or "model", None)
    params = list(model.parameters())
    checkpointing = getattr(base, "is_activation_checkpointing", None)  # transformers 5 (was is_gradient_checkpointing)
    if (not isinstance(decoder, torch.nn.Module) or not params or checkpointing
            or any(hasattr(p, "ds_numel") for p in params) or len({p.device for p in params}) != 1):
        return None
    device = params[0].device
    layers = _dim(getattr(model, "config", None), "num_hidden_layers", "n_layer", default=1)
    owned = {t.untyped_storage().data_ptr() for t in (*params, *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t):
        try:
            storage = t.untyped_storage()
            if storage.data_ptr() not in owned and t.device.type != "meta":
                saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
            pass
        return t

    vocab = max(2, min(_dim(model.config, "vocab_size", default=2), 1000))
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            ids = torch.randint(0, vocab, (1, tokens), device=device)
            positions = torch.arange(tokens, device=device).unsqueeze(0)
            model.train()
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = decoder(input_ids=ids, position_ids=positions, use_cache=False)
            del out
    except Exception as e:  # noqa: BLE001  (a model this probe does not fit: the formula plans instead)
        logger.debug("memory plan: the forward probe failed (%s); planning from the model's shape", e)
        return None
    finally:
        model.train(was_training)
        if device.type == "cpu":
            trim_heap()  # the saved tensors are freed; without this glibc keeps their pages resident into training
    total = sum(saved.values()) / tokens
    return total, total / max(1, layers)

def probe_logged(model) -> Optional[tuple[float, float]]:
    """:func:`measure_saved_bytes` of ``model``, logged (per token, in KiB); None where the probe fails."""
    measured = measure_saved_bytes(model)
    if measured is not None:
        logger.info("memory plan: autograd keeps %.0f KiB per token for backward (measured over %d tokens)",
                    measured[0] / 2 ** 10, PROBE_TOKENS)
    return measured
