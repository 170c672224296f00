"""Tokenize many texts that share long prefixes (the samples of one conversation under a history-rewriting chat
template: each holds the history before its reply) with each shared prefix tokenized once.

A text is cut where a special token of :func:`sft.data.encode.long_conversations.cut_tokens` starts, inside the prefix
it shares with the text before it in its group: the tokenizer finds such a token in the raw text before any other work,
so the tokens before the cut are the earlier text's tokens there and the tokens from the cut on are those of the rest
tokenized alone (offsets moved by the cut). Every other text is tokenized whole. The result is the same ids and offsets
as tokenizing every text whole (checked in tests/unit/data/test_template_families.py).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Optional, Sequence

from sft.data.encode import long_conversations


def tokenize_shared(tokenizer, texts: Sequence[str], groups: Sequence,
                    known: Optional[dict] = None) -> list[tuple[list[int], list[tuple]]]:
    """``[(ids, offsets), ...]`` of ``texts`` (``offsets``: each token's ``(start, end)`` characters), as
    ``tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)`` gives them, in one batched call.

    Args:
        texts: the texts, each group's in order.
        groups: per text, its group (e.g. the conversation); a text may reuse the tokens of the text before it in
            the same group.
        known: per index of ``texts``, its ``(ids, offsets)`` already made (by an earlier call): returned as they
            are, not tokenized again, and reused by the text after it as any other.
    """
    cut = long_conversations.cut_tokens(tokenizer)
    strings = sorted({tokenizer.convert_ids_to_tokens(i) for i in cut}, key=len, reverse=True)
    known = known or {}
    plan, pieces = [], []  # per text: (previous text's index or -1, cut character); the text tokenized from there
    for k, text in enumerate(texts):
        if k in known:
            plan.append(None)
            continue
        prev, at = -1, 0
        if strings and k > 0 and groups[k] == groups[k - 1]:
            common = common_prefix_length(texts[k - 1], text)
            at = max((text.rfind(s, 0, common) for s in strings), default=-1)  # a cut token inside the prefix
            prev = k - 1 if at > 0 else -1
        plan.append((prev, at if prev >= 0 else 0))
        pieces.append(text[at:] if prev >= 0 else text)
    enc = tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True, verbose=False,
                    return_attention_mask=False) if pieces else {"input_ids": [], "offset_mapping": []}
    out: list = []
    made = iter(zip(enc["input_ids"], enc["offset_mapping"]))
    for k, step in enumerate(plan):
        if step is None:
            out.append(known[k])
            continue
        (prev, at), (ids, offs) = step, next(made)
        if prev >= 0:
            p_ids, p_offs = out[prev]
            t = bisect_left(p_offs, (at, -1))
            if t < len(p_ids) and p_offs[t][0] == at and p_ids[t] in cut and ids and ids[0] == p_ids[t]:
                out.append((p_ids[:t] + ids, p_offs[:t] + [(s + at, e + at) for s, e in offs]))
                continue
            whole = tokenizer(texts[k], add_special_tokens=False, return_offsets_mapping=True, verbose=False,
                              return_attention_mask=False)  # the cut is not a token boundary there: rare
            ids, offs = whole["input_ids"], whole["offset_mapping"]
        out.append((list(ids), list(offs)))
    return out


def common_prefix_length(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, by bisection on slice comparisons (C-speed
    ``memcmp``s; ``os.path.commonprefix`` walks the characters in Python)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
