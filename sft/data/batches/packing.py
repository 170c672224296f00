"""Sequence packing (``--packing True``): several conversations per row, with no cross-contamination.

How it works (transformers 5.24):

1. :func:`pack_dataset` groups the tokenized conversations into rows of at most ``model_max_length``
   tokens with best-fit decreasing (the strategy of TRL's ``packing_strategy="bfd"``). A row stores
   the conversations back to back in ``input_ids`` / ``labels`` and a ``position_ids`` column that
   restarts at 0 at the first token of every conversation. No conversation is split across rows.
2. :class:`PackedCollator` keeps the rows of a micro batch as rows: ``[micro_batch, longest_row]``, each row
   padded to the longest with a pad "document" of its own (position ids 0, 1, ... again, labels -100), the
   first label of every conversation set to -100 (the last token of one conversation is never trained to
   predict the first token of the next) and no ``attention_mask``. Attention cost per row grows with the sum
   of its conversations' squared lengths, not with the micro batch's tokens squared.
3. :func:`sft.model.attention.check_packing_support` switches an ``sdpa`` (or ``flash_attention_2``) model to
   :data:`sft.model.attention.PACKED_ATTENTION`: causal attention per conversation, split at the position-id resets,
   with no mask (SDPA ``is_causal`` per conversation; flash-attn varlen on CUDA when installed). ``eager`` and
   ``flex_attention`` keep transformers' own handling: ``masking_utils.create_causal_mask`` detects the packed
   format from the position ids (``find_packed_sequence_indices``, per row) and builds a block-diagonal causal
   mask. RoPE uses the restarted position ids, so positions match the unpacked run exactly. The KV cache is
   turned off (with a cache transformers does not look for packed sequences).
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sft.data.template.chat import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Attention implementations with which packed rows stay apart: the first two are switched to sft.model.attention's
# per-conversation attention; transformers 5.24 builds a per-row block-diagonal mask from the position ids for the
# others (its flash_attention_3 path finds packed sequences only in a batch of one row, so it is not listed).


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
    """Micro batch of packed rows -> ``[micro_batch, longest_row]`` tensors, one row per packed row.

    Output (``torch.int64``, each ``[micro_batch, longest_row]``): ``input_ids`` (pad positions ``pad_token_id``),
    ``labels`` (-100 = not supervised: pad positions and the first token of every conversation) and
    ``position_ids`` (restarting at 0 per conversation; the padding of a row is one more "document" 0, 1, ..., so
    it attends only to itself and is never attended to); no ``attention_mask`` (see the module docstring); and the
    documents' boundaries over the rows flattened one after the other (:func:`sft.model.attention.flat_offsets` of
    :func:`sft.model.attention.document_bounds`: ``cu_seq_lens_q`` /
    ``cu_seq_lens_k``, ``torch.int32``; ``max_length_q`` / ``max_length_k``, int), which the attention reads instead
    of the position ids. Rows are not flattened into one: attention cost stays per row.

    Args:
        pad_token_id: the id written at pad positions (never trained on nor attended to from real tokens).
    """

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = int(pad_token_id)

    def __call__(self, features: list[dict]) -> dict:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        ids, labels, pos = [], [], []
        for f in features:
            if not f["input_ids"]:
                raise ValueError("PackedCollator: an empty packed row")
            k = longest - len(f["input_ids"])
            row_pos = list(f["position_ids"])
            ids.append(list(f["input_ids"]) + [self.pad_token_id] * k)
            labels.append([IGNORE_INDEX if p == 0 else int(x) for x, p in zip(f["labels"], row_pos)]
                          + [IGNORE_INDEX] * k)
            pos.append(row_pos + list(range(k)))
        rows = torch.tensor(pos, dtype=torch.int64)
        bounds = document_bounds(rows, len(pos))
        offsets, long = flat_offsets(bounds, rows.shape[1]), max(e - s for docs in bounds for s, e in docs)
        return {"input_ids": torch.tensor(ids, dtype=torch.int64), "labels": torch.tensor(labels, dtype=torch.int64),
                "position_ids": rows,
                "cu_seq_lens_q": torch.tensor(offsets, dtype=torch.int32),
                "cu_seq_lens_k": torch.tensor(offsets, dtype=torch.int32), "max_length_q": long, "max_length_k": long}


class PaddingFreeCollator:
    """``--padding_free`` (without ``--packing``): a micro batch of samples -> one ``[1, total_tokens]`` row, no
    padding.

    Output (``torch.int64``, each ``[1, total_tokens]``): ``input_ids``, ``labels`` (-100 = not supervised, and at
    the first token of every sample) and ``position_ids`` (restarting at 0 per sample); no ``attention_mask``; and
    the samples' boundaries for one attention call per layer: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``torch.int32``
    ``[samples + 1]``) and ``max_length_q`` / ``max_length_k`` (int). Thin wrapper over
    ``transformers.DataCollatorWithFlattening`` (``return_flash_attn_kwargs=True``); the model must run
    :data:`sft.model.attention.PACKED_ATTENTION` (attention per sample, cost per sample's length squared).
    """

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX,
                                                  return_flash_attn_kwargs=True)

    def __call__(self, features: list[dict]) -> dict:
        return self.flatten([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features],
                            return_tensors="pt")


class SequenceParallelSplit:
    """``--sequence_parallel_size N``: this rank's slice of a micro batch's row (:mod:`sft.model.sequence_parallel`).

    Wraps :class:`PaddingFreeCollator` or :class:`PackedCollator` (every rank of a sequence-parallel group collates
    the same samples) and applies :func:`split_for_sequence_parallel` to its output.

    Args:
        collator: the padding-free or packed collator.
        size: N, ranks of the group; rank: this rank's place in it (0..N-1).
        pad_token_id: the id of the tokens that pad the row to a multiple of N.
    """

    def __init__(self, collator, size: int, rank: int, pad_token_id: int = 0):
        self.collator, self.size, self.rank, self.pad_token_id = collator, int(size), int(rank), int(pad_token_id)

    def __call__(self, features: list[dict]) -> dict:
        return split_for_sequence_parallel(self.collator(features), self.size, self.rank, self.pad_token_id)


def split_for_sequence_parallel(batch: dict, size: int, rank: int, pad_token_id: int = 0) -> dict:
    """Rank ``rank``'s slice of a padding-free or packed batch, for a sequence-parallel group of ``size`` ranks.

    The rows are flattened into one (packed rows are already cut into documents by their position ids), the labels
    shifted over the whole row first (the last token of a slice predicts the first of the next slice's), and the row
    padded to a multiple of ``size`` with one more document (``pad_token_id``, position ids 0, 1, ..., labels -100),
    which attends only to itself. Slice ``rank`` of ``size`` equal slices is returned.

    Args:
        batch: ``input_ids``, ``labels``, ``position_ids`` (``[rows, len]`` int64) and optionally ``cu_seq_lens_q``
            (int32 offsets of the documents over the flattened rows) and ``max_length_q``.
    Returns:
        ``input_ids``, ``position_ids``, ``shift_labels`` and ``labels`` (the same shifted targets: the loss reads
        ``shift_labels``, and the Trainer counts the supervised targets only where ``labels`` exists), each ``[1,
        (rows x len + pad) / size]`` int64; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, the whole padded row's
        documents: attention sees the whole row) and ``max_length_q`` / ``max_length_k`` (int).
    Raises:
        ValueError: the batch has an ``attention_mask`` (a padded batch: its pad tokens would become a document
            that real tokens attend to) or no position ids.
    """
    import torch

    if batch.get("attention_mask") is not None or batch.get("position_ids") is None:
        raise ValueError("sequence parallelism splits padding-free or packed rows (position ids, no attention mask)")
    ids, pos = batch["input_ids"].reshape(1, -1), batch["position_ids"].reshape(1, -1)
    if "shift_labels" in batch:
        shift = batch["shift_labels"].reshape(1, -1)
    else:
        shift = torch.nn.functional.pad(batch["labels"].reshape(1, -1)[:, 1:], (0, 1), value=IGNORE_INDEX)
    cu = batch.get("cu_seq_lens_q")
    if cu is None:
        cu = torch.tensor(flat_offsets(document_bounds(pos, 1), pos.shape[1]), dtype=torch.int32)
    offsets = [int(x) for x in cu.tolist()]
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    total = ids.shape[1]
    pad = (-total) % size
    if pad:
        ids = torch.cat([ids, torch.full((1, pad), pad_token_id, dtype=ids.dtype)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)[None]], dim=1)
        shift = torch.cat([shift, torch.full((1, pad), IGNORE_INDEX, dtype=shift.dtype)], dim=1)
        offsets.append(total + pad)
        longest = max(longest, pad)
    n = (total + pad) // size
    part = slice(rank * n, (rank + 1) * n)
    cu = torch.tensor(offsets, dtype=torch.int32)
    local = shift[:, part].contiguous()
    return {"input_ids": ids[:, part].contiguous(), "position_ids": pos[:, part].contiguous(), "labels": local,
            "shift_labels": local, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}


def document_bounds(position_ids: "torch.Tensor", batch_size: int) -> list[list[tuple[int, int]]]:
    """The documents of each row: ``[(start, end), ...]`` per row (end exclusive), covering the row.

    A document starts at index 0 and wherever the position id does not go up by one (the rule of
    ``transformers.masking_utils.find_packed_sequence_indices``).

    Args:
        position_ids: int tensor ``[batch_size or 1, row_len]``.
        batch_size: rows of the batch (position ids of one row are shared by all rows).
    """
    import torch

    pos = position_ids.expand(batch_size, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    row_len = pos.shape[1]
    out = []
    for row in starts.cpu().tolist():
        s = [i for i, new in enumerate(row) if new] + [row_len]
        out.append(list(zip(s, s[1:])))
    return out


def flat_offsets(bounds, row_len: int) -> list[int]:
    """``cu_seqlens`` as a list: where each document of ``bounds`` (:func:`document_bounds`) starts in the rows
    flattened one after the other (``row_len`` tokens each), and the total at the end."""
    return [r * row_len + s for r, docs in enumerate(bounds) for s, _ in docs] + [len(bounds) * row_len]


def cu_seqlens_bounds(offsets: list[int], batch_size: int, row_len: int) -> list[list[tuple[int, int]]]:
    """The documents of each row, as :func:`document_bounds` gives them, from flat ``cu_seqlens`` offsets (the
    collators' ``cu_seq_lens_q``: ``[0, end_1, ..., batch_size * row_len]`` over the flattened rows).

    Raises ValueError (naming the offsets) when they do not cut ``batch_size`` rows of ``row_len`` tokens into whole
    documents, or do not cover them."""
    bounds: list[list[tuple[int, int]]] = [[] for _ in range(batch_size)]
    for s, e in zip(offsets, offsets[1:]):
        r = s // row_len
        if e <= s or r >= batch_size or (e - 1) // row_len != r:
            raise ValueError(f"cu_seq_lens_q {offsets} does not cut {batch_size} row(s) of {row_len} tokens into "
                             "whole documents")
        bounds[r].append((s - r * row_len, e - r * row_len))
    if not offsets or offsets[0] != 0 or offsets[-1] != batch_size * row_len:
        raise ValueError(f"cu_seq_lens_q {offsets} does not cover {batch_size} row(s) of {row_len} tokens")
    return bounds
