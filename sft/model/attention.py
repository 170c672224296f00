"""Per-document causal attention for packed rows, with no ``[seq, seq]`` mask (``--packing True``).

A packed row holds several conversations back to back; ``position_ids`` restart at 0 at the first token of each
(:mod:`sft.data.batches.packing`). transformers 5.24 keeps them apart for ``sdpa`` by building a block-diagonal boolean
mask from the position ids (``masking_utils.find_packed_sequence_indices``): SDPA then computes every ``row_len x
row_len`` score and cannot use its ``is_causal`` kernels. The implementation registered here under
:data:`PACKED_ATTENTION` (``transformers.AttentionInterface``, so every architecture whose attention goes through the
interface uses it: Llama/SmolLM2, Qwen2, Mistral, ...) instead cuts each row at the position-id resets and runs

* on CUDA with fp16/bf16 tensors, one attention call per layer over every document of the micro batch
  (:func:`varlen_kernel` chooses): ``flash_attn.flash_attn_varlen_func`` when the ``flash-attn`` package is
  installed, otherwise torch's own ``torch.nn.attention.varlen.varlen_attn`` where this torch has it (causal as
  ``is_causal=True`` or ``window_size=(-1, 0)``, GQA natively where it takes ``enable_gqa``; its signature is read,
  not assumed);
* otherwise (CPU, fp32, dropout with torch's varlen, or neither kernel):
  ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True`` once per document, with no mask; on
  CUDA pinned to the flash and memory-efficient SDPA backends (``torch.nn.attention.sdpa_kernel``), never cuDNN's,
  which plans anew for every new document length (~2.5 ms of host time per call on an H200: docs/benchmarks.md).


Document boundaries come from the batch when the collator gives them (``cu_seq_lens_q`` and ``max_length_q``, the
keyword arguments of ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` that transformers
passes down to every attention call: :class:`sft.data.batches.packing.PaddingFreeCollator`, \
:class:`sft.data.batches.packing.PackedCollator`),
so a layer on the GPU does not copy position ids to the host; otherwise from the position ids, as before; and where
a hybrid's decoder layer hands its attention neither (Granite-4.0 hybrid, Zamba), from its decoder's forward
(:func:`sft.model.token_mixers.current_documents`).

The matching mask function (``transformers.masking_utils.AttentionMaskInterface``) returns no mask when the model
gets no ``attention_mask`` (the packed collator never gives one); with a 2-D padding mask (a padded batch, or
generation) it builds SDPA's usual mask and the attention function runs plain SDPA with it, so padded batches stay
correct under the same implementation.

Never a leak: a packed row must come with no ``attention_mask`` (an all-ones mask would turn the documents into one
sequence; :class:`sft.data.batches.packing.PackedCollator` gives none) and the KV cache is off
(:func:`use_packed_attention`;
with a cache the result is still per document, since the split reads the position ids, but the cache is useless).
What the attention function refuses (``ValueError``): a soft cap, a position bias, or a sliding window shorter
than one of the documents (those need a mask; such models keep transformers' own packed mask instead, see
:func:`use_packed_attention`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
from typing import Optional

import torch

from sft.compat.transformers import attn_implementation
from sft.data.batches.packing import cu_seqlens_bounds, document_bounds, flat_offsets  # noqa: F401  (the packed batch's format)
from sft.errors import ConfigError
from sft.model.token_mixers import current_documents

logger = logging.getLogger(__name__)

# implementations that keep packed rows apart
PACKING_ATTENTION = ("sdpa", "flash_attention_2", "eager", "flex_attention")
PACKED_ATTENTION = "sft_packed_sdpa"  # "sdpa" in the name: transformers checks that the model supports SDPA


@functools.lru_cache(maxsize=None)  # asked in every layer's call: the answer is fixed for the process
def flash_varlen_available() -> bool:
    """True when the ``flash-attn`` package (2.x, ``flash_attn_varlen_func``) is installed."""
    return importlib.util.find_spec("flash_attn") is not None


@functools.lru_cache(maxsize=None)
def torch_varlen_function():
    """torch's ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10 and later, CUDA flash kernels), or None where this
    torch has no such module or function."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


@functools.lru_cache(maxsize=None)  # read once per function, not in every layer's call
def varlen_call_options(fn) -> Optional[dict]:
    """The keyword arguments that make ``fn`` (a ``varlen_attn``) causal and GQA-aware, from its signature:
    ``{"is_causal": True}`` or ``{"window_size": (-1, 0)}`` (torch 2.13 names causal attention by its window: no
    key to the right of the query), plus ``{"enable_gqa": True}`` where it takes that argument (without it, key and
    value heads are repeated to the query heads first). None when ``fn`` takes neither causal form."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "is_causal" in params:
        opts = {"is_causal": True}
    elif "window_size" in params:
        opts = {"window_size": (-1, 0)}
    else:
        return None
    if "enable_gqa" in params:
        opts["enable_gqa"] = True
    return opts


def varlen_kernel(device_type: str, dtype: torch.dtype, dropout: float = 0.0) -> str:
    """Which path :func:`packed_attention_forward` takes for query tensors on ``device_type`` ("cuda", "cpu", ...)
    in ``dtype``: ``"flash_attn"`` (the flash-attn package), ``"torch_varlen"`` (torch's ``varlen_attn``, which has
    no dropout: only with ``dropout == 0``) or ``"sdpa_loop"`` (SDPA once per document)."""
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa_loop"
    if flash_varlen_available():
        return "flash_attn"
    fn = torch_varlen_function()
    if fn is not None and not dropout and varlen_call_options(fn) is not None:
        return "torch_varlen"
    return "sdpa_loop"


# The boundaries of the micro batch in flight: every layer of a forward gets the same ``cu_seq_lens_q`` tensor, so its
# host copy (one device-to-host copy when it lives on the GPU) is made once per micro batch, not once per layer.
_BOUNDS_CACHE: list = [None, None]  # [the cu_seq_lens tensor, its bounds]


def bounds_from_cu_seqlens(cu: torch.Tensor, batch_size: int, row_len: int) -> list[list[tuple[int, int]]]:
    """The documents ``[[(start, end), ...] per row]`` of the collator's ``cu_seq_lens_q`` (1-D int tensor) over
    ``batch_size`` rows of ``row_len`` tokens (:func:`sft.data.batches.packing.cu_seqlens_bounds`), read once per
    tensor (the
    layers of one forward share it). Raises ValueError when the offsets do not cut the rows into whole documents."""
    if _BOUNDS_CACHE[0] is cu:
        return _BOUNDS_CACHE[1]
    try:
        bounds = cu_seqlens_bounds([int(x) for x in cu.tolist()], batch_size, row_len)
    except ValueError as e:
        raise ValueError(f"attention '{PACKED_ATTENTION}': {e}") from None
    _BOUNDS_CACHE[0], _BOUNDS_CACHE[1] = cu, bounds
    return bounds


def _cu_seqlens(kwargs: dict, bounds, row_len: int, device) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32, on ``device``) and the longest document: the collator's when given, else built from
    ``bounds``."""
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is not None and longest is not None:
        return cu.to(device=device, dtype=torch.int32), int(longest)
    cu = torch.tensor(flat_offsets(bounds, row_len), dtype=torch.int32, device=device)
    return cu, max(e - s for docs in bounds for s, e in docs)


def _flash_varlen(query, key, value, cu, longest: int, dropout: float, scaling):
    """flash-attn varlen over every document of the micro batch. Tensors ``[B, heads, L, head_dim]`` (key/value
    may have fewer heads: GQA); returns ``[B, L, heads, head_dim]``. Needs CUDA and fp16/bf16."""
    from flash_attn import flash_attn_varlen_func

    b, h, n, _ = query.shape
    flat = [t.transpose(1, 2).reshape(b * n, t.shape[1], t.shape[3]) for t in (query, key, value)]
    out = flash_attn_varlen_func(*flat, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scaling, causal=True)
    return out.reshape(b, n, h, -1)


def _torch_varlen(fn, module, query, key, value, cu, longest: int, scaling):
    """torch's ``varlen_attn`` (``fn``) over every document of the micro batch, causal: the same shapes as
    :func:`_flash_varlen`. Key and value heads are repeated to the query heads when ``fn`` has no ``enable_gqa``."""
    from transformers.integrations.sdpa_attention import repeat_kv

    opts = varlen_call_options(fn)
    if opts is None:
        raise ValueError(f"attention '{PACKED_ATTENTION}': {fn} takes neither is_causal nor window_size")
    if not opts.get("enable_gqa"):
        n_rep = getattr(module, "num_key_value_groups", 1)
        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    b, h, n, _ = query.shape
    flat = [t.transpose(1, 2).reshape(b * n, t.shape[1], t.shape[3]) for t in (query, key, value)]
    out = fn(*flat, cu, cu, longest, longest, scale=scaling, **opts)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(b, n, h, -1)


def _sdpa_backends(device_type: str):
    """On CUDA: a context that lets SDPA use only its flash and memory-efficient kernels (cuDNN's plans per shape
    cost milliseconds of host time each); elsewhere nothing."""
    if device_type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def packed_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """Attention function (the ``transformers.AttentionInterface`` signature) that keeps packed documents apart.

    Args:
        module: the attention module (``num_key_value_groups`` for GQA, ``is_causal``).
        query: ``[batch, heads, q_len, head_dim]``; key, value: ``[batch, kv_heads, kv_len, head_dim]``.
        attention_mask: ``None`` for packed rows; a mask from the mask function otherwise (then plain SDPA).
        kwargs: ``position_ids`` ``[batch or 1, q_len]`` (the decoder layers pass them); ``cu_seq_lens_q`` (int32
            ``[documents + 1]``, offsets into the flattened ``batch * q_len`` tokens) and ``max_length_q`` (int) when
            the collator gives them (then position ids are not read); ``sliding_window``, ...
    Returns:
        ``(attn_output [batch, q_len, heads, head_dim], None)``.
    Raises:
        ValueError: a soft cap or position bias is requested, a sliding window shorter than a document, no
            ``position_ids`` and no ``cu_seq_lens_q`` reach the function while there is no mask (samples could not
            be told apart), or ``cu_seq_lens_q`` does not cut the rows into whole documents.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    no_bounds = position_ids is None and kwargs.get("cu_seq_lens_q") is None
    known = current_documents(module, query.shape[0], q_len) if no_bounds else None  # read once per forward
    no_bounds = no_bounds and known is None
    if no_bounds and attention_mask is None and q_len > 1 and q_len == key.shape[2] and causal:
        raise ValueError(f"attention '{PACKED_ATTENTION}': the model passes no position_ids to its attention "
                         f"({type(module).__name__}), so packed samples cannot be told apart; load it with "
                         "attn_implementation='sdpa' and pad each micro batch (--packing False --padding_free False)")
    if attention_mask is not None or q_len == 1 or q_len != key.shape[2] or not causal:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"attention '{PACKED_ATTENTION}' cannot apply a soft cap or position bias; load the model "
                         "with attn_implementation='sdpa' (packed rows then get transformers' block-diagonal mask)")
    batch_size, row_len = query.shape[0], query.shape[2]
    cu = kwargs.get("cu_seq_lens_q")
    kernel = varlen_kernel(query.device.type, query.dtype, dropout)
    window = kwargs.get("sliding_window")
    if kernel != "sdpa_loop" and cu is not None and kwargs.get("max_length_q") is not None and window is None:
        bounds = None  # the kernel reads the collator's boundaries on the device: no host copy at all
    elif cu is not None:
        bounds = bounds_from_cu_seqlens(cu, batch_size, row_len)
    else:
        bounds = known if known is not None else document_bounds(position_ids, batch_size)
    if window is not None and max(e - s for docs in bounds for s, e in docs) > window:
        raise ValueError(f"attention '{PACKED_ATTENTION}': a document is longer than the sliding window ({window} "
                         "tokens); load the model with attn_implementation='sdpa'")
    if kernel == "flash_attn":
        cu_t, longest = _cu_seqlens(kwargs, bounds, row_len, query.device)
        return _flash_varlen(query, key, value, cu_t, longest, dropout, scaling), None
    if kernel == "torch_varlen":
        cu_t, longest = _cu_seqlens(kwargs, bounds, row_len, query.device)
        return _torch_varlen(torch_varlen_function(), module, query, key, value, cu_t, longest, scaling), None
    n_rep = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    with _sdpa_backends(query.device.type):
        for r, docs in enumerate(bounds):
            parts = [sdpa(query[r:r + 1, :, s:e], key[r:r + 1, :, s:e], value[r:r + 1, :, s:e], dropout_p=dropout,
                          scale=scaling, is_causal=True) for s, e in docs]
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def packed_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, **kwargs):
    """Mask function for :data:`PACKED_ATTENTION`: ``None`` when there is no 2-D ``attention_mask`` and queries and
    keys are the same tokens (the attention function splits the documents by position ids); otherwise SDPA's mask
    (``transformers.masking_utils.sdpa_mask``, ``[batch, 1, q_len, kv_len]`` bool, or ``None`` when causal suffices)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if attention_mask is None and q_length == kv_length and int(q_offset) == 0 and int(kv_offset) == 0:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                     attention_mask, **kwargs)


def register() -> str:
    """Register :data:`PACKED_ATTENTION` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)
    return PACKED_ATTENTION


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def use_packed_attention(model) -> bool:
    """Switch ``model`` (a transformers model, or a peft model around one) to :data:`PACKED_ATTENTION` when it runs
    ``sdpa`` or ``flash_attention_2`` and has no soft cap and no sliding window in use; turn its KV cache off \
either way.

    Returns:
        True when switched; False when the model keeps its implementation (packed rows then get transformers'
        block-diagonal mask from the position ids, as before).
    """
    base = _base(model)
    config = base.config
    config.use_cache = False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    impl = attn_implementation(config)
    windowed = getattr(text, "use_sliding_window", False) or (
        getattr(text, "sliding_window", None) is not None and "use_sliding_window" not in text.to_dict())
    if (impl not in ("sdpa", "flash_attention_2") or windowed
            or getattr(text, "attn_logit_softcapping", None) is not None):
        return False
    register()
    try:
        base.set_attn_implementation(PACKED_ATTENTION)
    except (ValueError, ImportError) as e:  # the model does not go through the attention interface
        logger.info("packing: keeping attention '%s' (%s)", impl, str(e).splitlines()[0][:200])
        return False
    return attn_implementation(base.config) == PACKED_ATTENTION


def attention_implementation(model) -> str:
    """The attention implementation the model runs with ("sdpa", "eager", "flash_attention_2", ...).

    Through :func:`sft.compat.transformers.attn_implementation`.
    """
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    return str(attn_implementation(config) or "eager")


def check_packing_support(model) -> str:
    """Make sure packed conversations stay apart with this model; return the attention implementation in use.

    ``sdpa`` and ``flash_attention_2`` models are switched to :data:`sft.model.attention.PACKED_ATTENTION`
    (:func:`sft.model.attention.use_packed_attention`); the KV cache is turned off.

    Raises:
        ConfigError: the attention implementation does not separate packed sequences within a row.
    """
    impl = attention_implementation(model)
    if impl not in PACKING_ATTENTION:
        raise ConfigError([f"--packing True: the model uses attention implementation '{impl}', for which transformers "
                           f"cannot keep packed conversations apart (supported: {', '.join(PACKING_ATTENTION)}); "
                           "drop --packing (use --group_by_length True instead)"])
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    config.use_cache = False  # with a KV cache transformers does not look for packed sequences
    if impl in ("sdpa", "flash_attention_2"):
        use_packed_attention(model)
    return attention_implementation(model)
