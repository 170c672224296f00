"""``--eval_split_ratio``: hold out a deterministic evaluation set of the training file's records.

A record goes to evaluation when ``sha256(seed, key)`` read as a fraction of 2**64 is below the ratio.
``key`` is the record's id, or, for a record without one, its normalised messages (JSON): the decision
depends on the record alone, so the same records are held out when the file is reordered, and a file that
grows keeps every earlier record on its side (about ``ratio`` of the new ones join the evaluation set).
Records sharing an id always land on the same side, so a duplicated conversation cannot leak into the
evaluation set. The evaluation set's size is therefore about, not exactly, ``ratio x records``.
"""
from __future__ import annotations

import hashlib
import json

from sft.data.records.records import Conversation
from sft.errors import DataError


def record_key(conv: Conversation) -> str:
    """The split key of one record: its id, or its messages when the file gave it none (id ``#<index>``)."""
    if conv.id == f"#{conv.index}":
        return "messages:" + json.dumps(conv.messages, ensure_ascii=False, sort_keys=True)
    return "id:" + conv.id


def in_eval(key: str, ratio: float, seed: int) -> bool:
    """True when ``key`` falls in the held-out fraction ``ratio`` (0 < ratio < 1) for ``seed``."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < ratio * 2**64


def empty_side_error(path: str, ratio: float, n_records: int, held_all: bool) -> DataError:
    """The error for a split of ``path``'s ``n_records`` valid records that holds out none or (``held_all``) all."""
    if held_all:
        return DataError(f"{path}: --eval_split_ratio {ratio} held out all {n_records} records, leaving none to "
                         "train on; lower the ratio or give --eval_data_path")
    return DataError(f"{path}: --eval_split_ratio {ratio} held out none of its {n_records} records; raise the "
                     "ratio, change --eval_split_seed, or give --eval_data_path")
