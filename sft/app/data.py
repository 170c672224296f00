"""The run's data: the tokenizer and the train / eval datasets, prepared by every rank into memory-mapped shards,
logged, and packed into rows with ``--packing`` (:func:`prepare_data`, the first step of
:func:`sft.app.train.build_trainer`)."""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import NamedTuple

from sft.app.specs import control_tokens_for, data_sources, preparation_spec
from sft.data.batches.packing import PackedCollator, pack_dataset
from sft.data.spec import PreparationSpec
from sft.data.store.dataset import build_dataset, default_cache_dir, make_collator
from sft.data.store.shards import JobView, agree
from sft.data.template.chat import visualize
from sft.model.loading import load_tokenizer

logger = logging.getLogger("sft")


class PreparedData(NamedTuple):
    """:func:`prepare_data`'s result: the tokenizer, its end-of-turn id, whether its vocabulary grew, the train and
    eval datasets (eval None without one) and the collator for them (padding-free chosen later, by the model)."""

    tok: object
    eot: int
    vocab_grew: bool
    train: object
    eval: object
    collator: object


def prepare_data(model_args, data_args, training_args) -> PreparedData:
    """The tokenizer and the train / eval datasets, prepared as the flags say (:func:`load_records`), logged, and
    packed into rows with ``--packing``."""
    tok, eot, grew = load_tokenizer(model_args.model_name_or_path, model_args.trust_remote_code,
                                    training_args.cache_dir, model_args.chat_template, model_args.chat_template_kwargs)
    prepared = load_records(data_sources(data_args), tok, eot, preparation_spec(data_args, training_args))
    datasets = {}
    for name, got in prepared.items():
        datasets[name] = got[0] if got else None
        if got:
            log_dataset(name, *got, tok, training_args.model_max_length)
    train_ds, eval_ds = datasets["train"], datasets["eval"]
    collator = make_collator(tok)
    if data_args.packing:
        train_ds, eval_ds, collator = pack_datasets(train_ds, eval_ds, training_args.model_max_length,
                                                    tok.pad_token_id)
    return PreparedData(tok, eot, grew, train_ds, eval_ds, collator)


def load_records(sources: dict[str, list[str]], tok, eot: int, spec: PreparationSpec) -> dict:
    """The train / eval datasets of the named sources (``{"train": [paths], "eval": [paths] or []}``): streamed,
    validated (control tokens refused), prepared by every rank into memory-mapped shards as ``spec`` says
    (:func:`sft.app.specs.preparation_spec`) and, for train, mixed by ``spec.weights``
    (:func:`sft.data.store.dataset.build_dataset`).
    The one place that decides which records train and which evaluate: with ``spec.eval_split_ratio`` (the eval
    sources being the train sources, :func:`sft.app.specs.data_sources`) a record is held out by
    :func:`sft.data.records.eval_split.in_eval` of its id and ``spec.eval_split_seed``, in the stream, so each side is
    prepared from its own records only. Every sample keeps its record's ``id`` column (eager mode). Returns
    ``{name: (dataset, report) or None}``; every rank of the job calls it at the same point.

    Raises:
        ConfigError: ``spec.system_message`` holds a control token.
        DataError: a file or record problem (``spec.on_bad_record`` "error"), no record left, a split that leaves
            one side empty, or a shard not ready within ``spec.data_timeout`` seconds.
    """
    control = control_tokens_for(tok, spec.system_message)
    root = spec.cache_dir or default_cache_dir()
    os.makedirs(root, exist_ok=True)
    plan = agree(root, JobView.from_env())
    split = spec.eval_split_ratio is not None and sources.get("eval") == sources["train"]
    out = {}
    for name, paths in sources.items():
        side = dataclasses.replace(spec, cache_dir=root, weights=spec.weights if name == "train" else None)
        out[name] = build_dataset(paths, tok, eot, side, control_tokens=control, plan=plan,
                                  held_out=(name == "eval") if split else None) if paths else None
    return out


def log_dataset(name: str, ds, report, tok, max_len: int) -> None:
    """The truncation report and, for train, the first sample with its supervised tokens marked."""
    if report is None:  # lazy: counted as samples are met
        logger.info("%s: %d conversations, tokenized on access (--lazy_preprocess)", name, len(ds))
        return
    for line in report.lines(name, max_len):
        logger.info("%s", line)
    if name == "train":
        shown = visualize(tok, ds[0]["input_ids"], ds[0]["labels"])
        more = (f"\n... ({len(shown) - 1200} more characters; sft-show-sample prints it all)"
                if len(shown) > 1200 else "")
        logger.info("first training sample (supervised tokens in «»):\n%s%s", shown[:1200], more)


def pack_datasets(train_ds, eval_ds, max_len: int, pad_token_id: int = 0):
    """``--packing``: rows of several conversations (:mod:`sft.data.batches.packing`). Returns ``(train, eval,
    collator)``."""
    packed = []
    for name, ds in (("train", train_ds), ("eval", eval_ds)):
        if ds is not None:
            ds, report = pack_dataset(ds, max_len)
            logger.info("%s", report.line(name))
        packed.append(ds)
    return packed[0], packed[1], PackedCollator(pad_token_id)
