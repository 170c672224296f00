"""Tokenized datasets (cached, prepared once) and the padding collator.

Eager mode (default): every conversation is encoded once with HF ``datasets``; one longer than
``model_max_length`` is split at turn boundaries into several samples (``--long_conversations split``,
:mod:`sft.long_conversations`) or truncated (``truncate``); samples left with no supervised token are dropped, and the result is saved
under ``<cache>/<key>`` where the key hashes the data file's bytes, the tokenizer (vocabulary,
special tokens, chat template), the settings and this package's version. Global rank 0 prepares
it; the other ranks wait at a barrier and load it from disk (if the cache folder is not shared
between nodes, a rank that cannot see it prepares its own copy and says so).

Lazy mode (``--lazy_preprocess``, truncation only): a sample is encoded when the sampler asks for it; truncation is
counted as samples are met, and a sample with no supervised token left is replaced by the next one
(logged by id) so that a batch never has zero supervised tokens.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch
from transformers import DataCollatorForSeq2Seq

from . import __version__
from .chat import IGNORE_INDEX, encode_conversations, with_system
from .data import Conversation, file_sha256
from .errors import DataError
from .long_conversations import split_conversation

logger = logging.getLogger(__name__)

CACHE_FORMAT = 3  # bump when the cached columns or their meaning change


@dataclass
class TruncationReport:
    """What fitting into ``model_max_length`` cost: counts are samples (conversations for ``conversations`` and
    ``split``), tokens are supervised tokens. ``mode`` is the ``--long_conversations`` setting; with ``split``,
    ``truncated`` counts the replies that do not fit even alone (their samples are truncated)."""

    samples: int = 0
    truncated: int = 0
    supervised_tokens: int = 0
    supervised_tokens_lost: int = 0
    dropped_ids: list = field(default_factory=list)
    conversations: int = 0
    split: int = 0
    user_turns_cut: int = 0
    mode: str = "truncate"

    @property
    def kept(self) -> int:
        return self.samples - len(self.dropped_ids)

    def lines(self, name: str, max_len: int) -> list[str]:
        source = f" from {self.conversations} conversations" if self.conversations else ""
        out = [f"{name}: {self.kept} of {self.samples} samples kept{source}, {self.supervised_tokens} supervised tokens"]
        if self.split:
            pieces = self.samples - (self.conversations - self.split)
            out.append(f"{name}: {self.split} of {self.conversations} conversations longer than --model_max_length "
                       f"{max_len} were split at turn boundaries into {pieces} samples (earlier turns as unsupervised "
                       "context)")
        if self.user_turns_cut:
            out.append(f"{name}: {self.user_turns_cut} user turns too long to fit with their reply within "
                       f"--model_max_length {max_len} were cut from the start (their last words kept)")
        if self.truncated and self.mode == "split":
            out.append(f"{name}: {self.truncated} replies are too long for --model_max_length {max_len} by themselves "
                       f"(with the system prompt): their first tokens are trained, {self.supervised_tokens_lost} "
                       "supervised tokens lost")
        elif self.truncated:
            out.append(f"{name}: {self.truncated} of {self.samples} samples longer than --model_max_length "
                       f"{max_len} were truncated; {self.supervised_tokens_lost} supervised tokens lost "
                       "(--long_conversations split keeps them)")
        if self.dropped_ids:
            ids = ", ".join(map(str, self.dropped_ids[:50])) + (" ..." if len(self.dropped_ids) > 50 else "")
            out.append(f"{name}: dropped {len(self.dropped_ids)} sample(s) left with no supervised token after "
                       f"truncation: {ids} (raise --model_max_length to keep them)")
        return out


def truncate(ids: list[int], labels: list[int], max_len: int) -> dict:
    """Keep the first ``max_len`` tokens (right truncation) and count what it cost.

    Returns:
        dict with ``input_ids``, ``labels`` (lists of int, length <= max_len), ``n_supervised`` (kept),
        ``n_lost`` (supervised tokens cut off) and ``truncated`` (bool).
    """
    total_sup = sum(1 for x in labels if x != IGNORE_INDEX)
    kept = sum(1 for x in labels[:max_len] if x != IGNORE_INDEX)
    return {"input_ids": ids[:max_len], "labels": labels[:max_len], "n_supervised": kept, "n_lost": total_sup - kept,
            "truncated": len(ids) > max_len}


def encode_samples(tokenizer, conversations, eot_id: int, max_len: int, long_conversations: str = "split"
                   ) -> list[list[dict]]:
    """The samples of each conversation (default system prompt already applied), each a :func:`truncate` dict.

    ``long_conversations``: ``"split"`` cuts a conversation longer than ``max_len`` at turn boundaries
    (:func:`sft.long_conversations.split_conversation`; only a reply too long by itself is then truncated);
    ``"truncate"`` keeps its first ``max_len`` tokens. One list of samples per conversation, in order; the first
    sample's ``user_cut`` counts the conversation's user turns cut from the start (0 in the others).
    """
    out = []
    for messages, full in zip(conversations, encode_conversations(tokenizer, conversations, eot_id)):
        pieces, cut = ((([full], 0) if long_conversations != "split" or len(full[0]) <= max_len
                        else split_conversation(tokenizer, messages, eot_id, max_len, full)))
        out.append([dict(truncate(ids, labels, max_len), user_cut=cut if k == 0 else 0)
                    for k, (ids, labels) in enumerate(pieces)])
    return out


def encode_truncated(tokenizer, conv_messages, eot_id: int, max_len: int, system_message: Optional[str]) -> dict:
    """Encode one conversation (default system prompt applied) and :func:`truncate` it."""
    return encode_samples(tokenizer, [with_system(conv_messages, system_message)], eot_id, max_len, "truncate")[0][0]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the token ids: backend vocabulary/merges, added tokens, chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)).encode())
    h.update(json.dumps(tokenizer.get_added_vocab(), sort_keys=True).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()


def cache_key(data_path: str, tokenizer, settings: dict) -> str:
    h = hashlib.sha256()
    for part in (file_sha256(data_path), tokenizer_fingerprint(tokenizer), json.dumps(settings, sort_keys=True),
                 __version__, str(CACHE_FORMAT)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def default_cache_dir() -> str:
    return os.environ.get("SFT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sft", "datasets")


def _prepare(convs: list[Conversation], tokenizer, eot_id, max_len, system_message, num_proc, path: str,
             data_path: str, long_conversations: str):
    import datasets

    ds = datasets.Dataset.from_list([{"id": c.id, "messages": c.messages} for c in convs])

    def fn(batch):
        per_conv = encode_samples(tokenizer, [with_system(m, system_message) for m in batch["messages"]], eot_id,
                                  max_len, long_conversations)
        rows = [dict(r, id=rid, piece=k) for rid, samples in zip(batch["id"], per_conv) for k, r in enumerate(samples)]
        return {k: [r[k] for r in rows] for k in rows[0]}

    # new_fingerprint: the cache key already covers data, tokenizer and settings; it also spares
    # datasets from hashing the tokenizer inside ``fn``. A split conversation gives several rows, so every
    # input column is removed and ``id`` returned by ``fn``.
    ds = ds.map(fn, batched=True, batch_size=256, remove_columns=["id", "messages"], num_proc=num_proc,
                desc="tokenizing", load_from_cache_file=False, new_fingerprint=os.path.basename(path))
    pieces = ds["piece"]
    report = TruncationReport(
        samples=len(ds), truncated=int(sum(ds["truncated"])), supervised_tokens=int(sum(ds["n_supervised"])),
        supervised_tokens_lost=int(sum(ds["n_lost"])),
        dropped_ids=[i for i, n in zip(ds["id"], ds["n_supervised"]) if n == 0],
        conversations=len(convs), split=sum(1 for k in pieces if k == 1), user_turns_cut=int(sum(ds["user_cut"])),
        mode=long_conversations,
    )
    ds = ds.filter(lambda n: n > 0, input_columns=["n_supervised"], load_from_cache_file=False)
    if len(ds) == 0:  # nothing to cache (an empty saved dataset cannot be loaded back either)
        raise DataError(f"{data_path}: no sample has a supervised token within --model_max_length {max_len} "
                        f"({len(convs)} samples, all cut before their first reply ends); raise --model_max_length")
    ds = ds.remove_columns(["n_lost", "truncated", "piece", "user_cut"])
    tmp = f"{path}.tmp-{os.getpid()}"
    ds.save_to_disk(tmp)
    with open(os.path.join(tmp, "sft_report.json"), "w") as f:
        json.dump(report.__dict__, f)
    if os.path.exists(path):  # another process finished first; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)  # atomic: a half-written cache is never loaded


def _load(path: str):
    import datasets

    ds = datasets.load_from_disk(path)
    with open(os.path.join(path, "sft_report.json")) as f:
        report = TruncationReport(**json.load(f))
    return ds, report


def build_dataset(convs: list[Conversation], data_path: str, tokenizer, eot_id: int, max_len: int,
                  system_message: Optional[str] = None, cache_dir: Optional[str] = None,
                  num_proc: Optional[int] = None, name: str = "train",
                  main_process_first: Callable[..., ContextManager] = None, rank: int = 0,
                  long_conversations: str = "split"):
    """Return ``(dataset, TruncationReport)`` for ``convs`` read from ``data_path``.

    ``long_conversations`` (``"split"`` or ``"truncate"``): what becomes of a conversation longer than ``max_len``
    (:func:`encode_samples`).

    Rank coordination: ``main_process_first(desc=...)`` is a context manager under which global rank 0 runs
    first and the others wait (the Trainer's ``TrainingArguments.main_process_first(local=False)``); ``rank`` is
    this process's global rank. Defaults: a single process.

    The dataset has columns ``id`` (str; the samples of a split conversation share it), ``input_ids`` and
    ``labels`` (int lists, equal lengths, at most ``max_len``) and ``n_supervised`` (int). No ``length`` column: the Trainer drops columns the
    model's forward does not take before building its sampler, so ``--group_by_length`` measures
    ``input_ids`` itself.

    Raises:
        DataError: no sample has a supervised token left after truncation.
    """
    settings = {"max_len": max_len, "system_message": system_message, "ids": [c.id for c in convs],
                "long_conversations": long_conversations}
    key = cache_key(data_path, tokenizer, settings)
    root = cache_dir or default_cache_dir()
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, key)
    first = main_process_first or (lambda desc: contextlib.nullcontext())
    with first(desc=f"preparing {name} dataset"):
        if not os.path.exists(path):
            if rank != 0:
                logger.warning("rank %d: dataset cache %s is not visible here (cache folder not shared?); "
                               "preparing a local copy", rank, path)
            _prepare(convs, tokenizer, eot_id, max_len, system_message, num_proc, path, data_path, long_conversations)
        ds, report = _load(path)
    logger.info("%s dataset: %s (cache %s)", name, data_path, path)
    return ds, report


class LazySupervisedDataset(torch.utils.data.Dataset):
    """Encodes a conversation when it is indexed (``--lazy_preprocess``).

    ``__getitem__`` returns ``{"input_ids", "labels"}`` (lists of int). A sample left with no supervised
    token after truncation is logged by id and replaced by the next index (mod len), so the loss of a
    batch never divides by zero.
    """

    def __init__(self, convs: list[Conversation], tokenizer, eot_id: int, max_len: int, system_message: Optional[str],
                 data_path: str = "data"):
        self.convs, self.tokenizer, self.eot_id, self.data_path = convs, tokenizer, eot_id, data_path
        self.max_len, self.system_message = max_len, system_message
        self.report = TruncationReport(samples=len(convs))
        self._seen: set[int] = set()

    def __len__(self) -> int:
        return len(self.convs)

    def __getitem__(self, i: int) -> dict:
        if not -len(self.convs) <= i < len(self.convs):
            raise IndexError(i)  # ends plain iteration (``for x in dataset``), e.g. in LengthGroupedSampler
        for step in range(len(self.convs)):
            j = (i + step) % len(self.convs)
            conv = self.convs[j]
            ex = encode_truncated(self.tokenizer, conv.messages, self.eot_id, self.max_len, self.system_message)
            if j not in self._seen:
                self._seen.add(j)
                self.report.truncated += int(ex["truncated"])
                self.report.supervised_tokens_lost += ex["n_lost"]
                self.report.supervised_tokens += ex["n_supervised"]
                if ex["n_supervised"] == 0:
                    self.report.dropped_ids.append(conv.id)
                    logger.warning("sample id=%s has no supervised token within --model_max_length %d; using the "
                                   "next sample instead", conv.id, self.max_len)
            if ex["n_supervised"] > 0:
                return {"input_ids": ex["input_ids"], "labels": ex["labels"]}
        raise DataError(f"{self.data_path}: no sample has a supervised token within --model_max_length "
                        f"{self.max_len}; raise --model_max_length")


def make_collator(tokenizer, pad_to_multiple_of: int = 8) -> DataCollatorForSeq2Seq:
    """Dynamic padding to the longest sample of the batch, rounded up to ``pad_to_multiple_of``.

    The batch is ``input_ids`` (int64, [batch, seq]), ``attention_mask`` (int64, 1 = real token,
    0 = padding, set by position) and ``labels`` (int64, padding = -100). Thin wrapper over
    ``transformers.DataCollatorForSeq2Seq``; requires ``tokenizer.padding_side == "right"``.
    """
    return DataCollatorForSeq2Seq(tokenizer, padding="longest", pad_to_multiple_of=pad_to_multiple_of,
                                  label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
