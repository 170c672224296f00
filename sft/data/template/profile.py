"""What a chat template is, probed once: :class:`TemplateProfile`, one frozen value per tokenizer and template
(:func:`template_profile`), which the rest of the wing reads instead of probing the template itself; and
:func:`template_messages`, messages in the forms the profile says the template takes.

Each fact is decided by rendering probe conversations through the template
(:func:`sft.data.template.forms.render_with_tools`,
a rendering that fails counts as "no"), once: the profile lives in the tokenizer's
:class:`sft.data.template.chat.Renderer`,
which a new chat template replaces. Facts that depend on more than the template stay with their users: the tokens
that close a reply (per end-of-turn id, :func:`sft.data.encode.turns.stop_tokens`), whether a sequence of roles takes
the fast path (:func:`sft.data.encode.turns.one_sample_of_contents`), the tokens a text may be cut at (the vocabulary's,
:func:`sft.data.encode.long_conversations.cut_tokens`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from sft.data.records.messages import message_text
from sft.data.template.chat import PROBE, Renderer
from sft.data.template.forms import (
    PROBE_REASONING,
    PROBE_TOOL,
    PROBE_VALUE,
    probe_call,
    render_with_tools,
    with_reasoning,
    with_string_arguments,
)
from sft.errors import TemplateError


@dataclass(frozen=True)
class TemplateProfile:
    """What one chat template does with a conversation (all probed by rendering, once).

    Attributes:
        reasoning_form: ``"field"`` (it writes ``reasoning_content``), ``"channel"`` (a reasoning channel of its own
            that is not ``<think>``, :attr:`reasoning_channel`, which it writes only in some places: reasoning is
            handed over as ``reasoning_content`` and the model generates it in that channel, never as ``<think>``
            text: gemma-4's ``<|channel>thought``), ``"inline"`` (it writes ``<think>...</think>`` from the content)
            or ``"none"`` (neither: reasoning would be dropped).
        arguments_form: ``"object"`` (it writes a tool call's ``arguments`` given as a JSON object, as most Hugging
            Face templates do with ``tojson``) or ``"string"`` (it needs their JSON string, OpenAI's wire format:
            functionary-v3.2 writes ``"\\n" + arguments``); ``"object"`` where neither renders.
        writes_tool_calls: it writes a reply's ``tool_calls`` at all (a probe call's name after the user turn).
        ends_at_next_role: it writes nothing after the last reply, so a reply ends at the token that opens the next
            turn (GLM-4.6's ``<|user|>``, one of its model's end tokens:
            :func:`sft.data.template.end_tokens.end_of_turn_id`).
        needs_tools: it fails on a plain conversation without ``tools`` and renders it with ``tools=[]`` (Hermes' and
            Command-R's tool_use templates; :meth:`sft.data.template.chat.Renderer.needs_tools`).
        opaque: it writes each content verbatim and reads nothing else of it (:func:`sft.data.template.chat_template.
            content_is_opaque`: a filled per-roles skeleton is its rendering).
        reasoning_channel: ``(opening, close)``, the texts the template writes before and after reasoning in its own
            channel (gemma-4: ``"<|channel>thought\\n"``, ``"\\n<channel|>"``), found in the empty block its
            generation prompt closes or around a probe reasoning it writes; ``()`` where it has none but ``<think>``.
    """

    reasoning_form: str
    arguments_form: str
    writes_tool_calls: bool
    ends_at_next_role: bool
    needs_tools: bool
    opaque: bool
    reasoning_channel: tuple = ()


def template_profile(tokenizer) -> TemplateProfile:
    """The :class:`TemplateProfile` of ``tokenizer``'s chat template, probed on the first call for a template and
    kept with its :class:`sft.data.template.chat.Renderer`."""
    renderer = Renderer.of(tokenizer)
    found = renderer.memo.get("profile")
    if found is None:
        reasoning, arguments = _reasoning_form(tokenizer), _arguments_form(tokenizer)
        channel = reasoning_channel(tokenizer) if reasoning != "field" else ()
        reasoning = "channel" if channel else reasoning
        found = renderer.memo["profile"] = TemplateProfile(
            reasoning_form=reasoning, arguments_form=arguments,
            writes_tool_calls=_writes_tool_calls(tokenizer, reasoning, arguments),
            ends_at_next_role=_ends_at_next_role(tokenizer), needs_tools=renderer.needs_tools(),
            opaque=renderer.opaque, reasoning_channel=channel)
    return found


def template_messages(tokenizer, messages: Sequence[dict]) -> list[dict]:
    """``messages`` as the template takes them: the private ``train`` flag removed, reasoning and tool call
    arguments in the template's forms (:attr:`TemplateProfile.reasoning_form`, :attr:`TemplateProfile.
    arguments_form`); new dicts, ``messages`` unchanged."""
    reasoning = arguments = None
    if any("reasoning_content" in m or m.get("tool_calls") for m in messages):
        p = template_profile(tokenizer)
        reasoning, arguments = p.reasoning_form, p.arguments_form
    return _in_forms(messages, reasoning, arguments)


def _in_forms(messages: Sequence[dict], reasoning, arguments) -> list[dict]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "train"}
        if "reasoning_content" in m:
            m = with_reasoning({k: v for k, v in m.items() if k != "reasoning_content"}, m["reasoning_content"],
                               reasoning)
        if m.get("tool_calls") and arguments == "string":
            m = with_string_arguments(m)
        out.append(m)
    return out


def _reasoning_form(tokenizer) -> str:
    for candidate in ("field", "inline"):
        msg = with_reasoning({"role": "assistant", "content": "Hello"}, PROBE_REASONING, candidate)
        try:
            text = render_with_tools(tokenizer, [{"role": "user", "content": "Hi"}, msg], None)
        except TemplateError:
            continue
        if PROBE_REASONING in text:
            return candidate
    return "none"


def reasoning_channel(tokenizer) -> tuple:
    """``(opening, close)`` of the template's own reasoning channel where it is not ``<think>``, else ``()``: the
    empty reasoning block its generation prompt closes (thinking switched off: gemma-4's ``<|channel>thought\\n
    <channel|>``), or the block it writes a probe reasoning in (gemma-4 under ``enable_thinking`` writes a reply's
    ``reasoning_content`` only beside its tool calls). The opening: the block's tag, label and whitespace; the close
    as the template writes it (:func:`sft.data.encode.thinking.close_text`)."""
    from sft.data.encode.thinking import close_text, thinking_block

    user, source = [{"role": "user", "content": "Hi"}], tokenizer.chat_template or ""
    texts = []
    try:
        texts.append(render_with_tools(tokenizer, user, None, generation_prompt=True))
    except TemplateError:
        pass
    msg = with_reasoning(probe_call({}), PROBE_REASONING, "field")
    try:
        text = render_with_tools(tokenizer, user + [msg], [PROBE_TOOL])
        texts.append(text[:text.find(PROBE_REASONING)] if PROBE_REASONING in text else "")
    except TemplateError:
        pass
    for text in texts:
        block = thinking_block(text, source)
        if block is not None and block["open"] != "<think>":
            opening = text[block["start"]:block["inside"]]
            return opening, close_text(source, block["close"], opening[len(block["open"]):])
    return ()


def _arguments_form(tokenizer) -> str:
    args = {"probe_argument": PROBE_VALUE}
    for form, value in (("object", args), ("string", json.dumps(args, ensure_ascii=False))):
        try:
            text = render_with_tools(tokenizer, [{"role": "user", "content": "Hi"}, probe_call(value)], [PROBE_TOOL])
        except TemplateError:
            continue
        if PROBE_VALUE in text:
            return form
    return "object"


def _writes_tool_calls(tokenizer, reasoning: str, arguments: str) -> bool:
    try:
        text = render_with_tools(tokenizer, _in_forms([{"role": "user", "content": "Hi"}, probe_call({})], reasoning,
                                                      arguments), [PROBE_TOOL])
    except TemplateError:
        text = ""
    return "probe_tool" in text[text.find("Hi"):]


def _ends_at_next_role(tokenizer) -> bool:
    try:
        text = render_with_tools(tokenizer, PROBE, None)
    except TemplateError:
        text = ""
    return bool(text) and text.rstrip().endswith(message_text(PROBE[-1]))
