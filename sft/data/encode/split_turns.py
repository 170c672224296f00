"""``--long_conversations split`` for conversations planned reply by reply (:mod:`sft.data.encode.turns`: tool calls and
results, reasoning, per-reply flags, templates that rewrite history): a conversation whose samples are longer than
``--model_max_length`` is cut at turn boundaries into pieces that each fit, every trained reply trained in exactly one.

A conversation is ``[system,] body``; the body is cut into *units* before each user turn and before each run of tool
results, so a unit is ``user, assistant`` or ``tool results, assistant`` (the assistant turn may hold calls). A piece
is

    head + [the round's user turn, the calls answered] + context units + target units

where the head is the system turn; when the piece's first unit starts with tool results, the user turn of its round
(the last user turn before it) and the assistant turn whose calls they answer come first, as context: a reply is
never trained without the query it works on, nor a tool result shown without its call (templates such as Qwen3's
also need a user turn). Target units are taken greedily, context units added nearest first, with the cut rules of
:mod:`sft.data.encode.long_conversations` (``plan_pieces``: the first piece's targets may fill it, a later piece's
targets take at most half of the room after the head). Each piece is then encoded by the definition with only its target
units' replies trained (:func:`sft.data.encode.turns.plan`; a piece may itself be several samples where the template
rewrites history), so its labels are those of inference for that context. Unit lengths for the plan are read off the
whole conversation's rendering; a piece encoded longer than planned is planned again with a smaller budget, and a piece
of one target unit that does not fit even alone is returned whole for the caller to truncate and report.
"""
from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass
from typing import Optional, Sequence

from sft.data.encode.prompt_cut import samples_at_prompts
from sft.data.encode.shared_prefix import tokenize_shared
from sft.data.encode.turns import TurnPlan, plan, render_with_tools
from sft.data.records.messages import message_text
from sft.data.template.profile import template_profile


def units_of(messages: Sequence[dict]) -> tuple[int, list[tuple[int, int]]]:
    """``(head, units)``: how many leading messages are the head (0 or 1: a system turn) and each unit's
    ``(start, end)`` message indices (see the module docstring)."""
    head = 1 if messages and messages[0]["role"] == "system" else 0
    starts = [k for k in range(head, len(messages)) if k == head or messages[k]["role"] == "user"
              or (messages[k]["role"] == "tool" and messages[k - 1]["role"] == "assistant")]
    return head, list(zip(starts, starts[1:] + [len(messages)]))


@dataclass(frozen=True)
class SplitOptions:
    """How :func:`split_turns` cuts: ``max_len`` (tokens per piece) and the tokens that close a reply, as texts
    (``stops``) and as ids (``closing``: an id or a frozenset of ids) (:func:`sft.data.encode.turns.stop_tokens`)."""
    max_len: int
    stops: Sequence[str]
    closing: object


@dataclass(frozen=True)
class Known:
    """What the caller already made for the conversation, both optional: ``whole``, its plan
    (:func:`sft.data.encode.turns.plan` of the messages): a piece that starts with the conversation takes its replies
    from it
    instead of rendering them again (as a piece does from an earlier piece with the same first unit, after an
    overflow), and its rendering of the whole conversation serves the estimates; ``tokenized``, ``(text, offsets)`` of
    a text already tokenized (the caller's longest sample): where it is the whole conversation's rendering, the
    estimates read its offsets instead of tokenizing it again."""
    whole: Optional[TurnPlan] = None
    tokenized: Optional[tuple] = None


def split_turns(tokenizer, messages: Sequence[dict], tools: Optional[list], trained: Sequence[int],
                options: SplitOptions, known: Known = Known()) -> list[tuple[list[int], list[int]]]:
    """The pieces of one conversation as ``[(input_ids, labels), ...]`` (see the module docstring): the plan
    (:func:`sft.data.encode.long_conversations.plan_pieces`) made again with a smaller budget while a piece of several
    units
    is encoded longer than ``max_len``; a unit longer than estimated even alone becomes a piece of its own.

    Args:
        messages: validated messages (the default system prompt applied); ``tools``: the record's tools or None.
        trained: indices of the assistant turns to train (:func:`sft.data.encode.turns.trained_turns`).
        options: ``max_len`` and the tokens that close a reply (:class:`SplitOptions`).
        known: what the caller already made (:class:`Known`).

    Raises:
        TemplateError: as :func:`sft.data.encode.turns.plan`, for a piece.
    """
    from sft.data.encode.long_conversations import plan_pieces

    conv = _Pieces(tokenizer, list(messages), tools, set(trained), options, known.whole)
    costs, head_len, user_len = conv.estimate(known.whole.rendering if known.whole is not None else None,
                                              known.tokenized)
    max_len, units = options.max_len, conv.units
    lengths = [head_len + costs[u] + (user_len[u] if conv.messages[a]["role"] == "tool" else 0)
               for u, (a, _b) in enumerate(units)]
    useful = [any(k in conv.trained for k in range(a, b)) for a, b in units]
    budget = max_len
    while True:
        cuts = [(c, i, j) for c, i, j in plan_pieces(lengths, costs, head_len, max_len, budget) if any(useful[i:j])]
        pieces = conv.encode_all(cuts)
        over = [max(len(ids) for ids, _ in p) - max_len for (c, i, j), p in zip(cuts, pieces)
                if j - i > 1 or c < i]
        over = [x for x in over if x > 0]
        alone = [i for (c, i, j), p in zip(cuts, pieces) if j - i == 1 and c == i and lengths[i] <= max_len
                 and max(len(ids) for ids, _ in p) > max_len]
        if not over and not alone:
            return [s for p in pieces for s in p]
        for i in alone:  # longer than estimated even alone: a piece of its own, truncated by the caller
            lengths[i] = max_len + 1
        if over and not alone:
            budget -= max(over)
            if budget <= head_len:
                lengths = [max_len + 1] * len(lengths)  # one unit per piece, each truncated where it must be


class _Pieces:
    """One conversation being cut: its units, and what its pieces' encodings share across the budget rounds of
    :func:`split_turns` (a cut ``(c, i, j)``: context units from ``c``, target units ``i`` to ``j``)."""

    def __init__(self, tokenizer, messages: list, tools: Optional[list], trained: set, options: SplitOptions,
                 whole: Optional[TurnPlan]):
        self.tokenizer, self.messages, self.tools, self.trained, self.options = (tokenizer, messages, tools, trained,
                                                                                 options)
        self.head, self.units = units_of(messages)
        self.user_of = [max((k for k in range(self.head, a + 1) if messages[k]["role"] == "user"), default=None)
                        for a, _b in self.units]
        self.memo: dict = {}  # cut -> its samples: the plan is made again after an overflow, most cuts stay
        # what plan found per reply, kept across pieces: (first context unit, the reply's index in the piece, whether
        # the piece has the message after it) -> plan's result. Pieces with the same first unit hold the same messages
        # up to each reply (the trained flags aside, which the template does not see), so a reply renders alike in
        # all of them; where its end is read off the next message (TemplateProfile.ends_at_next_role,
        # sft.data.template.profile) only if that message is there too
        self.next_role = template_profile(tokenizer).ends_at_next_role
        self.replies: dict = {}
        if whole is not None and messages[self.units[0][0]]["role"] != "tool":  # a piece from unit 0: the start
            self.replies.update(((0, k, self.next_role and k + 1 < len(messages)), r) for k, r in whole.replies.items())
        self.tokens: dict = {}  # sample text -> its (ids, offsets): pieces with the same first unit share texts
        self.texts_of: dict = {}  # first context unit -> {sample's last message index in the piece: its text}

    def piece(self, c: int, i: int, j: int) -> list[dict]:
        """The messages of cut ``(c, i, j)``: the head, the lead (where unit ``c`` starts with tool results), then the
        units ``c`` to ``j``, only the replies of units ``i`` to ``j`` trained."""
        messages, first = self.messages, self.units[c][0]
        lead = []
        if messages[first]["role"] == "tool":  # the query, and the calls these results answer, as context
            lead = (([messages[self.user_of[c]]] if self.user_of[c] is not None else [])
                    + [dict(messages[first - 1], train=False)])
        keep = {k for a, b in self.units[i:j] for k in range(a, b) if k in self.trained}
        body = [m if m["role"] != "assistant" or k in keep else dict(m, train=False)
                for k, m in enumerate(messages[first:self.units[j - 1][1]], start=first)]
        return messages[:self.head] + lead + body

    def plan_piece(self, c: int, i: int, j: int) -> list:
        """The samples of cut ``(c, i, j)`` (:func:`sft.data.encode.turns.plan`), the replies known reused and
        recorded."""
        msgs = self.piece(c, i, j)
        key = [(c, k, self.next_role and k + 1 < len(msgs)) for k in range(len(msgs))]
        p = plan(self.tokenizer, msgs, self.tools, self.options.stops, known={
            k: self.replies[key[k]] for k in range(len(msgs)) if key[k] in self.replies}, count_dropped=False)
        self.replies.update((key[k], r) for k, r in p.replies.items())
        return p.samples

    def tokenize(self, planned) -> None:
        """Tokenize the texts of ``planned`` (``[(first context unit, samples), ...]``) not tokenized before, each
        after the text of the same first unit that ends one message earlier (the longest shared prefix), known or
        new (:func:`sft.data.encode.shared_prefix.tokenize_shared`: the same tokens as tokenizing each text whole)."""
        tokens, texts_of = self.tokens, self.texts_of
        for c, samples in planned:
            texts_of.setdefault(c, {}).update((last, t) for t, _s, last in samples)
        order, groups, known = [], [], {}
        for c in dict.fromkeys(c for c, _samples in planned):
            lasts = sorted(texts_of[c])
            for n, last in enumerate(lasts):
                t = texts_of[c][last]
                if t in tokens:
                    continue
                if n and (order[-1:] != [texts_of[c][lasts[n - 1]]] or groups[-1] != c):
                    prev = texts_of[c][lasts[n - 1]]
                    if prev in tokens:
                        known[len(order)] = tokens[prev]
                        order.append(prev)
                        groups.append(c)
                order.append(t)
                groups.append(c)
        for k, got in enumerate(tokenize_shared(self.tokenizer, order, groups, known)):
            tokens.setdefault(order[k], got)
        for c, samples in planned:  # a text met only as another first unit's (not in texts_of[c] order)
            rest = [t for t, _s, _l in samples if t not in tokens]
            for t, got in zip(rest, tokenize_shared(self.tokenizer, rest, [0] * len(rest))):
                tokens[t] = got

    def encode_all(self, cuts) -> list[list[tuple[list[int], list[int]]]]:
        """Per cut, its samples as ``[(input_ids, labels), ...]``; each cut planned and tokenized once."""
        from sft.data.template.chat import labels_from_spans

        todo = [cut for cut in dict.fromkeys(cuts) if cut not in self.memo]
        planned = [self.plan_piece(*cut) for cut in todo]
        self.tokenize([(c, samples) for (c, _i, _j), samples in zip(todo, planned)])
        for cut, samples in zip(todo, planned):
            parts = [p for t, spans, _l in samples for p in samples_at_prompts(self.tokenizer, t, *self.tokens[t],
                                                                                 spans)]  # each prompt's own tokens
            self.memo[cut] = [(ids, labels_from_spans(ids, offs, spans, self.options.closing))
                              for _t, ids, offs, spans in parts]
        return [self.memo[cut] for cut in cuts]

    def estimate(self, rendering: Optional[str] = None,
                 tokenized: Optional[tuple] = None) -> tuple[list[int], int, list[int]]:
        """Token estimates ``(costs, head_len, user_len)``: each unit's tokens, the head's (with whatever the template
        adds once), and per unit the tokens of its round's user turn; read off the whole conversation's rendering (one
        rendering, one tokenization; ``rendering``: that rendering, already made; ``tokenized``: ``(text, offsets)``
        of a text already tokenized, used where it is the rendering), a unit starting where the text of its first
        message is found, in order (only the plan uses them: :func:`split_turns` checks every piece it encodes)."""
        from sft.data.encode.turns import template_messages

        tokenizer, messages, head, units = self.tokenizer, self.messages, self.head, self.units
        shown = template_messages(tokenizer, messages)
        full = rendering if rendering is not None else render_with_tools(tokenizer, shown, self.tools)
        if tokenized is not None and tokenized[0] == full:
            offsets = tokenized[1]
        else:
            offsets = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False,
                                return_attention_mask=False)["offset_mapping"]
        ends = [e for _s, e in offsets]
        marks, pos = [], 0
        for a, _b in units:
            m = shown[a]
            needle = message_text(m).strip()[:200] or next(
                (c["function"]["name"] for c in m.get("tool_calls", ())), "")
            at = full.find(needle, pos) if needle else -1
            if at < 0:
                marks.append(None)
                continue
            marks.append(bisect_right(ends, at))  # tokens before the unit's first text (its header counts as its own)
            pos = at + len(needle)
        if any(m is None for m in marks) or marks != sorted(marks):
            step = len(offsets) / (len(units) + 1)
            marks = [round(step * (u + 1)) for u in range(len(units))]
        bounds = marks + [len(offsets)]
        costs = [max(1, b - a) for a, b in zip(bounds, bounds[1:])]
        per_char = len(offsets) / max(1, len(full))
        user_len = []  # the round's user turn and the calls answered, led before a unit that starts with tool results
        for a, _b in units:
            u = next((k for k in range(a, head - 1, -1) if messages[k]["role"] == "user"), None)
            lead = [shown[u]] if u is not None else []
            lead += [shown[a - 1]] if a > 0 and shown[a]["role"] == "tool" else []
            chars = sum(len(message_text(m)) + len(json.dumps(m.get("tool_calls", ""))) for m in lead)
            user_len.append(round(chars * per_char) + 8 * len(lead))
        return costs, marks[0], user_len
