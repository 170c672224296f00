"""The settings of data preparation, one frozen value (:class:`PreparationSpec`).

:func:`sft.data.store.dataset.build_dataset` and :func:`sft.app.train.load_records` read it; the app builds it once from
the parsed flags (:func:`sft.app.train.preparation_spec`), the data wing never reads the flags itself. The
defaults below are those of the flags (``sft/config/arguments.py``; ``seed`` that of ``--seed``), so that a test
or a benchmark names only what it changes: ``PreparationSpec(max_len=64)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PreparationSpec:
    """How the records of a run's sources become samples, the same for every source and every rank.

    Attributes:
        max_len: tokens per sample at most (``--model_max_length``; no default).
        system_message: the system prompt of records without a leading system turn (``--system_message``);
            None (default): the chat template's own.
        on_bad_record: ``"error"`` (default): an invalid record stops preparation, listing every problem;
            ``"skip"``: it is dropped and counted (``--on_bad_record``).
        lazy: True: the shards hold the validated records and a sample is encoded when it is read
            (``--lazy_preprocess``; default False).
        long_conversations: ``"split"`` (default), ``"truncate"`` or ``"refuse"`` (split, and a turn split would
            cut refuses its conversation): what becomes of a conversation longer than
            ``max_len`` (``--long_conversations``, as :attr:`DataArguments.long_conversations_mode` resolves it);
            with ``lazy`` always ``"truncate"``, whatever is given here.
        cache_dir: the folder of the prepared shards (``--data_cache_dir``); None (default):
            ``$SFT_CACHE_DIR`` or ``~/.cache/sft/datasets`` (:func:`sft.data.store.dataset.default_cache_dir`).
        num_proc: processes each rank prepares its shard with (``--preprocessing_num_workers``); None
            (default): 1.
        weights: mixing weights, one per train source (``--data_weights``; numbers > 0, relative); None
            (default): every sample of every source once. Never applied to the eval sources.
        seed: the seed of the mixing draw (``--data_seed``, else ``--seed``; default 42).
        data_timeout: seconds a rank waits for the other ranks' shards (``--data_timeout``; default 14400.0).
        eval_split_ratio: the fraction (0 < R < 1) of the train sources' records held out for evaluation
            (``--eval_split_ratio``); None (default): no split.
        eval_split_seed: the seed of that choice (``--eval_split_seed``; default 0).
        last_reply_only: train only each conversation's last reply (``--mask_history``; default False).
        allow_dropped_content: train a conversation whose text the chat template partly drops, counting what it
            drops (``--allow_dropped_content``; default False: such a record is refused).
    """

    max_len: int
    system_message: Optional[str] = None
    on_bad_record: str = "error"
    lazy: bool = False
    long_conversations: str = "split"
    cache_dir: Optional[str] = None
    num_proc: Optional[int] = None
    weights: Optional[tuple[float, ...]] = None
    seed: int = 42
    data_timeout: float = 14400.0
    eval_split_ratio: Optional[float] = None
    eval_split_seed: int = 0
    last_reply_only: bool = False
    allow_dropped_content: bool = False
