"""The truncation report: what preparing a source cost, counted sample by sample and conversation by conversation
(:func:`sft.data.encode.samples.encode_samples`' samples), merged over shards, and said in lines for the run's log."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from sft.data.encode.conversation_samples import ConversationSamples
from sft.data.encode.cut_turns import where_cut


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
    rewritten: int = 0  # conversations the chat template made several samples of (sft.data.encode.turns)
    extra_samples: int = 0
    extra_tokens: int = 0
    dropped_chars: int = 0  # characters the template dropped (--allow_dropped_content True)
    dropped_conversations: int = 0
    cut_ids: list = field(default_factory=list)  # the first 10 records whose user turn was cut from the start
    cut_turns: list = field(default_factory=list)  # the first 10 truncated samples: record, id, turn, its tokens

    @property
    def kept(self) -> int:
        return self.samples - self.n_dropped

    def count(self, ex: dict, sample_id: str, record=None) -> None:
        """Add one encoded sample (a :func:`truncate` dict) of record number ``record`` to the counts."""
        self.samples += 1
        self.truncated += int(ex["truncated"])
        if ex["truncated"] and len(self.cut_turns) < 10:
            self.cut_turns.append(where_cut(ex, sample_id, record))
        self.supervised_tokens += ex["n_supervised"]
        self.supervised_tokens_lost += ex["n_lost"]
        if ex["n_supervised"] == 0:
            self.n_dropped += 1
            if len(self.dropped_ids) < 50:
                self.dropped_ids.append(sample_id)

    def count_conversation(self, samples: ConversationSamples, sample_id: str, record=None) -> None:
        """Add the samples of one conversation (:func:`sft.data.encode.samples.encode_samples`; record number
        ``record``) to the counts."""
        self.conversations += 1
        extra = samples.extra_samples
        self.split += int(len(samples) - extra > 1)
        self.user_turns_cut += samples[0].get("user_cut", 0)
        if samples[0].get("user_cut", 0) and len(self.cut_ids) < 10:
            self.cut_ids.append(sample_id)
        self.rewritten += int(extra > 0)
        self.extra_samples += extra
        self.extra_tokens += samples.extra_tokens
        self.dropped_chars += samples.dropped
        self.dropped_conversations += int(samples.dropped > 0)
        for ex in samples:
            self.count(ex, sample_id, record)

    @classmethod
    def merge(cls, parts: Sequence[dict]) -> "TruncationReport":
        out = cls()
        for d in parts:
            for k in ("samples", "truncated", "supervised_tokens", "supervised_tokens_lost", "n_dropped",
                      "conversations", "split", "user_turns_cut", "rewritten", "extra_samples", "extra_tokens",
                      "dropped_chars", "dropped_conversations"):
                setattr(out, k, getattr(out, k) + d[k])
            out.mode = d["mode"]
            out.dropped_ids += d["dropped_ids"][:50 - len(out.dropped_ids)]
            out.cut_ids += d.get("cut_ids", [])[:10 - len(out.cut_ids)]
            out.cut_turns += d.get("cut_turns", [])[:10 - len(out.cut_turns)]
        return out

    def lines(self, name: str, max_len: int) -> list[str]:
        source = f" from {self.conversations} conversations" if self.conversations else ""
        out = [f"{name}: {self.kept} of {self.samples} samples kept{source}, "
               f"{self.supervised_tokens} supervised tokens"]
        if self.rewritten:
            out.append(f"{name}: the chat template renders earlier turns differently once later turns exist: "
                       f"{self.rewritten} conversations became {self.rewritten + self.extra_samples} samples (each "
                       f"reply trained once, in the context it has at inference), {self.extra_tokens} extra tokens")
        if self.dropped_chars:
            out.append(f"{name}: the chat template dropped {self.dropped_chars} characters of "
                       f"{self.dropped_conversations} conversations (--allow_dropped_content True)")
        if self.split:
            pieces = self.samples - self.extra_samples - (self.conversations - self.split)
            out.append(f"{name}: {self.split} of {self.conversations} conversations longer than --model_max_length "
                       f"{max_len} were split at turn boundaries into {pieces} samples (earlier turns as unsupervised "
                       "context)")
        if self.user_turns_cut:
            ids = ", ".join(map(str, self.cut_ids)) + (" ..." if self.user_turns_cut > len(self.cut_ids) else "")
            out.append(f"{name}: {self.user_turns_cut} user turns too long to fit with their reply within "
                       f"--model_max_length {max_len} were cut from the start (their last words kept): {ids}")
        more = self.truncated > len(self.cut_turns)
        where = (": " + "; ".join(self.cut_turns) + (f" ... (the first {len(self.cut_turns)})" if more else "")
                 if self.cut_turns else "")
        if self.truncated and self.mode == "split":
            out.append(f"{name}: {self.truncated} replies are too long for --model_max_length {max_len} by themselves "
                       f"(with the system prompt): their first tokens are trained, {self.supervised_tokens_lost} "
                       f"supervised tokens lost{where}")
        elif self.truncated:
            out.append(f"{name}: {self.truncated} of {self.samples} samples longer than --model_max_length "
                       f"{max_len} were truncated; {self.supervised_tokens_lost} supervised tokens lost "
                       f"(--long_conversations split keeps them){where}")
        if self.n_dropped:
            ids = ", ".join(map(str, self.dropped_ids)) + (" ..." if self.n_dropped > len(self.dropped_ids) else "")
            out.append(f"{name}: dropped {self.n_dropped} sample(s) left with no supervised token after "
                       f"truncation: {ids} (raise --model_max_length to keep them)")
        return out
