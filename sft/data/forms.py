"""How a chat template takes a message, decided once per template by rendering probes: reasoning as
``reasoning_content`` or inline ``<think>`` (:func:`reasoning_form`), tool call arguments as an object or their JSON
string (:func:`arguments_form`), whether it writes ``tool_calls`` at all (:func:`writes_tool_calls`); and
:func:`render_with_tools`, the renderer :mod:`sft.data.turns` uses."""
from __future__ import annotations

import json
from typing import Sequence

from sft.data.messages import message_text
from sft.errors import TemplateError

PROBE_REASONING = "\ue010probe reasoning\ue011"


def render_with_tools(tokenizer, messages: Sequence[dict], tools, generation_prompt: bool = False) -> str:
    """``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)``
    for validated messages (:mod:`sft.data.messages`), through the compiled template directly (what it calls after
    converting its inputs: the identity on plain dicts, plus its copy of ``reasoning_content`` to ``thinking``, done
    here too); the template's own refusals (jinja2's ``raise_exception``, a template bug) as :class:`TemplateError`.
    """
    from sft.data.chat import Renderer
    from sft.data.chat_template import render_failure

    shown = [{"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m for m in messages]
    try:
        return Renderer.of(tokenizer).render(shown, tools, generation_prompt)
    except Exception as e:
        raise TemplateError(f"the chat template cannot render this conversation: {render_failure(e)}") from None


def reasoning_form(tokenizer) -> str:
    """``"field"`` (the template writes ``reasoning_content``), ``"inline"`` (it writes ``<think>...</think>`` from the
    content) or ``"none"`` (neither: reasoning would be dropped); probed once per template and cached."""
    cache = template_cache(tokenizer)
    if "reasoning" not in cache:
        form = "none"
        for candidate in ("field", "inline"):
            msg = with_reasoning({"role": "assistant", "content": "Hello"}, PROBE_REASONING, candidate)
            try:
                text = render_with_tools(tokenizer, [{"role": "user", "content": "Hi"}, msg], None)
            except TemplateError:
                continue
            if PROBE_REASONING in text:
                form = candidate
                break
        cache["reasoning"] = form
    return cache["reasoning"]


def template_cache(tokenizer) -> dict:
    """The per-template dict where the probes of this module and of :mod:`sft.data.turns` keep their answers (in the
    tokenizer's :class:`sft.data.chat.Renderer` memo: a new chat template gets a new one)."""
    from sft.data.chat import Renderer

    memo = Renderer.of(tokenizer).memo
    return memo.setdefault("turns", {})


def with_reasoning(msg: dict, reasoning: str, form: str) -> dict:
    """``msg`` (a message dict) with ``reasoning`` in the template's ``form`` (:func:`reasoning_form`): inside the
    content as ``<think>\\n...\\n</think>\\n\\n`` (``"inline"``), else as ``reasoning_content``; a new dict."""
    if form == "inline":
        return {**msg, "content": f"<think>\n{reasoning}\n</think>\n\n{message_text(msg)}"}
    return {**msg, "reasoning_content": reasoning}


def arguments_form(tokenizer) -> str:
    """``"object"`` (the template writes a tool call's ``arguments`` given as a JSON object, as most Hugging Face
    templates do with ``tojson``) or ``"string"`` (it needs them as their JSON string, OpenAI's wire format:
    functionary-v3.2 writes ``"\n" + arguments``); probed once per template (a call with an object, then with its
    string, the first whose probe value the rendering holds) and cached; ``"object"`` where neither renders."""
    cache = template_cache(tokenizer)
    if "arguments" not in cache:
        cache["arguments"] = "object"
        args = {"probe_argument": PROBE_VALUE}
        for form, value in (("object", args), ("string", json.dumps(args, ensure_ascii=False))):
            call = probe_call(value)
            try:
                text = render_with_tools(tokenizer, [{"role": "user", "content": "Hi"}, call], [PROBE_TOOL])
            except TemplateError:
                continue
            if PROBE_VALUE in text:
                cache["arguments"] = form
                break
    return cache["arguments"]


PROBE_CONTENT = "\ue014probe content\ue015"
PROBE_VALUE = "\ue012probe value\ue013"


def writes_tool_calls(tokenizer) -> bool:
    """Whether the chat template writes a reply's ``tool_calls`` at all (a probe call's name in its rendering after
    the user turn); probed once per template and cached."""
    cache = template_cache(tokenizer)
    if "writes_calls" not in cache:
        call = probe_call({})
        try:
            text = render_with_tools(tokenizer, template_messages(tokenizer, [{"role": "user", "content": "Hi"},
                                                                              call]), [PROBE_TOOL])
        except TemplateError:
            text = ""
        cache["writes_calls"] = "probe_tool" in text[text.find("Hi"):]
    return cache["writes_calls"]


def probe_call(arguments) -> dict:
    """An assistant turn holding one call of :data:`PROBE_TOOL` with these ``arguments``."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "123456789", "function": {"name": "probe_tool", "arguments": arguments}}]}


def _with_string_arguments(msg: dict) -> dict:
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"],
                                                                         ensure_ascii=False)}}
             for c in msg["tool_calls"]]
    return {**msg, "tool_calls": calls}


def template_messages(tokenizer, messages: Sequence[dict]) -> list[dict]:
    """``messages`` as the template takes them: the private ``train`` flag removed, reasoning in the template's form
    (:func:`reasoning_form`), tool call arguments in its form (:func:`arguments_form`)."""
    form = None
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "train"}
        if "reasoning_content" in m:
            form = form or reasoning_form(tokenizer)
            m = with_reasoning({k: v for k, v in m.items() if k != "reasoning_content"}, m["reasoning_content"],
                                form)
        if m.get("tool_calls") and arguments_form(tokenizer) == "string":
            m = _with_string_arguments(m)
        out.append(m)
    return out


PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "A probe.",
                                                  "parameters": {"type": "object", "properties": {}}}}
