"""One conversation -> its training samples (ids and labels, split or truncated to ``model_max_length``), with what
that cost (:class:`sft.data.encode.conversation_samples.ConversationSamples`;
:class:`sft.data.encode.report.TruncationReport`
counts it). Pure: no files, no ranks
(:mod:`sft.data.store.dataset` writes the samples into shards)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Sequence

from sft.data.encode.conversation_samples import ConversationSamples
from sft.data.encode.cut_turns import cut_turn, longest_pair, name_cuts, too_long
from sft.data.encode.long_conversations import split_conversation
from sft.data.encode.prompt_cut import samples_at_prompts
from sft.data.encode.shared_prefix import tokenize_shared
from sft.data.records.messages import message_text
from sft.data.refusal import Refusal
from sft.data.spec import PreparationSpec
from sft.data.template.chat import IGNORE_INDEX, with_system
from sft.errors import TemplateError

logger = logging.getLogger(__name__)


def truncate(ids: list[int], labels: list[int], max_len: int) -> dict:
    """Keep the first ``max_len`` tokens (right truncation) and count what it cost.

    Returns:
        dict with ``input_ids``, ``labels`` (lists of int, length <= max_len), ``n_supervised`` (kept),
        ``n_lost`` (supervised tokens cut off) and ``truncated`` (bool); a truncated one also ``cut_at``, the first
        tokens cut off (at most 8; :func:`encode_samples` replaces them with the turn they belong to,
        :func:`_name_cuts`).
    """
    total_sup = len(labels) - labels.count(IGNORE_INDEX)
    kept = min(len(labels), max_len) - labels[:max_len].count(IGNORE_INDEX)
    out = {"input_ids": ids[:max_len], "labels": labels[:max_len], "n_supervised": kept, "n_lost": total_sup - kept,
           "truncated": len(ids) > max_len}
    if out["truncated"]:
        out["cut_at"] = ids[max_len:max_len + 8]
    return out


def dropped_fix(tokenizer, dropped) -> str:
    """The fix of a refusal for content the template drops (:attr:`sft.data.encode.turns.TurnPlan.dropped`): the general
    one, after the template's own switch where it drops reasoning and reads ``enable_thinking`` not set on by
    ``--chat_template_kwargs`` (Reka-Edge writes reasoning only with it true), or a word on tool calls where it drops
    them and writes no call at all (LFM2, Granite 3.3: their models write calls inside the reply's content, in their own
    syntax; :attr:`sft.data.template.profile.TemplateProfile.writes_tool_calls`)."""
    from sft.data.template.chat_template import with_template_kwargs
    from sft.data.template.profile import template_profile

    template = tokenizer.chat_template or ""
    fix = ("use a template that renders it (--chat_template FILE), remove it, or pass --allow_dropped_content True to "
           "train without it")
    whats = [what for _turn, what, _n in dropped]
    on = with_template_kwargs("", {"enable_thinking": True})  # what --chat_template_kwargs writes into it
    if "enable_thinking" in template and "reasoning" in whats and on not in template:
        switch = "--chat_template_kwargs '{\"enable_thinking\": true}'"
        fix = f"if the template's reasoning is off, switch it on ({switch}: it reads enable_thinking), {fix}"
    if any(w.startswith("tool call ") for w in whats) and not template_profile(tokenizer).writes_tool_calls:
        fix += " (a template that writes no tool_calls wants the call inside the reply's content, in its model's " \
               "syntax)"
    return fix


class _Text(NamedTuple):
    """Who a text to tokenize belongs to (first field: what :func:`sft.data.encode.shared_prefix.tokenize_shared` groups
    by)."""
    conv: int  # the conversation's index
    spans: list  # the character spans of its trained replies
    whole: bool  # the whole conversation in one text, each reply exactly its content: split_conversation may cut it
    dropped: int  # characters the template dropped


@dataclass
class _Conversation:
    """One conversation on its way through :func:`encode_samples`."""
    messages: list  # with spec.system_message; the template's form where the fast path renders it whole
    tools: Optional[list]
    given: int  # its number of turns in the record
    general: bool = False  # planned reply by reply (split for length by sft.data.encode.split_turns)
    plan: object = None  # its whole plan, in split mode: split_turns takes the replies of its first piece from it
    out: object = None  # None, its samples (list of dicts) or the TemplateError that refuses it
    dropped: int = 0  # characters the template dropped
    extra: tuple = (0, 0)  # samples and tokens beyond its last sample (a history-rewriting template's cost)
    lengths: list = field(default_factory=list)  # the token count of each of its texts
    longest: str = ""  # planned reply by reply: its longest text over max_len (where split_turns' piece was cut)
    probed: Optional[tuple] = None  # known too long by its longest sample alone: that sample's (text, ids, offsets)

    @property
    def added(self) -> int:
        """Turns before its record's first one (spec.system_message): refusals name turns as the record numbers
        them."""
        return len(self.messages) - self.given


@dataclass(frozen=True)
class _Setup:
    """What every step of :func:`encode_samples` reads."""
    tokenizer: object
    eot_id: int
    spec: PreparationSpec
    stops: Sequence[str]
    closing: object  # the id, or frozenset of ids, that closes a reply
    renderer: object

    @property
    def splitting(self) -> bool:  # refuse: split, and refuse what split must cut in a turn
        return self.spec.long_conversations in ("split", "refuse")


def encode_samples(tokenizer, conversations: Sequence[list[dict]], eot_id: int, spec: PreparationSpec,
                   tools: Optional[Sequence[Optional[list]]] = None) -> list:
    """The training samples of each conversation (``spec.system_message`` applied where a conversation has no system
    turn), one batched tokenizer call, as ``spec`` (:class:`sft.data.spec.PreparationSpec`) says: ``max_len``,
    ``long_conversations``, ``last_reply_only`` (``--mask_history``) and ``allow_dropped_content``.

    Labels follow the definition of :mod:`sft.data.encode.turns` (what the model generates at inference after each
    reply's generation prompt, up to its end-of-turn token). Plain conversations (``{"role", "content"}`` turns, no
    tools) under a template whose replies' trained text is exactly their content
    (:func:`sft.data.encode.turns.one_sample_of_contents`, e.g. ChatML, SmolLM2, Qwen2.5) take the fast path
    (:func:`sft.data.template.chat.encode_conversations`); every other conversation is planned reply by reply
    (:func:`sft.data.encode.turns.plan`), possibly into several samples.

    Args:
        tokenizer: a fast tokenizer with its chat template.
        conversations: per conversation, its validated messages (:mod:`sft.data.records.messages`).
        eot_id: the end-of-turn token id (:func:`sft.data.template.end_tokens.end_of_turn_id`).
        spec: of its fields, ``max_len``, ``system_message``, ``last_reply_only`` (train only each conversation's last
            reply), ``allow_dropped_content`` (train a conversation even when the template drops some of its text,
            counted in its ``dropped``; default: refuse it) and ``long_conversations``
            (``"split"`` cuts a conversation longer than ``max_len`` at turn boundaries: plain conversations on the
            fast path by :func:`sft.data.encode.long_conversations.split_conversation`, only a reply too long by itself
            is
            then truncated; every other by :func:`sft.data.encode.split_turns.split_turns`, only a reply with its tool
            results too long by themselves is truncated; ``"truncate"`` keeps the first ``max_len`` tokens of each
            sample; ``"refuse"`` splits, and refuses a conversation with a turn splitting would cut).
        tools: per conversation, the record's tool schemas or None (default: none).

    Returns:
        Per conversation, in order: its :class:`sft.data.encode.conversation_samples.ConversationSamples` (its samples,
        :func:`truncate` dicts with ``user_cut``, the user turns cut from their start; ``extra_samples`` and
        ``extra_tokens``, what several samples cost; ``dropped``, the characters the template dropped), or the
        :class:`~sft.errors.TemplateError` that refuses it
        (a :class:`sft.data.refusal.Refusal` names the turn as the record numbers it: its ``turn`` is renumbered
        where ``system_message`` added a turn; its message keeps the number it was made with). This is the one place
        where a conversation becomes samples.
    """
    from sft.data.encode.turns import stop_tokens
    from sft.data.template.chat import Renderer

    stops = stop_tokens(tokenizer, eot_id)
    closing = frozenset(tokenizer.convert_tokens_to_ids(stops)) if len(stops) > 1 else eot_id
    setup = _Setup(tokenizer, eot_id, spec, stops, closing, Renderer.of(tokenizer))
    tools = list(tools) if tools is not None else [None] * len(conversations)
    convs = []
    for messages, tl in zip(conversations, tools):
        shown = with_system(messages, spec.system_message)
        convs.append(_Conversation(shown, tl, len(messages)))
    texts = [t for i, c in enumerate(convs) for t in _texts(setup, c, i)]
    made = _probe_longest(setup, convs, texts) if any(c.plan is not None for c in convs) else {}
    _encode(setup, convs, texts, made)
    for c in convs:  # name turns as the record numbers them (not counting a default system prompt)
        if isinstance(c.out, Refusal):
            c.out.renumber(c.added)
    for c in (c for c in convs if c.lengths and isinstance(c.out, list)):
        # what the template's rewriting cost: samples and tokens beyond the last one
        c.extra = len(c.lengths) - 1, sum(c.lengths) - c.lengths[-1]
        if c.general and setup.splitting and max(c.lengths) > spec.max_len:
            _split_turns(setup, c)
    return [_refuse_cut(c, spec) for c in convs]


def _refuse_cut(c: _Conversation, spec: PreparationSpec):
    """``c``'s :class:`ConversationSamples` or refusal, or under ``--long_conversations refuse`` the refusal naming
    the turn that split had to cut."""
    if not isinstance(c.out, list):
        return c.out
    cut = next((ex for ex in c.out if ex["truncated"]), None)
    if spec.long_conversations == "refuse" and cut is not None:
        return too_long(cut.get("cut_turn"), cut.get("turn_tokens"), spec.max_len, "a turn")
    return ConversationSamples(c.out, c.dropped, *c.extra)


def _texts(setup: _Setup, c: _Conversation, i: int) -> list[tuple[str, _Text]]:
    """The texts to tokenize of conversation ``i`` (``c``), with their owner: its whole rendering on the fast path
    (its template's fill of the contents), else its plan's samples (:func:`sft.data.encode.turns.plan`); none where it
    is
    refused (``c.out`` then says why)."""
    from sft.data.encode.turns import describe_dropped, one_sample_of_contents, plan, template_messages, trained_turns

    tokenizer, spec = setup.tokenizer, setup.spec
    # plain once the template's form of reasoning is in place (inside the content, for ChatML, SmolLM2, ...)
    shown = template_messages(tokenizer, c.messages)
    plain = c.tools is None and all(len(m) == 2 for m in shown)
    replies = [k for k, m in enumerate(c.messages) if m["role"] == "assistant"]
    keep = trained_turns(c.messages, spec.last_reply_only)
    if not keep:  # --mask_history with the last reply marked "train": false
        c.out = Refusal(replies[-1] if replies else None, "no reply left to train: --mask_history trains only the "
                        "last reply, and it is marked \"train\": false / \"weight\": 0", "remove the mark, or "
                        "drop --mask_history")
        return []
    got = setup.renderer.fill(shown) if plain and one_sample_of_contents(
        tokenizer, tuple(m["role"] for m in shown), setup.stops) else None
    if got is not None:
        if len(keep) == len(replies):
            c.messages = shown  # what split_conversation cuts
        else:
            c.general = True
        return [(got[0], _Text(i, [s for s, k in zip(got[1], replies) if k in keep], len(keep) == len(replies), 0))]
    try:
        p = plan(tokenizer, c.messages, c.tools, setup.stops, spec.last_reply_only)
    except TemplateError as e:
        c.out = e
        return []
    if p.dropped and not spec.allow_dropped_content:
        c.out = Refusal(None, f"the chat template drops {describe_dropped(p.dropped)}, so the model would never "
                        "see it", dropped_fix(tokenizer, p.dropped))
        return []
    if not p.samples:  # every reply to train was dropped by the template
        c.out = Refusal(None, "no reply left to train: the chat template writes none of the replies to train "
                        f"({describe_dropped(p.dropped)})", "use a template that renders them (--chat_template "
                        "FILE)")
        return []
    whole = plain and len(keep) == len(replies) and len(p.samples) == 1 and [
        p.samples[0][0][a:b] for a, b in p.samples[0][1]] == [message_text(shown[k]) for k in replies]
    if whole:
        c.messages = shown
    else:
        c.general = True
        if setup.splitting:
            c.plan = p
    dropped = sum(n for _t, _w, n in p.dropped)
    return [(text, _Text(i, spans, whole, dropped)) for text, spans, _last in p.samples]


def _probe_longest(setup: _Setup, convs: list, texts: list) -> dict:
    """Tokenize first the longest sample of each conversation split_turns may make pieces of (``c.plan`` set): one
    longer than ``max_len`` marks its conversation ``probed`` and its texts leave ``texts`` (in place), its whole
    plan's other samples being read by nobody. Only where every token that closes a reply is one the tokenizer finds
    in the raw text before anything else (:func:`sft.data.encode.long_conversations.cut_tokens`): then a reply's label
    check
    (``labels_from_spans``: the token after the reply closes it) holds in any sample that renders it.

    Returns:
        Per index of the ``texts`` left, its ``(ids, offsets)`` already made (a longest sample that fits)."""
    if not _closes_at_cut_tokens(setup.tokenizer, setup.closing):
        return {}
    first: dict = {}  # per conversation, the first of its longest texts
    for n, (text, owner) in enumerate(texts):
        i = owner.conv
        if convs[i].plan is not None and (i not in first or len(text) > len(texts[first[i]][0])):
            first[i] = n
    at = sorted(first.values())
    made, probed = {}, set()
    longest = [texts[n] for n in at]
    for n, (text, ids, offs, owner) in zip(at, _tokenized(setup.tokenizer, [t for t, _o in longest],
                                                          [o for _t, o in longest])):
        if len(ids) > setup.spec.max_len:
            c = convs[owner.conv]
            c.probed, c.out, c.lengths, c.longest = (text, ids, offs), [], [len(ids)], text
            c.dropped = owner.dropped
            probed.add(owner.conv)
        else:
            made[n] = (ids, offs)
    keep = [n for n in range(len(texts)) if texts[n][1].conv not in probed]
    texts[:] = [texts[n] for n in keep]
    return {k: made[n] for k, n in enumerate(keep) if n in made}


def _encode(setup: _Setup, convs: list, texts: list, made: dict) -> None:
    """Tokenize ``texts`` and make their samples (each truncated to ``max_len``; a whole conversation first split by
    :func:`sft.data.encode.long_conversations.split_conversation` in split mode), appended to their conversation's
    ``out``; a conversation refused on the way gets its error there instead."""
    tokenizer = setup.tokenizer
    for text, ids, offs, owner in _tokenized(tokenizer, [t for t, _o in texts], [o for _t, o in texts], made):
        c = convs[owner.conv]
        pieces = samples_at_prompts(tokenizer, text, ids, offs, owner.spans)  # each prompt's own tokens
        for piece_text, p_ids, p_offs, spans in pieces:
            if isinstance(c.out, Exception):
                break
            whole = owner.whole and len(pieces) == 1
            _encode_one(setup, c, (piece_text, p_ids, p_offs), owner._replace(spans=spans, whole=whole))


def _encode_one(setup: _Setup, c: _Conversation, piece: tuple, owner: _Text) -> None:
    """One sample text of conversation ``c`` (``piece``: its text, ids and offsets; ``owner.spans`` its trained
    replies) labelled and appended to ``c.out`` (see :func:`_encode`), or ``c.out`` its refusal."""
    from sft.data.template.chat import Encoded, labels_from_spans

    tokenizer, spec = setup.tokenizer, setup.spec
    text, ids, offs = piece
    try:
        full = Encoded(ids, labels_from_spans(ids, offs, owner.spans, setup.closing), text, offs, owner.spans)
        pieces, cut = (([full], 0) if not owner.whole or not setup.splitting or len(ids) <= spec.max_len
                       else split_conversation(tokenizer, c.messages, setup.eot_id, spec.max_len, full))
    except TemplateError as e:
        c.out = e
        return
    if cut and spec.long_conversations == "refuse":  # a user turn too long to fit with its reply
        turn, n = longest_pair(text, offs, c.messages)
        c.out = too_long(turn - c.added if turn is not None else None, n, spec.max_len, "a user turn")
        return
    first = c.out is None
    new = [dict(truncate(a, b, spec.max_len), user_cut=cut if first and k == 0 else 0)
           for k, (a, b) in enumerate(pieces)]
    if not (c.general and setup.splitting):  # a truncated sample names the turn it was cut in, never silently
        name_cuts(new, c.added, lambda cut_at: cut_turn(text, ids, offs, c.messages, cut_at))
    elif len(ids) > spec.max_len and len(text) > len(c.longest):  # its samples are replaced when too long
        c.longest = text
    c.out = (c.out or []) + new
    c.lengths.append(len(ids))
    if first:
        c.dropped = owner.dropped


def _split_turns(setup: _Setup, c: _Conversation) -> None:
    """Replace the samples of a conversation planned reply by reply, one too long, with the pieces
    :func:`sft.data.encode.split_turns.split_turns` cuts it into (or its refusal)."""
    from sft.data.encode.split_turns import Known, SplitOptions, split_turns
    from sft.data.encode.turns import trained_turns

    tokenizer, max_len = setup.tokenizer, setup.spec.max_len
    try:
        pieces = split_turns(tokenizer, c.messages, c.tools, trained_turns(c.messages, setup.spec.last_reply_only),
                             SplitOptions(max_len, setup.stops, setup.closing),
                             Known(c.plan, (c.probed[0], c.probed[2]) if c.probed else None))
    except TemplateError as e:
        c.out = e
        return
    c.out = [dict(truncate(a, b, max_len), user_cut=0) for a, b in pieces]
    c.extra = (0, 0)  # its pieces replace the samples whose cost was counted
    if any("cut_at" in ex for ex in c.out):  # rare: a unit too long by itself; its rendering tokenized again
        enc = ({"input_ids": c.probed[1], "offset_mapping": c.probed[2]} if c.probed else
               tokenizer(c.longest, add_special_tokens=False, return_offsets_mapping=True, verbose=False))
        name_cuts(c.out, c.added, lambda cut_at: cut_turn(c.longest, enc["input_ids"], enc["offset_mapping"],
                                                          c.messages, cut_at))


def _closes_at_cut_tokens(tokenizer, closing) -> bool:
    """Whether every token that closes a reply (``closing``: an id or a frozenset of ids) is one of
    :func:`sft.data.encode.long_conversations.cut_tokens`."""
    from sft.data.encode.long_conversations import cut_tokens

    return (closing if isinstance(closing, frozenset) else {closing}) <= cut_tokens(tokenizer)


def lazy_refusal(n_samples: int) -> Refusal:
    """Why ``--lazy_preprocess True`` cannot take a conversation that the chat template makes ``n_samples`` samples
    of (it keeps one sample per record): said by ``sft-check`` and by
    :class:`sft.data.store.dataset.LazySupervisedDataset`
    when it reads the record."""
    return Refusal(None, f"the chat template renders earlier turns differently once later turns exist, so it is "
                   f"{n_samples} samples; --lazy_preprocess keeps one sample per record", "drop --lazy_preprocess")


TOKENIZE_CHARS = 4_000_000  # characters per tokenizer call: its offsets cost about 100 bytes a token


def _tokenized(tokenizer, texts: list, owners: list, made: Optional[dict] = None):
    """``(text, ids, offsets, owner)`` of every text, tokenized in calls of at most :data:`TOKENIZE_CHARS` characters
    (one text at least), a conversation's samples with their shared prefixes tokenized once
    (:func:`sft.data.encode.shared_prefix.tokenize_shared`): a batch of conversations that a history-rewriting template
    makes many long samples of keeps only one call's offsets in memory at a time. ``made``: per index of ``texts``,
    its ``(ids, offsets)`` already made (not tokenized again)."""
    start, made = 0, made or {}
    while start < len(texts):
        end, size = start + 1, len(texts[start])
        while end < len(texts) and size + len(texts[end]) <= TOKENIZE_CHARS:
            size, end = size + len(texts[end]), end + 1
        enc = tokenize_shared(tokenizer, texts[start:end], [o[0] for o in owners[start:end]],
                              {k - start: made[k] for k in range(start, end) if k in made})
        yield from ((t, ids, offs, o) for t, (ids, offs), o in zip(texts[start:end], enc, owners[start:end]))
        start = end


def encode_truncated(tokenizer, conv_messages, eot_id: int, spec: PreparationSpec,
                     tools: Optional[list] = None) -> ConversationSamples:
    """The samples of one conversation, each truncated to ``spec.max_len`` whatever ``spec.long_conversations`` says
    (see :func:`encode_samples`; ``spec``'s ``system_message``, ``last_reply_only`` and ``allow_dropped_content``
    apply).

    Raises:
        TemplateError: the chat template refuses the conversation.
    """
    spec = replace(spec, long_conversations="truncate")
    out = encode_samples(tokenizer, [conv_messages], eot_id, spec, [tools])[0]
    if isinstance(out, Exception):
        raise out
    return out


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
