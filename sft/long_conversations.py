"""``--long_conversations split``: a conversation over ``--model_max_length`` becomes several samples, cut at
turn boundaries, so that every reply that fits with its own user turn is supervised exactly once.

A conversation is ``[system,] (user, assistant) x n``; its *head* is the system turn (or whatever the chat
template puts first when there is none, e.g. SmolLM2's default system prompt). Each sample is

    head + context pairs (rendered, labels -100) + target pairs (supervised)

Target pairs are taken greedily in order, then the preceding pairs are added as context, the nearest
first, while they fit. The first sample's targets may fill it (nothing comes before them); a later
sample's targets take at most half of the room after the head (always at least one pair), so that its
replies are trained with at least about half a window of the conversation before them, at the cost of
about twice the tokens of a long conversation's own text (each token past the first window is seen
about twice: once as a target, once as context).

A pair whose reply cannot fit even alone (head + its user turn + reply + end-of-turn token > ``max_len``)
becomes a sample of its own with its user turn cut from the start (its last words kept, as many as fit):
the reply is then trained whole. Only when the reply itself is too long (it does not fit even after a
user turn of one character) the user turn keeps at most half of the sample, and the sample is returned
longer than ``max_len`` for the caller to truncate and report (:func:`sft.dataset.truncate`): the reply's
first tokens are trained.

Every sample is encoded by :func:`sft.chat.encode_conversations` (ids and labels built together, exactly
``apply_chat_template`` of the sample's messages); token counts read off the conversation's own encoding
only plan the cuts, and a plan whose encoded sample is longer than planned (a template whose turns do not add
up token for token) is planned again with a smaller budget, so no sample that holds more than one reply
exceeds ``max_len``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from .chat import IGNORE_INDEX, encode_conversations
from .errors import TemplateError

Sample = tuple[list[int], list[int]]
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]


class Split(NamedTuple):
    """What :func:`split_conversation` made: the samples, and how many user turns it cut from the start."""

    samples: list[Sample]
    user_turns_cut: int


def split_conversation(tokenizer, messages: Sequence[dict], eot_id: int, max_len: int,
                       full: Optional[Sample] = None) -> Split:
    """Cut one conversation into samples of at most ``max_len`` tokens at turn boundaries.

    Args:
        tokenizer: a fast tokenizer with a chat template.
        messages: ``[system,] user, assistant, ...`` dicts ``{"role", "content"}``, validated, the default
            system prompt already applied (:func:`sft.chat.with_system`).
        eot_id: the end-of-turn token id (:func:`sft.chat.end_of_turn_id`).
        max_len: ``--model_max_length`` in tokens.
        full: the conversation's own ``(input_ids, labels)`` if already encoded (saves one encoding).

    Returns:
        :class:`Split`: ``samples`` = ``[(input_ids, labels), ...]`` in conversation order (lists of int of
        equal length; labels ``-100`` outside the supervised replies), the whole conversation unchanged when
        it fits; each assistant reply is supervised (its content + end-of-turn token) in exactly one sample.
        Only a sample holding a single reply too long for ``max_len`` by itself is longer than ``max_len``.
        ``user_turns_cut``: user turns shortened from the start to fit with their reply.

    Raises:
        TemplateError: as :func:`sft.chat.encode_conversations`.
    """
    messages = list(messages)
    if full is None:
        full = encode_conversations(tokenizer, [messages], eot_id)[0]
    if len(full[0]) <= max_len:
        return Split([full], 0)
    head = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(head):]
    pairs = [body[k:k + 2] for k in range(0, len(body), 2)]
    if len(pairs) == 1:
        sample, cut = _fit_pair(tokenizer, head, *pairs[0], eot_id, max_len)
        return Split([sample], int(cut))
    lengths, costs, head_len = _estimate(tokenizer, head, full, eot_id, len(pairs))
    budget = max_len
    while True:
        plan = _plan(lengths, costs, head_len, max_len, budget)
        todo = [k for k, (_c, i, _j) in enumerate(plan) if lengths[i] <= max_len]
        encoded = encode_conversations(tokenizer, [head + [m for p in pairs[c:j] for m in p] for c, i, j in
                                                   (plan[k] for k in todo)], eot_id,
                                       [plan[k][1] - plan[k][0] for k in todo]) if todo else []
        over = {k: len(ids) - max_len for k, (ids, _) in zip(todo, encoded) if len(ids) > max_len}
        if not over:
            break
        # The template does not add up token for token: a lone pair over the limit is too long after all;
        # otherwise plan again with the measured overflow taken off the budget. Each round marks a pair or
        # lowers the budget, so this ends (at worst with one pair per sample).
        alone_over = [plan[k][1] for k in over if plan[k][0] == plan[k][1] and plan[k][2] == plan[k][1] + 1]
        for i in alone_over:
            lengths[i] = max_len + 1
        if not alone_over:
            budget -= max(over.values())
    fitted = {k: _fit_pair(tokenizer, head, *pairs[i], eot_id, max_len)  # too long alone: user turn cut
              for k, (_c, i, _j) in enumerate(plan) if lengths[i] > max_len}
    samples = [fitted[k][0] if k in fitted else None for k in range(len(plan))]
    for k, sample in zip(todo, encoded):
        samples[k] = sample
    return Split(samples, sum(cut for _sample, cut in fitted.values()))


def _estimate(tokenizer, head: list[dict], full: Sample, eot_id: int, n_pairs: int
              ) -> tuple[list[int], list[int], int]:
    """Planning estimates ``(lengths, costs, head_len)`` in tokens: ``lengths[i]`` of head + pair i alone,
    ``costs[i]`` of pair i after the head, ``head_len`` of the head (and anything the template adds once).

    Read off the full encoding: pair i ends at its reply's end-of-turn token (the i-th supervised ``eot_id``),
    so pair i (i >= 1) costs the tokens between two such ends; the head comes from a probe conversation
    (``2 x len(head + probe) - len(head + probe + probe)``). Exact when the template's turns add up token for
    token (turns separated by special tokens: ChatML, SmolLM2, Qwen); only the cut plan uses them, and
    :func:`split_conversation` checks every sample it encodes.
    """
    ids, labels = full
    ends = [k for k, (t, lab) in enumerate(zip(ids, labels)) if lab == eot_id and t == eot_id]
    one, two = encode_conversations(tokenizer, [head + _PROBE, head + _PROBE + _PROBE], eot_id)
    head_len = max(0, 2 * len(one[0]) - len(two[0]))
    tail = len(ids) - ends[-1] - 1  # tokens after the last reply's end (e.g. ChatML's "\n")
    costs = [ends[0] + 1 + tail - head_len] + [b - a for a, b in zip(ends, ends[1:])]
    if len(costs) != n_pairs:  # labels_from_spans closes every reply with eot_id, so this means a broken template
        raise TemplateError(f"found {len(costs)} closed replies in a conversation of {n_pairs}; the chat template "
                            "does not end each assistant turn with its end-of-turn token")
    return [head_len + c for c in costs], costs, head_len


def _fit_pair(tokenizer, head: list[dict], user: dict, reply: dict, eot_id: int, max_len: int) -> tuple[Sample, bool]:
    """head + (user turn cut from the start) + reply: the longest tail of the user's text (starting at a word when
    it can) with which the sample fits ``max_len``; if none fits (the reply alone is too long), the longest
    tail with which the reply starts within the first half of the sample (the caller truncates it).
    Returns ``(sample, whether the user turn was cut)``."""
    text = user["content"]

    def encode(keep: int) -> Sample:
        tail = text[len(text) - keep:]
        words = tail.split(None, 1)
        if keep < len(text) and len(words) == 2 and not text[len(text) - keep - 1].isspace():
            tail = words[1]  # start at a word boundary
        return encode_conversations(tokenizer, [head + [dict(user, content=tail), reply]], eot_id)[0]

    def fits(sample: Sample) -> bool:
        return len(sample[0]) <= max_len

    def reply_in_first_half(sample: Sample) -> bool:
        return next(k for k, x in enumerate(sample[1]) if x != IGNORE_INDEX) <= max_len // 2

    ok = fits if fits(encode(1)) else reply_in_first_half
    lo, hi = 1, len(text)  # ok(encode(lo)) holds (or nothing better exists); find the largest such keep
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(encode(mid)):
            lo = mid
        else:
            hi = mid - 1
    return encode(lo), lo < len(text)


def _plan(lengths: list[int], costs: list[int], head_len: int, max_len: int, budget: int) -> list[tuple[int, int, int]]:
    """Greedy cut plan: one ``(context_start, target_start, target_end)`` range of pair indices per sample.

    The first sample's replies fill the whole ``budget`` (there is nothing before them); a later sample's replies
    (at least one) take at most half of what the head leaves, and context fills the rest.
    """
    plan, i, n = [], 0, len(lengths)
    while i < n:
        used, j = lengths[i], i + 1
        targets = budget if i == 0 else head_len + (budget - head_len) // 2
        if lengths[i] <= max_len:
            while j < n and lengths[j] <= max_len and used + costs[j] <= targets:
                used, j = used + costs[j], j + 1
        c = i
        while c > 0 and lengths[i] <= max_len and used + costs[c - 1] <= budget:
            used, c = used + costs[c - 1], c - 1
        plan.append((c, i, j))
        i = j
    return plan

