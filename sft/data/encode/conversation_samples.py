"""The value one conversation becomes: :class:`ConversationSamples`, its samples (:class:`Sample`) with what the whole
conversation cost in declared fields, never keys riding on its first sample
(:func:`sft.data.encode.samples.encode_samples`
makes it, :class:`sft.data.encode.report.TruncationReport` counts it, :mod:`sft.data.store.dataset` writes its
samples)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, TypedDict


class Sample(TypedDict, total=False):
    """One training sample (:func:`sft.data.encode.samples.truncate`'s dict): ``input_ids`` and ``labels`` (lists of
    int, of the same length <= ``max_len``; labels -100 where not supervised), ``n_supervised`` (supervised tokens
    kept), ``n_lost`` (supervised tokens cut off), ``truncated`` (bool), ``user_cut`` (user turns cut from its start to
    fit, their last words kept); a truncated one also names where: ``cut_turn`` (the record's turn, or None) and
    ``turn_tokens`` (that turn's size), or, before they are named, ``cut_at`` (the first tokens cut off)."""
    input_ids: list
    labels: list
    n_supervised: int
    n_lost: int
    truncated: bool
    user_cut: int
    cut_at: list
    cut_turn: Optional[int]
    turn_tokens: Optional[int]


@dataclass
class ConversationSamples(Sequence):
    """The samples of one conversation, in order (a sequence of :class:`Sample`: ``len``, indexing and iteration are
    its samples'), with what the conversation cost.

    Attributes:
        samples: its samples.
        dropped: characters of the conversation the chat template left out (trained without them under
            ``--allow_dropped_content``).
        extra_samples: samples beyond one that a history-rewriting template made of it (0 where
            :mod:`sft.data.encode.split_turns` cut it into pieces).
        extra_tokens: the tokens of those samples beyond the last one.
    """

    samples: list = field(default_factory=list)
    dropped: int = 0
    extra_samples: int = 0
    extra_tokens: int = 0

    def __getitem__(self, i):
        return self.samples[i]

    def __len__(self) -> int:
        return len(self.samples)
