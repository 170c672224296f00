"""Sequence packing (``--packing True``): several conversations per row, with no cross-contamination.

How it works (transformers 5.24):

1. :func:`pack_dataset` groups the tokenized conversations into rows of at most ``model_max_length``
   tokens with best-fit decreasing (the strategy of TRL's ``packing_strategy="bfd"``). A row stores
   the conversations back to back in ``input_ids`` / ``labels`` and a ``position_ids`` column that
   restarts at 0 at the first token of every conversation. No conversation is split across rows.
2. :class:`PackedCollator` cuts each row of a micro batch back into its conversations (at
   ``position_ids == 0``) and hands them to ``transformers.DataCollatorWithFlattening``, which
   concatenates the whole micro batch into one ``[1, total_tokens]`` row with no padding, position ids
   restarting per conversation, the first label of every conversation set to -100 (so the last token of
   one conversation is never trained to predict the first token of the next) and no ``attention_mask``.
3. The model sees ``position_ids`` and ``attention_mask=None``. For ``sdpa`` and ``eager`` attention,
   ``transformers.masking_utils.create_causal_mask`` then detects the packed format from the position
   ids (``find_packed_sequence_indices``: a new conversation starts wherever the position id does not go
   up by one) and builds a block-diagonal causal mask, so a token attends only to earlier tokens of its
   own conversation. ``flash_attention_2``/``3`` derive ``cu_seqlens`` from the same position ids
   (``modeling_flash_attention_utils._is_packed_sequence``, batch size 1), and RoPE uses the restarted
   position ids, so positions match the unpacked run exactly.

The attention implementation in use is the model's default: ``sdpa`` (PyTorch
``scaled_dot_product_attention``) on CPU and GPU. With the packed mask SDPA receives an explicit boolean
mask, so on CUDA it runs the memory-efficient kernel rather than the flash kernel; the FLOPs of masked
blocks are still spent (cost per row ~ row length squared). ``flash_attention_2`` skips them but needs the
``flash-attn`` package. Conditions for the detection, checked by :func:`check_packing_support`: the
attention implementation is one of :data:`PACKING_ATTENTION`, and ``use_cache`` is off (with a KV cache
transformers does not look for packed sequences; :func:`sft.modeling.load_model` turns it off).
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

from .chat import IGNORE_INDEX
from .errors import ConfigError

logger = logging.getLogger(__name__)

# Attention implementations for which transformers 5.24 keeps packed conversations apart using position ids.
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of total length <= ``capacity`` (best-fit decreasing).

    Items are taken longest first; each goes into the open bin with the least room that still fits it,
    or opens a new bin. Deterministic (ties broken by index). O(n log n) plus list insertions.

    Args:
        lengths: length of each item in tokens, each in ``[1, capacity]``.
        capacity: the row budget in tokens.
    Returns:
        A list of bins, each a list of item indices in the order they were placed.
    Raises:
        ValueError: an item is empty or longer than ``capacity``.
    """
    bad = [i for i, n in enumerate(lengths) if not 0 < n <= capacity]
    if bad:
        raise ValueError(f"item {bad[0]} has length {lengths[bad[0]]}, outside [1, {capacity}]")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, bin index)
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(room, (n, -1))  # the smallest free space >= n
        if k == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - n, len(bins) - 1))
        else:
            free, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (free - n, b))
    return bins


@dataclass
class PackingReport:
    conversations: int
    rows: int
    tokens: int
    capacity: int

    @property
    def fill(self) -> float:
        """Real tokens / (rows x capacity): how full the rows are."""
        return self.tokens / max(1, self.rows * self.capacity)

    def line(self, name: str) -> str:
        return (f"{name}: packed {self.conversations} conversations into {self.rows} rows of at most {self.capacity} "
                f"tokens ({self.tokens} tokens, rows {100 * self.fill:.1f}% full; position ids restart per "
                f"conversation, attention stays inside each conversation)")


def pack_dataset(ds, max_len: int):
    """Pack a tokenized dataset (columns ``input_ids``, ``labels``) into rows of at most ``max_len`` tokens.

    Args:
        ds: a ``datasets.Dataset`` or any sequence of dicts with ``input_ids`` and ``labels`` (int lists of equal
            length, each at most ``max_len``: truncation happened before).
        max_len: row budget in tokens (``--model_max_length``).
    Returns:
        ``(datasets.Dataset, PackingReport)``; the dataset has int-list columns ``input_ids``, ``labels`` and
        ``position_ids`` (equal lengths <= ``max_len``; position ids restart at 0 per conversation).
    """
    import datasets

    if isinstance(ds, datasets.Dataset):
        ids_col, labels_col = ds["input_ids"], ds["labels"]
    else:
        ids_col, labels_col = [r["input_ids"] for r in ds], [r["labels"] for r in ds]
    ids_col, labels_col = list(ids_col), list(labels_col)
    bins = best_fit_decreasing([len(x) for x in ids_col], max_len)
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    for b in bins:
        ids, labels, pos = [], [], []
        for i in sorted(b):  # keep the file order inside a row
            ids += ids_col[i]
            labels += labels_col[i]
            pos += range(len(ids_col[i]))
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
        rows["position_ids"].append(pos)
    report = PackingReport(conversations=len(ids_col), rows=len(bins), tokens=sum(map(len, ids_col)), capacity=max_len)
    return datasets.Dataset.from_dict(rows), report


def split_row(row: dict) -> list[dict]:
    """Cut a packed row back into its conversations at ``position_ids == 0``.

    Returns:
        ``[{"input_ids": [...], "labels": [...]}, ...]`` in row order.
    """
    pos = list(row["position_ids"])
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    return [{"input_ids": list(row["input_ids"][s:e]), "labels": list(row["labels"][s:e])}
            for s, e in zip(starts, starts[1:])]


class PackedCollator:
    """Micro batch of packed rows -> one padding-free ``[1, total_tokens]`` batch.

    Output (``torch.int64``): ``input_ids``, ``labels`` (-100 = not supervised, and at the first token of every
    conversation) and ``position_ids`` (restarting at 0 per conversation), each of shape ``[1, total_tokens]``;
    no ``attention_mask`` (see the module docstring for how attention is confined). Thin wrapper over
    ``transformers.DataCollatorWithFlattening``.
    """

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)

    def __call__(self, features: list[dict]) -> dict:
        return self.flatten([conv for row in features for conv in split_row(row)], return_tensors="pt")


def attention_implementation(model) -> str:
    """The attention implementation the model runs with ("sdpa", "eager", "flash_attention_2", ...).

    Adapter over a private attribute: ``config._attn_implementation`` (checked against transformers 5.24).
    """
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    return str(getattr(config, "_attn_implementation", None) or "eager")


def check_packing_support(model) -> str:
    """Make sure packed conversations stay apart with this model; return the attention implementation.

    Raises:
        ConfigError: the attention implementation does not separate packed sequences by position ids.
    """
    impl = attention_implementation(model)
    if impl not in PACKING_ATTENTION:
        raise ConfigError([f"--packing True: the model uses attention implementation '{impl}', for which transformers "
                           f"cannot keep packed conversations apart (supported: {', '.join(PACKING_ATTENTION)}); "
                           "drop --packing (use --group_by_length True instead)"])
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    config.use_cache = False  # with a KV cache transformers does not look for packed sequences
    return impl
