"""The renderer of the per-turn path (:func:`render_with_tools`) and the forms a message can take for a chat template:
reasoning in the ``reasoning_content`` field or inline ``<think>`` (:func:`with_reasoning`), tool call arguments as
their JSON string (:func:`with_string_arguments`), and the probe messages that :mod:`sft.data.template.profile` renders
to decide which form a template takes."""
from __future__ import annotations

import json
from typing import Sequence

from sft.data.records.messages import message_text
from sft.errors import TemplateError

PROBE_REASONING = "\ue010probe reasoning\ue011"


def render_with_tools(tokenizer, messages: Sequence[dict], tools, generation_prompt: bool = False) -> str:
    """``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)``
    for validated messages (:mod:`sft.data.records.messages`), through the compiled template directly (what it calls
    after
    converting its inputs: the identity on plain dicts, plus its copy of ``reasoning_content`` to ``thinking``, done
    here too); the template's own refusals (jinja2's ``raise_exception``, a template bug) as :class:`TemplateError`.
    """
    from sft.data.template.chat import Renderer
    from sft.data.template.chat_template import render_failure

    shown = [{"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m for m in messages]
    try:
        return Renderer.of(tokenizer).render(shown, tools, generation_prompt)
    except Exception as e:
        raise TemplateError(f"the chat template cannot render this conversation: {render_failure(e)}") from None


def template_cache(tokenizer) -> dict:
    """The per-template dict where :mod:`sft.data.encode.turns` keeps its answers that depend on more than the template
    (stop
    tokens per end-of-turn id, the fast path per sequence of roles), in the tokenizer's
    :class:`sft.data.template.chat.Renderer`
    memo: a new chat template gets a new one."""
    from sft.data.template.chat import Renderer

    memo = Renderer.of(tokenizer).memo
    return memo.setdefault("turns", {})


def with_reasoning(msg: dict, reasoning: str, form: str) -> dict:
    """``msg`` (a message dict) with ``reasoning`` in the template's ``form`` (``TemplateProfile.reasoning_form``,
    :mod:`sft.data.template.profile`): inside the content as ``<think>\\n...\\n</think>\\n\\n`` (``"inline"``), else as
    ``reasoning_content`` (``"field"``, ``"channel"``, ``"none"``); a new dict."""
    if form == "inline":
        return {**msg, "content": f"<think>\n{reasoning}\n</think>\n\n{message_text(msg)}"}
    return {**msg, "reasoning_content": reasoning}


PROBE_CONTENT = "\ue014probe content\ue015"
PROBE_VALUE = "\ue012probe value\ue013"


def probe_call(arguments) -> dict:
    """An assistant turn holding one call of :data:`PROBE_TOOL` with these ``arguments``."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "123456789", "function": {"name": "probe_tool", "arguments": arguments}}]}


def with_string_arguments(msg: dict) -> dict:
    """``msg`` (an assistant message with ``tool_calls``) with each call's ``arguments`` as its JSON string (the
    form :attr:`sft.data.template.profile.TemplateProfile.arguments_form` ``"string"``); a new dict."""
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"],
                                                                         ensure_ascii=False)}}
             for c in msg["tool_calls"]]
    return {**msg, "tool_calls": calls}


PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "A probe.",
                                                  "parameters": {"type": "object", "properties": {}}}}
