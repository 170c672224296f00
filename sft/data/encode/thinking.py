"""What the model generates after a generation prompt that does not simply continue into the reply's rendering:
a prompt that ends inside a reasoning block (``<think>\n``, gemma-4's ``<|channel>thought\n``, Command-R's thinking
switched off), and a prompt that differs from the rendering only in whitespace (:func:`continuation`; the definition
and its use: :mod:`sft.data.encode.turns`)."""
from __future__ import annotations

import os
import re
from typing import Mapping, NamedTuple, Optional, Union

_TAG = r"<[^<>\s]{1,40}>"
_OPEN_TAIL = re.compile(rf"(?P<open>{_TAG})(?P<label>[^<>\s]{{0,20}})(?P<ws>\s*)\Z")
_CLOSED_TAIL = re.compile(rf"(?P<open>{_TAG})(?P<label>[^<>\s]{{0,20}})(?P<ws>\s*)(?P<close>{_TAG})\s*\Z")
_THINKING = re.compile(r"think|thought|reason", re.IGNORECASE)
_CLOSE_RULES = ((re.compile(r"<([A-Za-z_][\w:.\-]*)>"), "</{}>"), (re.compile(r"<\|START_(\w+)\|>"), "<|END_{}|>"),
                (re.compile(r"<\|(\w+)_start\|>"), "<|{}_end|>"),
                (re.compile(r"<\|begin_of_(\w+)\|>"), "<|end_of_{}|>"),
                (re.compile(r"<\|(\w+)>"), "<{}|>"), (re.compile(r"<｜(.+)▁begin｜>"), "<｜{}▁end｜>"))


def close_tag(tag: str) -> Optional[str]:
    """The tag that closes ``tag`` (``<think>`` -> ``</think>``, ``<|START_THINKING|>`` -> ``<|END_THINKING|>``,
    ``<|channel>`` -> ``<channel|>``, ``<|x_start|>`` -> ``<|x_end|>``, ``<｜x▁begin｜>`` -> ``<｜x▁end｜>``), or None
    for a tag of no such form (a closing tag among them)."""
    for pattern, form in _CLOSE_RULES:
        m = pattern.fullmatch(tag)
        if m:
            return form.format(m[1])
    return None


def thinking_block(prompt: str, template: str) -> Optional[dict]:
    """The reasoning block a generation prompt ends with, or None: ``{"start", "inside", "open", "close", "closed"}``
    where ``prompt[start:]`` is the block (an opening tag naming thinking, thought or reasoning, with an optional
    label such as gemma-4's ``thought`` and whitespace, then optionally its closing tag and whitespace), ``inside``
    the character where its inside begins, ``close`` its closing tag (:func:`close_tag`) and ``closed`` whether the
    prompt already closes it (an empty block: thinking switched off)."""
    at = max(0, len(prompt.rstrip()) - _WINDOW)  # the block is at the end: searched there, not through the prompt
    for pattern in (_CLOSED_TAIL, _OPEN_TAIL):
        m = pattern.search(prompt, at)
        if m is None or not _THINKING.search(m["open"] + m["label"]):
            continue
        close = close_tag(m["open"])
        closed = pattern is _CLOSED_TAIL
        if close is None or (closed and m["close"] != close):
            continue
        return {"start": m.start(), "inside": m.end("ws"), "open": m["open"], "close": close, "closed": closed}
    return None


_WINDOW = 400  # characters before the prompt's trailing whitespace that hold its last block (tags of at most 42)


def close_text(template: str, close: str, after_open: str) -> str:
    """The block's close as the template writes it: ``close`` with the newlines the template writes around it where
    it writes it with some (gemma-4's ``"\n<channel|>"``, the longest such literal), else ``"\n" + close + "\n\n"``
    when the block's opening is followed by a newline (``<think>\n``: DeepSeek-R1's form), else ``close``."""
    nl = r"((?:\\n){0,2})"  # newlines written as \n in a string literal (not the template file's own line breaks)
    best = max(((a.replace("\\n", "\n"), b.replace("\\n", "\n"))
                for a, b in re.findall(nl + re.escape(close) + nl, template)), key=lambda ab: len(ab[0] + ab[1]),
               default=("", ""))
    if best[0] or best[1]:
        return best[0] + close + best[1]
    return f"\n{close}\n\n" if "\n" in after_open else close


class Continuation(NamedTuple):
    """What the model sees and generates for one reply: ``context + generated`` the reply's sample text up to the end
    of its rendering, ``generated[own:]`` the reply's own rendering."""
    context: str
    generated: str
    own: int


class Parted(NamedTuple):
    """No rule of :func:`continuation` applies: the reply's rendering does not continue its generation prompt;
    ``at`` is where the two texts part."""
    at: int


def _past_whitespace(prompt: str, full: str) -> Optional[int]:
    """Where ``prompt`` ends in ``full`` when the two differ only in whitespace after their common prefix (the
    characters that are not whitespace are the same, in order); None otherwise."""
    c = len(os.path.commonprefix([prompt, full]))
    j = c
    for ch in prompt[c:]:
        if ch.isspace():
            continue
        while j < len(full) and full[j].isspace():
            j += 1
        if j == len(full) or full[j] != ch:
            return None
        j += 1
    return j


class ReplyTexts(NamedTuple):
    """One reply's texts for :func:`continuation`: ``prompt`` = ``render(turns[:k], add_generation_prompt=True)``,
    ``full`` = ``render(turns[:k+1])``, ``reasoning`` the reply's reasoning ("" for none), ``last_turn`` the content
    of the message before the reply ("" for none), ``channel`` the template's own reasoning channel ``(opening,
    close)`` (:attr:`sft.data.template.profile.TemplateProfile.reasoning_channel`; ``()`` for none)."""
    prompt: str
    full: str
    reasoning: str
    last_turn: str = ""
    channel: tuple = ()


class Need(NamedTuple):
    """A rendering :func:`continuation` reads next, to be rendered by the caller and passed in ``given[what]``:
    ``"bare"``, ``full`` without the reply's reasoning (a str); ``"reasoned"``, ``(text, probe)``: ``full`` with the
    reply given the reasoning ``probe``; ``"unopened"``, the character where the reply's own rendering starts in
    ``full`` when ``prompt`` is ``full``'s text before it followed by special tokens only, else None."""
    what: str


def _close_in_words(prompt: str, full: str, c: int, reasoned: str, probe: str) -> Optional[str]:
    """The text the template writes between a reply's reasoning and the rest of its rendering, where the prompt
    opens reasoning in words (``prompt[c:]`` is not in ``full``) and ``reasoned`` (``full`` with the reply given the
    reasoning ``probe``) writes the probe right where ``prompt`` and ``full`` part; None otherwise."""
    if not reasoned.startswith(full[:c]):
        return None
    tail = reasoned[c:].lstrip()
    rest = full[c:].lstrip()
    if not tail.startswith(probe) or not rest or not tail.endswith(rest):
        return None
    shut = tail[len(probe):len(tail) - len(rest)]
    return shut if shut.strip() else None


def continuation(template: str, texts: ReplyTexts, given: Mapping) -> Union[Continuation, Need, Parted]:
    """What the model sees and generates for one reply (:class:`Continuation`), from its texts (:class:`ReplyTexts`)
    and ``template``, the chat template's source. A rule that reads a further rendering of the reply asks for it:
    :class:`Need` is returned, and the caller calls again with it in ``given`` (renderings are made only where a rule
    reads them). The rules, in order:

    - the prompt ends inside an opened reasoning block (:func:`thinking_block`, ``<think>\n``): the model generates
      the block's inside (the reasoning, "" without), its close (as the reply's rendering writes it, else
      :func:`close_text`), then the reply as rendered, without a second opening of the block; where the template
      writes the block's inside and close itself (``full`` continues ``prompt`` and closes the block, with no
      second opening), that is it;
    - the prompt closes an empty reasoning block (thinking switched off, ``<think>\n</think>``,
      ``<|channel>thought\n<channel|>``): a reply without reasoning is generated after the prompt (a close that its
      rendering repeats is not trained twice); a reply with reasoning is generated from the block's inside on: the
      reasoning, the close (:func:`close_text`), the reply as rendered;
    - ``full`` continues ``prompt``: the definition, ``full`` minus ``prompt``; where the template has a reasoning
      channel of its own (``texts.channel``) and does not write the reply's reasoning (gemma-4 under
      ``enable_thinking`` writes it only beside tool calls), the model generates it in that channel first: the
      opening, the reasoning, the close, then ``full`` minus ``prompt``;
    - the prompt opens reasoning in words the reply's rendering does not have (its own text names thinking, a
      thought or reasoning: Apriel-1.6's "Here are my reasoning steps:\n") and the rendering writes the reply's
      reasoning right after the text the two share: the prompt as it is, then the rendering from the reasoning on
      (the reasoning, the template's close of it, the reply); for a reply without reasoning, the prompt as it is,
      then the close the template writes after reasoning (found by rendering the reply with a probe reasoning: the
      text between it and the reply's rendering), then the reply as rendered (Apriel-1.6: "\n[BEGIN FINAL
      RESPONSE]\n" after "Here are my reasoning steps:\n");
    - whitespace tolerance: ``full`` and ``prompt`` differ only in whitespace after their common prefix (a
      template's indentation or line breaks leaking into one of them; the characters that are not whitespace are
      the same, in order): the prompt as it is, then the reply's own rendering from its first character that is
      not whitespace after the prompt's last one;
    - history rendered differently once the reply is added (Mistral-Nemo writes the system prompt into the last
      user turn only while it is the last message; LFM2.5 shows the last reply's reasoning only while it is the last
      reply): the prompt as it is, then the reply as ``full`` renders it after the text the prompt ends with from
      ``texts.last_turn`` on (the content of the message before the reply, its end and the generation prompt), where
      ``full`` holds that text;
    - the prompt is the rendering's text before the reply followed by special tokens only, and the rendering
      continues with the reply's own text (its content comes first: ``given["unopened"]``; the generation prompt
      opens a turn the rendering writes the reply into without opening: Apertus continues a reply after tool results
      inside the same assistant turn): the prompt as it is, then the reply as rendered.

    Longer than 60 lines with its docstring, which lists the rules in their order; the code is 30 lines (the rules
    after a reasoning block in :func:`_after_block`).

    Returns:
        The :class:`Continuation`; a :class:`Need` (call again with it in ``given``); or :class:`Parted` where none of
        the rules applies (the caller's refusal names where the texts part).
    """
    prompt, full, reasoning = texts.prompt, texts.full, texts.reasoning
    block = thinking_block(prompt, template)
    if block is not None:
        return _after_block(template, texts, block, given)
    if full.startswith(prompt):
        reply = full[len(prompt):]
        if texts.channel and reasoning.strip() and reasoning not in reply:  # the model opens its own channel
            shut = texts.channel[0] + reasoning + texts.channel[1]
            return Continuation(prompt, shut + reply, len(shut))
        return Continuation(prompt, reply, 0)
    c = len(os.path.commonprefix([prompt, full]))
    words = _THINKING.search(prompt[c:]) is not None  # the prompt's own text names reasoning
    if reasoning.strip() and words and full[c:].lstrip().startswith(reasoning.strip()):
        return Continuation(prompt, full[c:].lstrip(), 0)  # a prompt that opens reasoning in words (Apriel's "Here...")
    if not reasoning.strip() and words:
        if "reasoned" not in given:
            return Need("reasoned")
        shut = _close_in_words(prompt, full, c, *given["reasoned"])
        if shut is not None:
            return Continuation(prompt, shut + full[c:].lstrip(), len(shut))
    j = _past_whitespace(prompt, full)
    if j is not None:
        return Continuation(prompt, full[j:].lstrip(), 0)
    at = prompt.rfind(texts.last_turn) if texts.last_turn else -1
    end = full.rfind(prompt[at:]) if at >= 0 else -1
    if end >= 0:
        return Continuation(prompt, full[end + len(prompt) - at:], 0)  # the history rendered differently: the reply
    if "unopened" not in given:
        return Need("unopened")
    at = given["unopened"]
    if at is not None and full[at:].strip():
        return Continuation(prompt, full[at:], 0)  # a turn the rendering continues without opening it (Apertus)
    return Parted(c)


def _after_block(template: str, texts: ReplyTexts, block: dict, given: Mapping) -> Union[Continuation, Need, Parted]:
    """:func:`continuation` where the prompt ends with a reasoning block (:func:`thinking_block`)."""
    prompt, full, reasoning = texts.prompt, texts.full, texts.reasoning
    opening, close = block["open"], block["close"]
    reply = full[len(prompt):] if full.startswith(prompt) else None
    if reply is not None and not reply.lstrip().startswith(opening) and (
            (block["closed"] and not reasoning) or (not block["closed"] and close in reply)):
        return Continuation(prompt, reply, 0)  # the template writes the block's inside and close itself
    if reasoning and "bare" not in given:
        return Need("bare")
    rendered = given["bare"] if reasoning else full
    c = len(os.path.commonprefix([prompt, rendered]))
    if c < block["start"] and prompt[c:block["start"]].strip():
        return Parted(c)
    rest = rendered[min(c, block["start"]):].lstrip()
    if rest.startswith(opening):  # the reply's rendering opens the block again: never trained twice
        after = rest[len(opening):]
        at = after.find(close)
        rest = after[at + len(close):].lstrip() if block["closed"] and at >= 0 and not after[:at].strip() \
            else after.lstrip()
    if block["closed"]:
        if rest.startswith(close):
            rest = rest[len(close):].lstrip()
        if not reasoning:
            return Continuation(prompt, rest, 0)
        shut = close_text(template, close, prompt[block["start"] + len(opening):block["inside"]])
        return Continuation(prompt[:block["inside"]], reasoning + shut + rest, len(reasoning) + len(shut))
    if rest.startswith(close):
        return Continuation(prompt, reasoning + rest, len(reasoning))
    shut = close_text(template, close, prompt[block["start"] + len(opening):])
    return Continuation(prompt, reasoning + shut + rest, len(reasoning) + len(shut))
