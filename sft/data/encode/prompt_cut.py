"""A sample's tokens break where each trained reply's generation prompt ends: the prompt's tokens are the prompt's own.

At inference the prompt (``render(turns[:k], add_generation_prompt=True)``) is tokenized alone and the model generates
after its last token. Tokenizing a sample's whole text can let a reply's first token swallow the end of its prompt:
under Qwen's vocabulary a prompt ending in ``<think>\\n`` before a reply starting ``\\n</think>`` makes one ``\\n\\n``
token across the two, a context the model never meets at inference. Where a token crosses a trained reply's start,
the text is tokenized in pieces cut there (prompt, then reply and what follows), so the sample's tokens up to the
reply are those of its prompt tokenized alone and the reply's labels start right after them. A sample of several
replies with such a token at an earlier reply's start cannot give both replies their prompts' tokens (the later one's
prompt, tokenized alone, holds the token across): the earlier reply becomes a sample of its own. Every other text keeps
its whole tokenization (the same ids and offsets as before).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Sequence


def crossed(offsets: Sequence[tuple[int, int]], at: int) -> bool:
    """Whether a token spans character ``at`` (starts before it, ends after it). ``offsets``: each token's ``(start,
    end)`` characters, rising."""
    t = bisect_left(offsets, (at, -1))  # the first token starting at or after ``at``
    return t > 0 and offsets[t - 1][0] < at < offsets[t - 1][1]


def tokenized_apart(tokenizer, text: str, at: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``(ids, offsets)`` of ``text[:at]`` and ``text[at:]`` tokenized apart (``add_special_tokens=False``), the
    second's offsets moved to ``text``'s characters."""
    enc = tokenizer([text[:at], text[at:]], add_special_tokens=False, return_offsets_mapping=True, verbose=False,
                    return_attention_mask=False)
    (a_ids, b_ids), (a_offs, b_offs) = enc["input_ids"], enc["offset_mapping"]
    return list(a_ids) + list(b_ids), list(a_offs) + [(s + at, e + at) for s, e in b_offs]


def samples_at_prompts(tokenizer, text: str, ids: list[int], offsets: list[tuple[int, int]],
                       spans: Sequence[tuple[int, int]]) -> list[tuple[str, list[int], list[tuple[int, int]], list]]:
    """A sample's ``(text, ids, offsets, spans)`` with every trained reply's context its prompt's own tokens: usually
    the sample itself; where a token crosses the last reply's start, its text tokenized apart there; where a token
    crosses an earlier reply's start, that reply (with the replies before it) becomes a sample of its own, its text
    ending with the token that closes it (the later replies' contexts hold it tokenized as its prompt alone would be:
    as inference renders the history).

    Args:
        tokenizer: the fast tokenizer ``ids`` and ``offsets`` come from (``add_special_tokens=False``).
        text: a sample's text; ``ids``, ``offsets``: its tokens as tokenizing it whole gives them (offsets rising).
        spans: each trained reply's ``(start, end)`` characters in order (start: where its generation prompt ends;
            end: where the token that closes it starts).

    Returns:
        The samples in text order, each ``(text, ids, offsets, spans)``: lists of int and of ``(start, end)`` pairs.
    """
    out = []
    while True:
        if crossed(offsets, spans[-1][0]):
            ids, offsets = tokenized_apart(tokenizer, text, spans[-1][0])
        j = next((j for j in range(len(spans) - 2, -1, -1) if crossed(offsets, spans[j][0])), None)
        out.append((text, ids, offsets, list(spans[j + 1:] if j is not None else spans)))
        if j is None:
            return out[::-1]
        t = bisect_left(offsets, (spans[j][1], -1))  # the token that closes reply j
        text, spans = text[:offsets[t][1] if t < len(offsets) else spans[j][1]], spans[:j + 1]
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False,
                        return_attention_mask=False)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
