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
longer than ``max_len`` for the caller to truncate and report (:func:`sft.data.store.dataset.truncate`): the reply's
first tokens are trained.

Every sample is encoded by :func:`sft.data.template.chat.encode_conversations` (ids and labels built together, exactly
``apply_chat_template`` of the sample's messages); token counts read off the conversation's own encoding
only plan the cuts, and a plan whose encoded sample is longer than planned (a template whose turns do not add
up token for token) is planned again with a smaller budget, so no sample that holds more than one reply
exceeds ``max_len``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from sft.data.records.messages import message_text
from sft.data.template.chat import IGNORE_INDEX, PROBE, Encoded, Renderer, encode_conversations, labels_from_spans
from sft.errors import TemplateError

Sample = tuple[list[int], list[int]]


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
            system prompt already applied (:func:`sft.data.template.chat.with_system`).
        eot_id: the end-of-turn token id (:func:`sft.data.template.chat.end_of_turn_id`).
        max_len: ``--model_max_length`` in tokens.
        full: the conversation's own ``(input_ids, labels)`` if already encoded (saves one encoding).

    Returns:
        :class:`Split`: ``samples`` = ``[(input_ids, labels), ...]`` in conversation order (lists of int of
        equal length; labels ``-100`` outside the supervised replies), the whole conversation unchanged when
        it fits; each assistant reply is supervised (its content + end-of-turn token) in exactly one sample.
        Only a sample holding a single reply too long for ``max_len`` by itself is longer than ``max_len``.
        ``user_turns_cut``: user turns shortened from the start to fit with their reply.

    Raises:
        TemplateError: as :func:`sft.data.template.chat.encode_conversations`.
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
        plan = plan_pieces(lengths, costs, head_len, max_len, budget)
        todo = [k for k, (_c, i, _j) in enumerate(plan) if lengths[i] <= max_len]
        encoded = _encode_pieces(tokenizer, head, pairs, [plan[k] for k in todo], full, head_len, eot_id)
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
    ids, labels = full[0], full[1]
    ends = _reply_ends(ids, labels, eot_id)
    memo, key = Renderer.of(tokenizer).memo, ("head_len", eot_id, tuple((m["role"], message_text(m)) for m in head))
    if key not in memo:  # the same for every conversation with this system prompt
        one, two = encode_conversations(tokenizer, [head + PROBE, head + PROBE + PROBE], eot_id)
        if len(memo) >= 4096:
            memo.clear()
        memo[key] = max(0, 2 * len(one[0]) - len(two[0]))
    head_len = memo[key]
    tail = len(ids) - ends[-1] - 1  # tokens after the last reply's end (e.g. ChatML's "\n")
    costs = [ends[0] + 1 + tail - head_len] + [b - a for a, b in zip(ends, ends[1:])]
    if len(costs) != n_pairs:  # labels_from_spans closes every reply with eot_id, so this means a broken template
        raise TemplateError(f"found {len(costs)} closed replies in a conversation of {n_pairs}; the chat template "
                            "does not end each assistant turn with its end-of-turn token")
    return [head_len + c for c in costs], costs, head_len


def _encode_pieces(tokenizer, head: list[dict], pairs: list[list[dict]], plan: list[tuple[int, int, int]],
                   full: Sample, head_len: int, eot_id: int) -> list[Sample]:
    """The samples ``head + pairs[c:j]`` (pairs ``c..i-1`` as context) of ``plan``, as
    ``encode_conversations(..., context_replies=[i - c, ...])`` encodes them.

    Each is cut from the conversation's own encoding when that is provably the same: the sample's rendering is
    the conversation's text up to pair 0 followed by its text from pair ``c`` to pair ``j``, and every cut is at
    one special token (:func:`cut_tokens`), where the tokenizer splits the text before the rest of its work, so
    the tokens on both sides of a cut are those of the whole conversation. Labels are then built from the sample's
    own reply spans (:func:`sft.data.template.chat.labels_from_spans`), or, when those spans are the conversation's own
    spans moved with the text, taken from the conversation's labels (the same labels: each token is labelled by the
    reply its characters overlap). Any other sample is encoded. Seven parameters: each is a value
    :func:`split_conversation` (its one caller) already holds (the conversation's parts ``head`` and ``pairs``, its
    encoding, the planning estimate ``head_len``, the end-of-turn id); a value bundling them would serve one call."""
    out: list = [None] * len(plan)
    cut_ok = cut_tokens(tokenizer)
    if isinstance(full, Encoded) and cut_ok:
        ids, text, offs = full[0], full.text, full.offsets
        ends = _reply_ends(ids, full[1], eot_id)
        tail = len(ids) - ends[-1] - 1 if ends else 0
        starts = [head_len] + [e + 1 + tail for e in ends]  # token index where pair k starts (and the end)
        renderer = Renderer.of(tokenizer)
        if len(starts) == len(pairs) + 1 and starts[-1] == len(ids) and 0 < head_len < len(ids):
            h = starts[0]
            msgs = [head + [m for p in pairs[c:j] for m in p] for c, _i, j in plan]
            for k, ((c, i, j), (ptext, spans)) in enumerate(zip(plan, renderer.render_all(msgs))):
                a, b = starts[c], starts[j]
                if not all(x == len(ids) or ids[x] in cut_ok for x in (h, a, b)) or ids[h] != ids[a]:
                    continue
                ca, cb = offs[a][0], (offs[b][0] if b < len(ids) else len(text))
                ch = offs[h][0]
                if ptext != text[:ch] + text[ca:cb]:
                    continue
                shift = ca - ch
                p_ids = ids[:h] + ids[a:b]
                if [(x - shift, y - shift) for x, y in full.spans[i:j]] == spans[i - c:]:
                    # the replies sit where they sit in the conversation: the labels are its labels
                    out[k] = (p_ids, [IGNORE_INDEX] * (h + starts[i] - a) + full[1][starts[i]:b])
                else:
                    p_offs = offs[:h] + [(x - shift, y - shift) for x, y in offs[a:b]]
                    out[k] = (p_ids, labels_from_spans(p_ids, p_offs, spans[i - c:], eot_id))
    todo = [k for k, x in enumerate(out) if x is None]
    if todo:
        encoded = encode_conversations(tokenizer, [head + [m for p in pairs[plan[k][0]:plan[k][2]] for m in p]
                                                   for k in todo], eot_id, [plan[k][1] - plan[k][0] for k in todo])
        for k, sample in zip(todo, encoded):
            out[k] = sample
    return out


def _reply_ends(ids: list[int], labels: list[int], eot_id: int) -> list[int]:
    """Indices of the supervised end-of-turn tokens (``ids[k] == labels[k] == eot_id``), in order."""
    out, k = [], -1
    while True:
        try:
            k = labels.index(eot_id, k + 1)
        except ValueError:
            return out
        if ids[k] == eot_id:
            out.append(k)


def cut_tokens(tokenizer) -> frozenset:
    """Ids of the added special tokens at which a text can be cut and tokenized in pieces with the same tokens: the
    tokenizer finds them in the raw text before normalizing or pre-tokenizing (``normalized=False``), they eat no
    neighbouring whitespace (no ``lstrip``/``rstrip``), match anywhere (no ``single_word``), and none is part of a
    longer added token (which could match across a cut)."""
    memo = Renderer.of(tokenizer).memo
    if "cut_tokens" not in memo:
        added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        contents = [t.content for t in added.values()]
        memo["cut_tokens"] = frozenset(
            i for i, t in added.items()
            if t.special and not t.normalized and not t.lstrip and not t.rstrip and not t.single_word and t.content
            and not any(t.content in other and t.content != other for other in contents))
    return memo["cut_tokens"]


def _fit_pair(tokenizer, head: list[dict], user: dict, reply: dict, eot_id: int, max_len: int) -> tuple[Sample, bool]:
    """head + (user turn cut from the start) + reply: the longest tail of the user's text (starting at a word when
    it can) with which the sample fits ``max_len``; if none fits (the reply alone is too long), the longest
    tail with which the reply starts within the first half of the sample (the caller truncates it). "Longest" as
    a binary search finds it: where the token count is not monotone in the characters kept (rare: a cut that
    changes how the text around it tokenizes) a fitting tail a token short of the longest may be returned.
    Returns ``(sample, whether the user turn was cut)``."""
    text = message_text(user)
    memo: dict = {}  # keep -> sample: the search's last probe is usually the answer

    def encode(keep: int) -> Sample:
        if keep not in memo:
            memo[keep] = _encode_tail(keep)
        return memo[keep]

    def _encode_tail(keep: int) -> Sample:
        tail = text[len(text) - keep:]
        words = tail.split(None, 1)
        if keep < len(text) and len(words) == 2 and not text[len(text) - keep - 1].isspace():
            tail = words[1]  # start at a word boundary
        return encode_conversations(tokenizer, [head + [dict(user, content=tail), reply]], eot_id)[0]

    def fits(sample: Sample) -> bool:
        return len(sample[0]) <= max_len

    def reply_in_first_half(sample: Sample) -> bool:
        return next(k for k, x in enumerate(sample[1]) if x != IGNORE_INDEX) <= max_len // 2

    first = encode(1)
    ok = fits if fits(first) else reply_in_first_half
    lo, hi = 1, len(text)  # ok(encode(lo)) holds (or nothing better exists); find the largest such keep
    if ok is fits and len(text) > 64:
        lo, hi = _bracket(lambda keep: ok(encode(keep)), lo, hi,
                          _keep_guess(tokenizer, text, max_len - len(first[0]) + 1))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(encode(mid)):
            lo = mid
        else:
            hi = mid - 1
    return encode(lo), lo < len(text)


def _keep_guess(tokenizer, text: str, room: int) -> int:
    """How many characters from the end of ``text`` make about ``room`` tokens (``text`` tokenized alone: the
    tokens at a cut differ a little from those in the sample, so this only starts :func:`_bracket`)."""
    if room <= 0:
        return 1
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False,
                        return_attention_mask=False)["offset_mapping"]
    if room >= len(offsets):
        return len(text)
    return max(1, len(text) - offsets[len(offsets) - room][0])


def _bracket(ok, lo: int, hi: int, guess: int, step: int = 24) -> tuple[int, int]:
    """A narrower ``(lo, hi)`` for the binary search of the largest ``keep`` in ``lo..hi`` with ``ok(keep)`` (which
    holds at ``lo``), from a ``guess``: probes ``guess`` and one point ``step`` characters beyond it on the side the
    answer lies (doubling the step while it is still on that side), so that the search is left with about
    log2(step) probes instead of log2(hi - lo). Where ``ok`` is monotone (it is, up to a token where a cut
    changes how the text around it tokenizes) the search then finds the same largest keep."""
    g = min(max(guess, lo), hi)
    if g == lo:
        return lo, hi
    if ok(g):
        lo = g
        while lo < hi:
            probe = min(hi, lo + step)
            if not ok(probe):
                return lo, probe - 1
            lo, step = probe, step * 2
        return lo, hi
    hi = g - 1
    while lo < hi:
        probe = max(lo, hi - step)
        if ok(probe):
            return probe, hi
        hi, step = probe - 1, step * 2
    return lo, hi


def plan_pieces(lengths: list[int], costs: list[int], head_len: int, max_len: int,
                budget: int) -> list[tuple[int, int, int]]:
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

