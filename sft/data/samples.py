"""One conversation -> its training samples (ids and labels, split or truncated to ``model_max_length``) and the
report of what that cost. Pure: no files, no ranks (:mod:`sft.data.dataset` writes the samples into shards)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from sft.data.chat import IGNORE_INDEX, encode_conversations, with_system
from sft.data.long_conversations import split_conversation

logger = logging.getLogger(__name__)


@dataclass
class TruncationReport:
    """What truncation to ``model_max_length`` cost: counts are samples, lost tokens are supervised tokens."""

    samples: int = 0
    truncated: int = 0
    supervised_tokens: int = 0
    supervised_tokens_lost: int = 0
    dropped_ids: list = field(default_factory=list)  # the first 50
    n_dropped: int = 0
    conversations: int = 0
    split: int = 0
    user_turns_cut: int = 0
    mode: str = "truncate"

    @property
    def kept(self) -> int:
        return self.samples - self.n_dropped

    def count(self, ex: dict, sample_id: str) -> None:
        """Add one encoded sample (a :func:`truncate` dict) to the counts."""
        self.samples += 1
        self.truncated += int(ex["truncated"])
        self.supervised_tokens += ex["n_supervised"]
        self.supervised_tokens_lost += ex["n_lost"]
        if ex["n_supervised"] == 0:
            self.n_dropped += 1
            if len(self.dropped_ids) < 50:
                self.dropped_ids.append(sample_id)

    def count_conversation(self, samples: Sequence[dict], sample_id: str) -> None:
        """Add the samples of one conversation (:func:`encode_samples`) to the counts."""
        self.conversations += 1
        self.split += int(len(samples) > 1)
        self.user_turns_cut += samples[0].get("user_cut", 0)
        for ex in samples:
            self.count(ex, sample_id)

    @classmethod
    def merge(cls, parts: Sequence[dict]) -> "TruncationReport":
        out = cls()
        for d in parts:
            for k in ("samples", "truncated", "supervised_tokens", "supervised_tokens_lost", "n_dropped",
                      "conversations", "split", "user_turns_cut"):
                setattr(out, k, getattr(out, k) + d[k])
            out.mode = d["mode"]
            out.dropped_ids += d["dropped_ids"][:50 - len(out.dropped_ids)]
        return out

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
        if self.n_dropped:
            ids = ", ".join(map(str, self.dropped_ids)) + (" ..." if self.n_dropped > len(self.dropped_ids) else "")
            out.append(f"{name}: dropped {self.n_dropped} sample(s) left with no supervised token after "
                       f"truncation: {ids} (raise --model_max_length to keep them)")
        return out


def truncate(ids: list[int], labels: list[int], max_len: int) -> dict:
    """Keep the first ``max_len`` tokens (right truncation) and count what it cost.

    Returns:
        dict with ``input_ids``, ``labels`` (lists of int, length <= max_len), ``n_supervised`` (kept),
        ``n_lost`` (supervised tokens cut off) and ``truncated`` (bool).
    """
    total_sup = len(labels) - labels.count(IGNORE_INDEX)
    kept = min(len(labels), max_len) - labels[:max_len].count(IGNORE_INDEX)
    return {"input_ids": ids[:max_len], "labels": labels[:max_len], "n_supervised": kept, "n_lost": total_sup - kept,
            "truncated": len(ids) > max_len}


def encode_samples(tokenizer, conversations: Sequence[list[dict]], eot_id: int, max_len: int,
                   system_message: Optional[str], long_conversations: str = "split") -> list[list[dict]]:
    """The training samples of each conversation (default system prompt applied), one batched tokenizer call.

    ``long_conversations``: ``"split"`` cuts a conversation longer than ``max_len`` at turn boundaries
    (:func:`sft.data.long_conversations.split_conversation`; only a reply too long by itself is then truncated);
    ``"truncate"`` keeps its first ``max_len`` tokens. Returns one list of samples per conversation, in order;
    each sample is a :func:`truncate` dict, and the first sample's ``user_cut`` counts the conversation's user
    turns cut from the start (0 in the others). This is the one place where a conversation becomes samples.
    """
    conversations = [with_system(m, system_message) for m in conversations]
    out = []
    for messages, full in zip(conversations, encode_conversations(tokenizer, conversations, eot_id)):
        pieces, cut = (([full], 0) if long_conversations != "split" or len(full[0]) <= max_len
                       else split_conversation(tokenizer, messages, eot_id, max_len, full))
        out.append([dict(truncate(ids, labels, max_len), user_cut=cut if k == 0 else 0)
                    for k, (ids, labels) in enumerate(pieces)])
    return out


def encode_truncated(tokenizer, conv_messages, eot_id: int, max_len: int, system_message: Optional[str]) -> dict:
    """The first sample of one conversation (see :func:`encode_samples`)."""
    return encode_samples(tokenizer, [conv_messages], eot_id, max_len, system_message, "truncate")[0][0]


def limit_tokenizer_threads(processes_per_node: int) -> None:
    """Share this node's cores among the processes that tokenize on it (``processes_per_node``: local ranks x
    ``--preprocessing_num_workers``), unless the user chose: the fast tokenizer's batch call otherwise runs one
    thread per core in every process (``processes_per_node`` x cores threads on the node). Sets
    ``RAYON_NUM_THREADS`` (the tokenizer's thread pool; read when the pool starts, at its first parallel call) to
    cores // processes, or ``TOKENIZERS_PARALLELISM=false`` where that is 1 thread (which also spares forked workers
    the tokenizers library's warning). Cores: those this process may run on (``os.sched_getaffinity``)."""
    if "TOKENIZERS_PARALLELISM" in os.environ or "RAYON_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, processes_per_node))
    if threads == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    else:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    logger.debug("tokenizer threads per process: %d (%d cores, %d processes)", threads, cores, processes_per_node)
