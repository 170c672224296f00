"""Where a truncated sample was cut (the turn, as the record numbers it, and that turn's size in tokens), for the
preparation log and ``sft-show-sample``; and ``--long_conversations refuse``'s refusal of a turn that splitting would
cut (:func:`sft.data.encode.samples.encode_samples` uses both)."""
from __future__ import annotations

from typing import Optional, Sequence

from sft.data.records.messages import message_text
from sft.data.refusal import Refusal


def where_cut(ex: dict, sample_id: str, record=None) -> str:
    """Where a truncated sample (:func:`sft.data.encode.samples.encode_samples`' dict) was cut, for the log:
    ``record 12, id='a', turn 3 (9000 tokens)``: the record's turn (0-based, as the record numbers them) the cut falls
    in and that turn's own text in tokens as the template renders it."""
    at = f"record {record}, " if record is not None else ""
    return f"{at}id={sample_id!r}, {cut_turn_text(ex)}"


def cut_turn_text(ex: dict) -> str:
    """The turn a truncated sample was cut in and that turn's size: ``turn 3 (9000 tokens)``."""
    turn = ex.get("cut_turn")
    what = ("the --system_message" if turn == -1 else f"turn {turn}") if turn is not None else "a turn"
    return what + (f" ({ex['turn_tokens']} tokens)" if ex.get("turn_tokens") is not None else "")


def find_tokens(ids: list[int], part: list[int]) -> int:
    """The index of the first occurrence of ``part`` in ``ids`` (token ids), -1 where there is none."""
    import array

    if not part or len(part) > len(ids):
        return -1
    hay, needle, size = array.array("q", ids).tobytes(), array.array("q", part).tobytes(), 8
    at = hay.find(needle)
    while at != -1 and at % size:  # a match must start on a token's boundary
        at = hay.find(needle, at + 1)
    return at // size if at != -1 else -1


def cut_turn(text: str, ids: list[int], offsets: list, messages: Sequence[dict], cut_at: list[int]
              ) -> tuple[Optional[int], Optional[int]]:
    """``(turn, tokens)``: the index in ``messages`` of the turn whose text the cut falls in (``cut_at``: the first
    tokens cut off, found in ``ids``, the tokens of ``text``, the conversation's rendering, with their character
    ``offsets``), and the tokens of that turn's text there. Turns are found by their text (content, else reasoning),
    in order; where the cut tokens are not found (a piece tokenized on its own), the longest turn. ``(None, None)``
    where no turn's text is found."""
    starts = [s for s, _e in offsets]
    found = turn_texts(text, messages)
    if not found:
        return None, None
    sizes = turn_sizes(text, offsets, messages, found)
    j = find_tokens(ids, cut_at)
    if j == -1:
        k = max(sizes, key=sizes.get)
        return k, sizes[k]
    k = next((k for k, s, _e in reversed(found) if s <= starts[j]), found[0][0])
    return k, sizes[k]


def turn_texts(text: str, messages: Sequence[dict]) -> list[tuple[int, int, int]]:
    """``[(turn, start, end), ...]``: the characters of each turn's text (content, else reasoning) in ``text``, the
    conversation's rendering, found in order; a turn whose text is not found is left out."""
    found, cursor = [], 0
    for k, m in enumerate(messages):
        part = next((t.strip() for t in (message_text(m), m.get("reasoning_content"))
                     if isinstance(t, str) and t.strip()), "")
        at = text.find(part, cursor) if part else -1
        if at != -1:
            found.append((k, at, at + len(part)))
            cursor = at + len(part)
    return found


def turn_sizes(text: str, offsets: list, messages: Sequence[dict], found: Optional[list] = None) -> dict:
    """Per turn found in ``text`` (:func:`turn_texts`), the tokens of its text there (tokens at ``offsets``)."""
    from bisect import bisect_left

    starts = [s for s, _e in offsets]
    return {k: bisect_left(starts, e) - bisect_left(starts, s) for k, s, e in (found or turn_texts(text, messages))}


def name_cuts(samples: list, shift: int, locate) -> None:
    """Replace each truncated sample's ``cut_at`` (:func:`sft.data.encode.samples.truncate`) with ``cut_turn`` (the
    record's numbering: the conversation's index less ``shift``, the default system prompt's place) and ``turn_tokens``;
    ``locate(cut_at)`` is :func:`cut_turn` on the conversation's rendering."""
    for ex in samples:
        cut_at = ex.pop("cut_at", None)
        if cut_at is not None:
            turn, ex["turn_tokens"] = locate(cut_at)
            ex["cut_turn"] = turn - shift if turn is not None else None


def too_long(turn: Optional[int], tokens: Optional[int], max_len: int, what: str) -> Refusal:
    """``--long_conversations refuse``'s refusal of a conversation with a turn (``turn``, in the record's numbering;
    ``tokens``, its own text's size) too long for ``max_len`` with the context it needs; a record problem (exit 2
    under ``--on_bad_record error``)."""
    size = f" ({tokens} tokens)" if tokens is not None else ""
    name = "this turn" if turn is not None else what
    return Refusal(turn, f"{name}{size} does not fit in --model_max_length {max_len} with the context it needs (the "
                "system prompt, its user turn or reply), so it would be cut (--long_conversations refuse)",
                "shorten or remove the turn, raise --model_max_length, or pass --long_conversations split to train "
                   "its first tokens", kind="turn longer than --model_max_length")


def longest_pair(text: str, offsets: list, messages: Sequence[dict]) -> tuple[Optional[int], Optional[int]]:
    """``(turn, tokens)``: the user turn whose exchange (it and the reply after it) is the longest in ``text``, the
    conversation's rendering (tokens at character ``offsets``): where :func:`sft.data.encode.long_conversations.
    split_conversation` cut a user turn, the one that did not fit with its reply."""
    sizes = turn_sizes(text, offsets, messages)
    users = [k for k, m in enumerate(messages) if m["role"] == "user" and k in sizes]
    if not users:
        return None, None
    k = max(users, key=lambda u: sizes[u] + sizes.get(u + 1, 0))
    return k, sizes[k]
