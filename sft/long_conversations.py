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
about twice: once as a target, once as context). A pair whose reply cannot fit even alone (head + its user turn + reply
+ end-of-turn token > ``max_len``) becomes a sample of its own, returned longer than ``max_len`` for the
caller to truncate and report (:func:`sft.dataset.truncate`); its first tokens are still trained, or the
sample is dropped when the cut falls before the reply.

Every sample is encoded by :func:`sft.chat.encode_conversations` (ids and labels built together, exactly
``apply_chat_template`` of the sample's messages); token counts from a pair's standalone encoding only
plan the cuts, and a plan whose encoded sample is longer than planned (a template whose turns do not add
up token for token) is planned again with a smaller budget, so no sample that holds more than one reply
exceeds ``max_len``.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .chat import encode_conversations

Sample = tuple[list[int], list[int]]


def split_conversation(tokenizer, messages: Sequence[dict], eot_id: int, max_len: int,
                       full: Optional[Sample] = None) -> list[Sample]:
    """Cut one conversation into samples of at most ``max_len`` tokens at turn boundaries.

    Args:
        tokenizer: a fast tokenizer with a chat template.
        messages: ``[system,] user, assistant, ...`` dicts ``{"role", "content"}``, validated, the default
            system prompt already applied (:func:`sft.chat.with_system`).
        eot_id: the end-of-turn token id (:func:`sft.chat.end_of_turn_id`).
        max_len: ``--model_max_length`` in tokens.
        full: the conversation's own ``(input_ids, labels)`` if already encoded (saves one encoding).

    Returns:
        ``[(input_ids, labels), ...]`` in conversation order (lists of int of equal length; labels
        ``-100`` outside the supervised replies). The whole conversation unchanged when it fits. Each
        assistant reply is supervised (its content + end-of-turn token) in exactly one sample. Only a
        sample holding a single reply that cannot fit even alone is longer than ``max_len``.

    Raises:
        TemplateError: as :func:`sft.chat.encode_conversations`.
    """
    messages = list(messages)
    if full is None:
        full = encode_conversations(tokenizer, [messages], eot_id)[0]
    if len(full[0]) <= max_len:
        return [full]
    head = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(head):]
    pairs = [body[k:k + 2] for k in range(0, len(body), 2)]
    if len(pairs) == 1:
        return [full]
    alone = encode_conversations(tokenizer, [head + p for p in pairs], eot_id)
    lengths = [len(ids) for ids, _ in alone]
    # head + pairs add up token for token when turns are separated by special tokens (ChatML and most
    # templates): sum(alone) = n * head + sum(pairs) and full = head + sum(pairs), so head is exact then.
    head_len = max(0, (sum(lengths) - len(full[0])) // (len(pairs) - 1))
    costs = [n - head_len for n in lengths]
    budget = max_len
    while True:
        plan = _plan(lengths, costs, head_len, max_len, budget)
        todo = [k for k, (c, i, j) in enumerate(plan) if not (c == i and j == i + 1)]
        encoded = encode_conversations(tokenizer, [head + [m for p in pairs[c:j] for m in p] for c, i, j in
                                                   (plan[k] for k in todo)], eot_id,
                                       [plan[k][1] - plan[k][0] for k in todo]) if todo else []
        over = max((len(ids) - max_len for ids, _ in encoded), default=0)
        if over <= 0:
            break
        budget -= over  # the template is not additive: plan again with the measured overflow taken off
    samples: list[Sample] = [alone[i] for _c, i, _j in plan]  # single-reply samples are the standalone encodings
    for k, sample in zip(todo, encoded):
        samples[k] = sample
    return samples


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

