"""Render conversations with the tokenizer's chat template and build token ids and labels together.

The ids are exactly ``tokenizer.apply_chat_template(messages)`` (the rendered text tokenized once,
without extra special tokens), so training sees the same tokens as inference. Labels copy the ids of
supervised tokens and are ``-100`` (ignored by the loss) everywhere else.

Supervised = each assistant reply's content plus the end-of-turn token that closes it (``<|im_end|>``
for ChatML). Not supervised: ``<|im_start|>``, role headers, system and user turns, padding.

How the spans are found: the template renders the conversation (the text the model sees) and the
character range of every reply in that text is located exactly (:func:`render_with_spans`). The text
is tokenized once with offsets; a token is supervised when its characters overlap a reply, and the
token right after the reply must be the end-of-turn token. A template for which the replies cannot
be located exactly is refused with :class:`~sft.errors.TemplateError` rather than guessed at.
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional, Sequence

from sft.compat.jinja import compile_template
from sft.data.records.messages import message_text
from sft.data.refusal import Refusal
from sft.data.template.chat_template import CHATML_TEMPLATE, content_is_opaque  # noqa: F401 (re-exported)
from sft.data.vocab import has_token
from sft.errors import TemplateError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]  # a conversation the
# template probes of sft.data render (never changed in place)


def ensure_chat_template(tokenizer) -> bool:
    """Give ``tokenizer`` the ChatML template if it has none; add ChatML's special tokens if missing.

    Returns:
        True when tokens were added to the vocabulary (the model's embeddings must then be resized).
    """
    if tokenizer.chat_template:
        return False
    logger.info("the tokenizer has no chat template: using ChatML (<|im_start|>{role}\\n{content}<|im_end|>\\n)")
    tokenizer.chat_template = CHATML_TEMPLATE
    missing = [t for t in (IM_START, IM_END) if not has_token(tokenizer, t)]
    if missing:
        logger.warning("adding ChatML tokens %s to the vocabulary; their embeddings will be trained", missing)
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    return bool(missing)


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """Render ``messages`` to text with the tokenizer's chat template (``apply_chat_template``'s text; an empty tool
    list for a template that cannot render without one, :meth:`Renderer.render`); its own refusal or failure
    (jinja2's ``raise_exception``, a template that needs a variable it is not given) as :class:`TemplateError`."""
    try:
        try:
            return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception:
            if not tokenizer.chat_template or not Renderer.of(tokenizer).needs_tools():
                raise
        return tokenizer.apply_chat_template(list(messages), tools=[], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:
        from sft.data.template.chat_template import render_failure

        raise TemplateError(f"the chat template cannot render this conversation: {render_failure(e)}") from None


def chat_token_ids(tokenizer) -> list[int]:
    """Ids of the special tokens the chat template emits (e.g. ``<|im_start|>``, ``<|im_end|>``)."""
    text = render(tokenizer, [{"role": "system", "content": "S"}, *PROBE])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    added = tokenizer.get_added_vocab()
    return sorted({i for i in ids if tokenizer.convert_ids_to_tokens(i) in added})


def chat_control_tokens(tokenizer) -> list[str]:
    """Text forms of the tokenizer's special tokens (e.g. ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``)."""
    added = tokenizer.get_added_vocab()
    special = set(tokenizer.all_special_tokens) | {t for t in added if t.startswith("<") and t.endswith(">")}
    return sorted(t for t in special if t)


def with_system(messages: list[dict], system_message: Optional[str]) -> list[dict]:
    """Prepend ``system_message`` unless the conversation starts with its own system turn."""
    if system_message is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_message}, *messages]


def render_with_spans(tokenizer, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and locate each assistant reply's content in the text.

    Returns:
        ``(text, spans)``: the full rendering and one ``(start, end)`` character range per assistant
        reply, in order.

    Fast path: render once more with each reply replaced by a private-use sentinel and map the
    sentinels back; accepted only if substituting the replies reproduces the real rendering exactly.
    Otherwise (a template that inspects or rewrites content) the prefix method is used: rendering
    ``messages[:k]`` with ``add_generation_prompt=True`` yields exactly the text before reply k.

    Raises:
        TemplateError: neither method locates the replies (the template rewrites earlier turns).
    """
    messages = list(messages)
    text = render(tokenizer, messages)
    marked = [dict(m, content=f"\ue000{k}\ue001") if m["role"] == "assistant" else m for k, m in enumerate(messages)]
    s_text = render(tokenizer, marked)
    pieces, spans, pos, out_len = [], [], 0, 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        mark = f"\ue000{k}\ue001"
        at = s_text.find(mark, pos)
        if at < 0:
            break
        pieces.append(s_text[pos:at])
        out_len += at - pos
        spans.append((out_len, out_len + len(message_text(m))))
        pieces.append(message_text(m))
        out_len += len(message_text(m))
        pos = at + len(mark)
    pieces.append(s_text[pos:])
    if "".join(pieces) == text and len(spans) == sum(m["role"] == "assistant" for m in messages):
        return text, spans
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:k], add_generation_prompt=True)
        start, end = len(prefix), len(prefix) + len(message_text(m))
        if not text.startswith(prefix) or text[start:end] != message_text(m):
            what = ("the chat template renders earlier turns differently once later turns are added, so this "
                    "reply's span in the conversation's rendering cannot be located")
            fix = "use a template without such rewriting, or --long_conversations truncate"
            raise Refusal(k, what, fix)
        spans.append((start, end))
    return text, spans


def labels_from_spans(ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]],
                      eot_id: int) -> list[int]:
    """Labels for tokenized text: ``ids[i]`` where token i overlaps a reply span, the end-of-turn token
    right after each reply, ``-100`` elsewhere.

    ``ids``: token ids; ``offsets``: each token's ``(start, end)`` characters in the text; ``spans``: each reply's
    ``(start, end)`` characters, in order. A token overlaps span ``(a, b)`` when ``start < b`` and ``end > a``;
    tokens are matched to replies in order (:func:`_labels_by_token`, the definition). Tokenizers' offsets rise
    with the tokens, and then the same labels come from two binary searches per reply and list slices
    (:func:`_labels_by_reply`, about 10x faster on chitchat's ~900-token conversations); any other offsets take
    the token-by-token definition.

    Raises:
        TemplateError: a reply is not followed by ``eot_id``.
    """
    labels = _labels_by_reply(ids, offsets, spans, eot_id)
    return labels if labels is not None else _labels_by_token(ids, offsets, spans, eot_id)


def _labels_by_token(ids, offsets, spans, eot_id) -> list[int]:
    """:func:`labels_from_spans`, one token at a time: the current reply ``j`` is closed (its end-of-turn token
    checked and labelled) at the first token of non-zero width that starts at or after its end; a token is
    labelled when it overlaps the current reply; after the last reply is closed nothing more is labelled."""
    labels = [IGNORE_INDEX] * len(ids)
    j, last = 0, -1
    for i, (s, e) in enumerate(offsets):
        while j < len(spans) and s >= spans[j][1] and e > s:
            _close_turn(ids, labels, last, eot_id, j)  # the token after the reply must close the turn
            j += 1
        if j == len(spans):
            break
        a, b = spans[j]
        if s < b and e > a:
            labels[i] = ids[i]
            last = i
    if j < len(spans):
        _close_turn(ids, labels, last, eot_id, j)
    return labels


def _labels_by_reply(ids, offsets, spans, eot_id) -> Optional[list[int]]:
    """:func:`_labels_by_token`'s labels per reply, when every token's ``start <= end`` and starts and ends each rise
    (else None). Reply ``j`` = ``(a, b)`` is current from token ``A_(j-1)`` (``A_(-1) = 0``) to ``A_j``, the first
    token of non-zero width from ``max(A_(j-1), R_j)`` on (``R_j``: the first token starting at or after ``b``); it
    labels tokens ``max(A_(j-1), L_j) .. R_j - 1`` (``L_j``: the first ending after ``a``) and is closed at ``A_j`` or
    at the end of the tokens, after which nothing more is labelled or closed (as in the definition)."""
    from bisect import bisect_left, bisect_right
    from operator import itemgetter, sub

    n = len(ids)
    if not spans or n == 0 or len(offsets) != n:
        return None
    starts, ends = list(map(itemgetter(0), offsets)), list(map(itemgetter(1), offsets))
    if starts != sorted(starts) or ends != sorted(ends) or min(map(sub, ends, starts)) < 0:
        return None
    labels = [IGNORE_INDEX] * n
    current, last = 0, -1  # A_(j-1); the last labelled token
    for j, (a, b) in enumerate(spans):
        lo, hi = max(current, bisect_right(ends, a)), bisect_left(starts, b)
        if lo < hi:
            labels[lo:hi] = ids[lo:hi]
            last = hi - 1
        k = max(current, hi)
        while k < n and ends[k] == starts[k]:
            k += 1
        _close_turn(ids, labels, last, eot_id, j)
        if k == n:
            break
        current = k
    return labels


def encode_conversations(tokenizer, conversations: Sequence[Sequence[dict]], eot_id: int,
                         context_replies: Optional[Sequence[int]] = None) -> list[tuple[list[int], list[int]]]:
    """Token ids and labels of many conversations, built together (one batched tokenizer call).

    Args:
        tokenizer: a fast (``tokenizers``-backed) tokenizer with a chat template.
        conversations: each ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``, validated.
        eot_id: the end-of-turn token id (:func:`end_of_turn_id`).
        context_replies: per conversation, how many of its leading assistant replies are context only
            (rendered, not supervised; used for the later pieces of a split long conversation,
            :mod:`sft.data.encode.long_conversations`). Default: every reply is supervised.

    Returns:
        One ``(input_ids, labels)`` per conversation (an :class:`Encoded`): lists of int of equal length, not
        truncated.
        ``input_ids`` equals ``tokenizer.apply_chat_template(messages)``; ``labels[i]`` is
        ``input_ids[i]`` for supervised tokens and ``-100`` otherwise.

    Raises:
        TemplateError: see :func:`render_with_spans` and :func:`labels_from_spans`.
    """
    rendered = Renderer.of(tokenizer).render_all(conversations)
    skip = context_replies if context_replies is not None else [0] * len(rendered)
    enc = tokenizer([t for t, _ in rendered], add_special_tokens=False, return_offsets_mapping=True, verbose=False,
                    return_attention_mask=False)  # not used: building its lists costs time
    return [Encoded(ids, labels_from_spans(ids, offs, spans[k:], eot_id), text, offs, spans)
            for ids, offs, (text, spans), k in zip(enc["input_ids"], enc["offset_mapping"], rendered, skip)]


class Encoded(tuple):
    """``(input_ids, labels)`` of one conversation, with the rendered ``text`` (str), the tokens' character
    ``offsets`` in it (``[(start, end), ...]``, one per token) and every reply's character ``spans`` (context replies
    included) as attributes; compares and unpacks as the pair."""

    def __new__(cls, input_ids: list, labels: list, text: str, offsets: list, spans: list):
        self = super().__new__(cls, (input_ids, labels))
        self.text, self.offsets, self.spans = text, offsets, spans
        return self


_RENDERERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> Renderer (not on the tokenizer:
# it stays picklable)


class Renderer:
    """One render per conversation, spans found in the same render (what :func:`render_with_spans` finds with two
    renders and more).

    The chat template is called as ``apply_chat_template`` calls it (transformers' compiled jinja template, the
    tokenizer's special tokens as variables), without its per-call conversion of the inputs, which is the identity
    on validated messages (plain ``{"role": str, "content": str}`` dicts). The spans come from a *skeleton*: the
    rendering of the same roles with every content replaced by a sentinel, cached per sequence of roles, split into
    the literal text between the contents. A conversation is accepted when the skeleton filled with its contents
    equals its real rendering exactly; otherwise (a template that inspects or rewrites content, other message keys)
    it goes the way of :func:`render_with_spans`. For a template that provably writes contents verbatim and nothing
    else about them (:func:`content_is_opaque`: ChatML, SmolLM2) the filled skeleton *is* the rendering, and the
    template is rendered once per sequence of roles instead of once per conversation (measured: 3,000 chitchat
    conversations split at 512 tokens, 13,634 renderings, about 8% of the preparation's time).
    """

    def __init__(self, tokenizer):
        from sft.compat.transformers import plain_template_data

        self.tokenizer, self.template = tokenizer, tokenizer.chat_template
        self.compiled = compile_template(self.template)
        self.opaque = content_is_opaque(self.template, self.compiled.environment)
        self.variables = plain_template_data(dict(tokenizer.special_tokens_map))
        self.skeletons: dict = {}
        self.memo: dict = {}  # small per-tokenizer results (e.g.
        # sft.data.encode.long_conversations' head lengths), capped

    @classmethod
    def of(cls, tokenizer) -> "Renderer":
        r = _RENDERERS.get(tokenizer)
        if r is None or r.template != tokenizer.chat_template or r.variables != dict(tokenizer.special_tokens_map):
            r = _RENDERERS[tokenizer] = cls(tokenizer)
        return r

    def skeleton(self, roles: tuple) -> Optional[list[str]]:
        """The literal text around each content for this sequence of roles, or None when not found exactly."""
        if roles not in self.skeletons:
            marks = [f"\ue000{k}\ue001" for k in range(len(roles))]
            text = render(self.tokenizer, [{"role": r, "content": m} for r, m in zip(roles, marks)])
            pieces, pos = [], 0
            for m in marks:
                at = text.find(m, pos)
                if at < 0:
                    pieces = None
                    break
                pieces.append(text[pos:at])
                pos = at + len(m)
            if pieces is not None and "\ue000" not in text[pos:]:
                pieces.append(text[pos:])
            self.skeletons[roles] = pieces if pieces is not None and len(pieces) == len(roles) + 1 else None
        return self.skeletons[roles]

    def exact_skeleton(self, roles: tuple) -> bool:
        """For a template whose content is opaque (:func:`content_is_opaque`): whether this skeleton is the rendering
        of every conversation with these roles once filled, i.e. no literal piece holds a sentinel (a template that
        writes a content twice); checked once per sequence of roles."""
        key = ("exact", roles)
        if key not in self.skeletons:
            pieces = self.skeleton(roles)
            self.skeletons[key] = pieces is not None and not any("\ue000" in p or "\ue001" in p for p in pieces)
        return self.skeletons[key]

    def render(self, messages: Sequence[dict], tools=None, add_generation_prompt: bool = False) -> str:
        """Exactly ``render(tokenizer, messages)`` for validated messages, without apply_chat_template's overhead.
        ``tools=None`` on a template that cannot render without a tool list (Hermes' and Command-R's tool_use
        templates iterate over it) renders with an empty one, as :func:`render` does."""
        try:
            return self.compiled.render(messages=list(messages), tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.variables)
        except Exception:
            if tools is not None or not self.needs_tools():
                raise
        return self.compiled.render(messages=list(messages), tools=[], documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.variables)

    def needs_tools(self) -> bool:
        """Whether the template fails on a plain conversation without ``tools`` and renders it with ``tools=[]``;
        probed once."""
        if "needs_tools" not in self.memo:
            probe = dict(messages=list(PROBE), documents=None, add_generation_prompt=False, **self.variables)
            try:
                self.compiled.render(tools=None, **probe)
                self.memo["needs_tools"] = False
            except Exception:
                try:
                    self.compiled.render(tools=[], **probe)
                    self.memo["needs_tools"] = True
                except Exception:
                    self.memo["needs_tools"] = False
        return self.memo["needs_tools"]

    def fill(self, messages: Sequence[dict]) -> Optional[tuple[str, list[tuple[int, int]]]]:
        """``(text, reply content spans)`` of plain ``{"role", "content"}`` messages from their roles' skeleton when
        that is provably (opaque template) or checkably (the filled skeleton equals the rendering) the rendering;
        else None."""
        if not all(type(m) is dict and len(m) == 2 and type(m.get("content")) is str for m in messages):
            return None
        roles = tuple(m["role"] for m in messages)
        pieces = self.skeleton(roles)
        if pieces is None:
            return None
        parts, spans, pos = [pieces[0]], [], len(pieces[0])
        for m, lit in zip(messages, pieces[1:]):
            c = message_text(m)
            if m["role"] == "assistant":
                spans.append((pos, pos + len(c)))
            parts += (c, lit)
            pos += len(c) + len(lit)
        filled = "".join(parts)
        if (self.opaque and self.exact_skeleton(roles)) or filled == self.render(messages):
            return filled, spans
        return None

    def render_all(self, conversations: Sequence[Sequence[dict]]) -> list[tuple[str, list[tuple[int, int]]]]:
        return [self.fill(m) or render_with_spans(self.tokenizer, m) for m in conversations]


def encode_conversation(tokenizer, messages: Sequence[dict], eot_id: int) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation; see :func:`encode_conversations`."""
    return encode_conversations(tokenizer, [messages], eot_id)[0]


def _close_turn(ids, labels, last, eot_id, j):
    """Label the end-of-turn token right after reply ``j``'s last token ``last``; ``eot_id``: an id, or a frozenset of
    the ids that may close a reply (e.g. ``<|im_end|>`` and a tool call's ``<|call|>``,
    :mod:`sft.data.encode.turns`)."""
    nxt = last + 1
    if last < 0 or nxt >= len(ids) or not (ids[nxt] in eot_id if isinstance(eot_id, frozenset) else ids[nxt] == eot_id):
        raise TemplateError(f"assistant reply {j} is not followed by the end-of-turn token id {eot_id}")
    labels[nxt] = ids[nxt]


def visualize(tokenizer, input_ids: Sequence[int], labels: Sequence[int], color: bool = False) -> str:
    """Decode a sample with supervised spans marked: ``«...»`` (or green background when ``color``)."""
    out, run, sup = [], [], None
    open_, close = ("\x1b[30;42m", "\x1b[0m") if color else ("«", "»")

    def flush():
        if run:
            txt = tokenizer.decode(run)
            out.append(f"{open_}{txt}{close}" if sup else txt)

    for tid, lab in zip(input_ids, labels):
        s = lab != IGNORE_INDEX
        if s != sup:
            flush()
            run, sup = [], s
        run.append(tid)
    flush()
    return "".join(out)
