"""Tokenized datasets (memory-mapped Arrow, prepared by every rank, cached) and the padding collator.

Eager mode (default): the records of each source are streamed and validated (:mod:`sft.data.records.records`), encoded
per conversation (:func:`encode_samples`: ids and labels built together; one longer than ``model_max_length`` is split
at turn boundaries into several samples, ``--long_conversations split``, :mod:`sft.data.encode.long_conversations`, or
truncated, ``truncate``), samples left with no supervised token are dropped, and the samples are written as Arrow shards
under ``<cache>/<key>`` where the key hashes the source's bytes, the tokenizer (vocabulary, special tokens, chat
template), the settings, this package's version and its preparation code (:mod:`sft.data.store.cache_key`). Every global
rank prepares its shard and then memory-maps all of them (:mod:`sft.data.store.shards`: completion markers,
``--data_timeout``); no rank holds the records as Python objects. The rows come out in record order whatever the world
size (:func:`in_record_order`), and a complete set of shards written at another world size is used as it is
(:func:`shard_count`). Several sources are concatenated, or mixed by weight (:func:`mix`).

Lazy mode (``--lazy_preprocess``, truncation only): the shards hold the validated records (``id``, ``messages``)
instead, and a sample is encoded when the sampler asks for it; truncation is counted as samples are met, and a sample
with no supervised token left is replaced by the next one (logged by id) so that a batch never has zero supervised
tokens.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, replace as dataclass_replace
from typing import Optional, Sequence

import torch
from transformers import DataCollatorForSeq2Seq

from sft.data.encode.report import TruncationReport
from sft.data.encode.samples import (  # noqa: F401
    encode_samples,
    encode_truncated,
    lazy_refusal,
    limit_tokenizer_threads,
    truncate,
)
from sft.data.records.eval_split import empty_side_error, in_eval, record_key
from sft.data.records.records import RecordCheck, iter_conversations, log_duplicate_ids, template_problem
from sft.data.refusal import refusal_of
from sft.data.spec import PreparationSpec
from sft.data.store.cache_key import cache_key
from sft.data.store.shards import JobView, ShardPlan, agree, prepare_shard, read_marker, wait_for_shards
from sft.data.template.chat import IGNORE_INDEX
from sft.errors import DataError, TemplateError

logger = logging.getLogger(__name__)

def default_cache_dir() -> str:
    return os.environ.get("SFT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sft", "datasets")


ENCODE_BATCH = 256  # conversations per tokenizer call


def _features(lazy: bool):
    import datasets

    if lazy:
        return datasets.Features({"id": datasets.Value("string"), "record": datasets.Value("int64"),
                                  "messages": datasets.Value("string")})  # JSON: {"messages": [...], "tools": ...}
    return datasets.Features({"id": datasets.Value("string"), "record": datasets.Value("int64"),
                              "input_ids": datasets.List(datasets.Value("int32")),
                              "labels": datasets.List(datasets.Value("int32")),
                              "n_supervised": datasets.Value("int32")})


@dataclass
class _Job:
    """What one preparation process needs (inherited by forked --preprocessing_num_workers processes)."""

    path: str
    tokenizer: object
    eot_id: int
    control_tokens: Sequence[str]
    spec: PreparationSpec
    held_out: Optional[bool] = None  # --eval_split_ratio: True the held-out records only, False the others
    folder: str = ""
    shard: int = 0
    n_shards: int = 1
    n_parts: int = 1

    @property
    def holdout(self) -> Optional[tuple]:
        """``(ratio, seed, keep_held)`` of the split whose one side this job keeps, or None (every record)."""
        if self.held_out is None:
            return None
        return self.spec.eval_split_ratio, self.spec.eval_split_seed, self.held_out


_JOB: Optional[_Job] = None  # set before forking the part workers


def _write_part(p: int, job: Optional[_Job] = None) -> dict:
    """Write part ``p`` of ``job``'s shard (records ``index % (n_shards*n_parts) == shard + p*n_shards``);
    the forked workers find the job in ``_JOB``."""
    import pyarrow as pa

    job = job or _JOB
    spec, holdout = job.spec, job.holdout
    schema = _features(spec.lazy).arrow_schema
    check, report, name = RecordCheck(job.path), TruncationReport(mode=spec.long_conversations), f"part-{p:02d}.arrow"
    rows: dict = {k: [] for k in schema.names}

    def flush(writer, batch):
        if spec.lazy:
            for c in batch:
                rows["id"].append(c.id)
                rows["record"].append(c.index)
                rows["messages"].append(json.dumps({"messages": c.messages, "tools": c.tools}, ensure_ascii=False))
        elif batch:
            for c, samples in zip(batch, encode_samples(job.tokenizer, [c.messages for c in batch], job.eot_id, spec,
                                                        [c.tools for c in batch])):
                if isinstance(samples, TemplateError):  # the template refuses this record: a record problem
                    check.valid -= 1
                    check.add([template_problem(job.path, c, samples)])
                    continue
                report.count_conversation(samples, c.id, c.index)
                for ex in samples:
                    if ex["n_supervised"] > 0:
                        for k in schema.names:
                            rows[k].append(c.id if k == "id" else c.index if k == "record" else ex[k])
        if rows["id"]:
            writer.write_batch(pa.RecordBatch.from_pydict(rows, schema=schema))
        for v in rows.values():
            v.clear()

    batch = []
    with pa.OSFile(os.path.join(job.folder, name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for conv in iter_conversations(job.path, check, job.control_tokens, job.shard + p * job.n_shards,
                                       job.n_shards * job.n_parts):
            if check.n_bad and spec.on_bad_record == "error":
                continue  # this shard fails: only the rest of its problems are still counted
            if holdout and in_eval(record_key(conv), holdout[0], holdout[1]) != holdout[2]:
                continue  # the other side of the --eval_split_ratio split
            batch.append(conv)
            if len(batch) == ENCODE_BATCH:
                flush(writer, batch)
                batch = []
        flush(writer, batch)
    return {"part": name, "check": check.to_dict(), "report": report.__dict__}


def _write_shard(job: _Job, folder: str, shard: int, n_shards: int, n_parts: int) -> dict:
    global _JOB
    job = dataclass_replace(job, folder=folder, shard=shard, n_shards=n_shards, n_parts=n_parts)
    if n_parts == 1:
        parts = [_write_part(0, job)]
    else:  # fork: the workers inherit the tokenizer instead of unpickling it (what datasets.map does too)
        import multiprocessing

        _JOB = job
        try:
            with multiprocessing.get_context("fork").Pool(n_parts) as pool:
                parts = pool.map(_write_part, range(n_parts))
        finally:
            _JOB = None
    check = RecordCheck.merge(job.path, [x["check"] for x in parts])
    if check.n_bad and job.spec.on_bad_record == "error":
        raise check.error()
    return {"parts": [x["part"] for x in parts], "check": check.to_dict(),
            "report": TruncationReport.merge([x["report"] for x in parts]).__dict__}


def prepare_source(job: _Job, cache_root: str, plan: ShardPlan):
    """Prepare this rank's shards of one source (those without a completion marker; ``job.spec.num_proc``
    processes), wait for every shard, and memory-map them. Returns ``(datasets.Dataset, TruncationReport)``; see
    :func:`build_dataset`.

    Raises:
        DataError: a record problem (``error``; this rank's or the first failed rank's message), no valid record
            or no supervised sample left, or a shard not ready within ``job.spec.data_timeout`` seconds.
    """
    import datasets

    spec, holdout, parts = job.spec, job.holdout, job.spec.num_proc or 1
    settings = {"max_len": spec.max_len, "system_message": spec.system_message, "on_bad_record": spec.on_bad_record,
                "control_tokens": list(job.control_tokens), "lazy": spec.lazy,
                "long_conversations": spec.long_conversations, "last_reply_only": spec.last_reply_only,
                "allow_dropped_content": spec.allow_dropped_content,
                "holdout": list(holdout) if holdout else None}
    key_dir = os.path.join(cache_root, cache_key(job.path, job.tokenizer, settings))
    os.makedirs(key_dir, exist_ok=True)
    n = shard_count(key_dir, plan.view.world_size)
    limit_tokenizer_threads(plan.view.local_world_size * parts)
    for k in plan.mine(n):
        if read_marker(key_dir, k, n) is None:
            prepare_shard(key_dir, k, n, plan, lambda folder, k=k: _write_shard(job, folder, k, n, parts))
    markers = wait_for_shards(key_dir, n, plan, spec.data_timeout, job.path)
    check = RecordCheck.merge(job.path, [m["check"] for m in markers])
    check.finish(spec.on_bad_record, log=plan.view.rank == 0)
    ds = datasets.concatenate_datasets([datasets.Dataset.from_file(os.path.join(key_dir, m["dir"], part))
                                        for m in markers for part in m["parts"]])
    report = TruncationReport.merge([m["report"] for m in markers]) if not spec.lazy else TruncationReport()
    if len(ds) == 0 and holdout and (spec.lazy or report.conversations == 0):
        raise empty_side_error(job.path, holdout[0], check.valid, held_all=not holdout[2])
    if len(ds) == 0:
        raise DataError(f"{job.path}: no sample has a supervised token within --model_max_length {spec.max_len} "
                        f"({report.samples} samples, all cut before their first reply ends); raise --model_max_length")
    if plan.view.rank == 0:
        log_duplicate_ids(job.path, _duplicate_ids(ds, per_conversation_runs=not spec.lazy))
    logger.info("%s: %d records, %d shard(s) in %s", job.path, check.records, n, key_dir)
    return in_record_order(ds), report


_DONE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.done$")


def shard_count(key_dir: str, world_size: int) -> int:
    """How many shards this run reads from ``key_dir``: ``world_size``, unless ``key_dir`` already holds every
    completion marker of another count (written by a run at another world size) and not of this one; then the
    smallest such count. Safe because the rows come out in record order whatever the count
    (:func:`in_record_order`), so any complete set is the same dataset and is not prepared again."""
    done: dict[int, set] = {}
    for name in os.listdir(key_dir):
        m = _DONE.match(name)
        if m:
            done.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    complete = sorted(n for n, ks in done.items() if ks >= set(range(n)))
    return world_size if world_size in complete or not complete else complete[0]


def in_record_order(ds):
    """``ds`` with its rows in record order: by the ``record`` column (int64, the record's 0-based index in its
    source), the samples of one record (a split conversation) kept in their written order (a stable sort; they are
    written next to each other in one part). The shards hold records ``index % n == k`` and their parts
    ``index % (n * parts) == ...``, so their concatenation is in shard order; this makes the dataset the same for
    any number of shards, parts and preparing ranks, and so for any world size. Returns ``ds`` itself when it is
    already in order (one shard, one part), else ``ds.select(order)``: an index map (8 bytes per sample, as
    mixing's), nothing copied."""
    import numpy as np

    record = ds.data.column("record").to_numpy()
    if len(record) < 2 or bool(np.all(record[1:] >= record[:-1])):
        return ds
    return ds.select(np.argsort(record, kind="stable"))


def _duplicate_ids(ds, per_conversation_runs: bool) -> list:
    """The ids (str) that more than one record of ``ds`` carries, in the order found (counted by pyarrow, not in
    Python). With ``per_conversation_runs`` (eager datasets) the samples of one conversation share its id and are
    written next to each other, so each run of equal ids counts once; two copies of a record that land next to each
    other in one shard then count as one (not warned)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = ds.data.column("id").combine_chunks()
    if per_conversation_runs and len(ids) > 1:
        starts = pa.concat_arrays([pa.array([True]), pc.not_equal(ids.slice(1), ids.slice(0, len(ids) - 1))])
        ids = pc.filter(ids, starts)
    counts = pc.value_counts(ids)
    return counts.filter(pc.greater(counts.field("counts"), 1)).field("values").to_pylist()


def mix(parts: Sequence, weights: Optional[Sequence[float]], seed: int, paths: Sequence[str]):
    """Concatenate the sources' datasets, or mix them by ``weights``.

    With weights, the mix has as many samples as the sources together (``total``), and source i contributes
    ``round(total * w_i / sum(w))`` of them: whole passes over the source plus a random subset of it drawn with
    ``seed`` (numpy, deterministic), so a 70/30 mix of any two sources has 70% and 30% of its samples from them.
    Returns a ``datasets.Dataset`` (an index mapping over the memory-mapped sources; nothing is copied).
    """
    import datasets
    import numpy as np

    if not weights:
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(list(parts))
    total, wsum = sum(len(d) for d in parts), float(sum(weights))
    chosen = []
    for i, (d, w, path) in enumerate(zip(parts, weights, paths)):
        target = int(round(total * w / wsum))
        passes, rest = divmod(target, len(d))
        rng = np.random.default_rng([seed, i])
        idx = np.concatenate([np.tile(np.arange(len(d)), passes), np.sort(rng.choice(len(d), rest, replace=False))])
        logger.info("mixing: %s: %d samples (weight %g: %.2f passes over its %d)",
                    path, target, w, target / len(d), len(d))
        chosen.append(d.select(idx))
    return datasets.concatenate_datasets(chosen)


def build_dataset(paths: Sequence[str], tokenizer, eot_id: int, spec: PreparationSpec, *,
                  control_tokens: Sequence[str] = (), held_out: Optional[bool] = None, view: Optional[JobView] = None,
                  plan: Optional[ShardPlan] = None):
    """Return ``(dataset, TruncationReport)`` for the sources ``paths`` (files or dataset folders), prepared as
    ``spec`` says (:class:`sft.data.spec.PreparationSpec`: sample length, system message, bad records, lazy or
    eager, long conversations, cache folder, processes, mixing weights and seed, wait bound).

    ``control_tokens``: the chat template's control tokens, refused in every text of the records (a record problem).
    ``held_out`` (with ``spec.eval_split_ratio``): keep only the records that
    :func:`sft.data.records.eval_split.in_eval`
    holds out (True, the evaluation side) or only the others (False); None (default): every record.

    Eight parameters (the issue's limit is six): ``spec`` is the one value of the flags; the four keyword-only ones are
    what the app knows per call (the template's control tokens, which side of the evaluation split, the job's view
    and an agreed shard plan), not settings of preparation, so they stay apart from it.

    Every rank of the job (``view``, default: from the environment) calls this at the same point: each prepares
    its shards (``spec.num_proc`` processes each), then waits for the others' on the file system for up to
    ``spec.data_timeout`` seconds (:mod:`sft.data.store.shards`); ``plan`` reuses an earlier
    :func:`sft.data.store.shards.agree`.

    The rows are in record order (:func:`in_record_order`), the same for any world size, and several sources are
    concatenated or mixed by ``spec.weights`` (:func:`mix`). The dataset has columns
    ``id`` (str; the samples of a split conversation share it), ``record`` (int64: the record's 0-based index in
    its source), ``input_ids`` and ``labels`` (int32 lists, equal lengths, at most
    ``spec.max_len``; labels -100 where not supervised) and ``n_supervised`` (int32), memory-mapped; with
    ``spec.lazy`` (truncation only, whatever ``spec.long_conversations`` says) it has ``id`` and ``messages``, is
    wrapped in :class:`LazySupervisedDataset` and the report is None. No ``length`` column: the
    Trainer drops columns the model's forward does not take before building its sampler, so
    ``--group_by_length`` measures ``input_ids`` itself.

    Raises:
        ValueError: ``held_out`` given without ``spec.eval_split_ratio``.
        DataError: as :func:`prepare_source`.
    """
    if held_out is not None and spec.eval_split_ratio is None:
        raise ValueError("build_dataset: held_out needs spec.eval_split_ratio")
    if spec.lazy:
        spec = dataclass_replace(spec, long_conversations="truncate")
    root = spec.cache_dir or default_cache_dir()
    os.makedirs(root, exist_ok=True)
    plan = plan or agree(root, view or JobView.from_env())
    out, reports = [], []
    for path in paths:
        ds, report = prepare_source(_Job(path, tokenizer, eot_id, tuple(control_tokens), spec, held_out), root, plan)
        out.append(ds)
        reports.append(report.__dict__)
    ds = mix(out, spec.weights, spec.seed, paths)
    if spec.lazy:
        return LazySupervisedDataset(ds, tokenizer, eot_id, spec, ", ".join(paths)), None
    return ds, TruncationReport.merge(reports)

class LazySupervisedDataset(torch.utils.data.Dataset):
    """Encodes a conversation when it is indexed (``--lazy_preprocess``).

    ``records`` is a sequence of ``{"id": str, "messages": [{"role", "content"}, ...]}`` (the memory-mapped
    records dataset of :func:`build_dataset`, or validated conversations as dicts), encoded as ``spec`` says (its
    ``max_len``, ``system_message``, ``last_reply_only`` and ``allow_dropped_content``; always truncated:
    :func:`sft.data.encode.samples.encode_truncated`); ``data_path`` names the source in errors. ``__getitem__`` returns
    ``{"input_ids", "labels"}`` (lists of int). A sample left with no supervised token after truncation is
    logged by id and replaced by the next index (mod len), so the loss of a batch never divides by zero.
    """

    def __init__(self, records, tokenizer, eot_id: int, spec: PreparationSpec, data_path: str = "data"):
        self.records, self.tokenizer, self.eot_id, self.data_path = records, tokenizer, eot_id, data_path
        self.spec, self.max_len = spec, spec.max_len
        self.report = TruncationReport()
        self._seen: set[int] = set()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        n = len(self.records)
        if not -n <= i < n:
            raise IndexError(i)  # ends plain iteration (``for x in dataset``), e.g. in LengthGroupedSampler
        for step in range(n):
            j = (i + step) % n
            rec = self.records[j]
            ex = self._encode(rec)
            if j not in self._seen:
                self._seen.add(j)
                self.report.count(ex, rec["id"], rec.get("record"))
                if ex["n_supervised"] == 0:
                    logger.warning("sample id=%s has no supervised token within --model_max_length %d; using the "
                                   "next sample instead", rec["id"], self.max_len)
            if ex["n_supervised"] > 0:
                return {"input_ids": ex["input_ids"], "labels": ex["labels"]}
        raise DataError(f"{self.data_path}: no sample has a supervised token within --model_max_length "
                        f"{self.max_len}; raise --model_max_length")

    def _encode(self, rec) -> dict:
        """The one sample of a record (a chat template that makes several samples of it is refused: lazy mode keeps
        one sample per record)."""
        conv = json.loads(rec["messages"]) if isinstance(rec["messages"], str) else {"messages": rec["messages"]}
        try:
            samples = encode_truncated(self.tokenizer, conv["messages"], self.eot_id, self.spec, conv.get("tools"))
        except TemplateError as e:  # named as every record problem is: file, record, id, turn, fix
            r = refusal_of(e)
            turn = f", turn {r.turn}" if r.turn is not None else ""
            raise DataError(f"{self.data_path}, record {rec.get('record', '?')}, id={rec['id']!r}{turn}: "
                            f"{r.what}; {r.fix}") from None
        if len(samples) > 1:
            raise DataError(f"{self.data_path}: record id={rec['id']}: {lazy_refusal(len(samples))}")
        return samples[0]


def make_collator(tokenizer, pad_to_multiple_of: int = 8) -> DataCollatorForSeq2Seq:
    """Dynamic padding to the longest sample of the batch, rounded up to ``pad_to_multiple_of``.

    The batch is ``input_ids`` (int64, [batch, seq]), ``attention_mask`` (int64, 1 = real token,
    0 = padding, set by position) and ``labels`` (int64, padding = -100). Thin wrapper over
    ``transformers.DataCollatorForSeq2Seq``; requires ``tokenizer.padding_side == "right"``.
    """
    return DataCollatorForSeq2Seq(tokenizer, padding="longest", pad_to_multiple_of=pad_to_multiple_of,
                                  label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
