"""One record's turns as chat templates take them: roles, content parts, reasoning, tool calls and tool results,
per-reply training flags, and the record's tool list. Used by :func:`sft.data.records.records.normalize_record`.

What a turn becomes (a message dict, the keys Hugging Face chat templates read):

* ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``. Role aliases: ``human`` -> user, ``gpt`` ->
  assistant, ``observation`` / ``function`` -> tool (LLaMA-Factory's and OpenAI's older names), ``function_call`` -> an
  assistant turn that holds tool calls (its value: a JSON object ``{"name", "arguments"}`` or a list of them,
  LLaMA-Factory's sharegpt form).
* Content: a string, or a list of text parts ``[{"type": "text", "text": str}, ...]`` (OpenAI's form), joined with
  ``"\\n"`` (as vLLM flattens text parts); any other part (an image, audio) is refused by name: training is text-only.
* Assistant reasoning: ``reasoning_content`` (also ``reasoning`` / ``thinking``), or ``<think>...</think>`` at the start
  of the content; kept as ``reasoning_content`` (stripped of surrounding newlines) with the rest of the content after
  it (leading newlines removed), as Qwen3's template splits it. :mod:`sft.data.encode.turns` hands it to the template in
  the form the template reads.
* Assistant ``tool_calls``: ``[{"id"?, "type": "function", "function": {"name": str, "arguments": str|object}}]`` (a
  flat ``{"name", "arguments"}`` too); kept as ``{"type": "function", "function": {"name", "arguments": dict}}`` plus
  ``id`` when given: ``arguments`` parsed from its JSON string (Hugging Face templates write it with ``tojson``).
  An assistant turn with tool calls may have empty content.
* Tool turns keep ``tool_call_id`` and ``name`` when given.
* ``train`` (bool) or ``weight`` (0 or 1) on an assistant turn: False / 0 makes it context only. Kept as the private
  key ``"train": False`` (removed before rendering).

The record's ``tools``: a list of JSON schemas (or that list as a JSON string); each kept in OpenAI's form
``{"type": "function", "function": {"name", "description"?, "parameters"?}}`` (a bare ``{"name", ...}`` is wrapped).
"""
from __future__ import annotations

import json
from typing import Any, Optional

ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system",
                "tool": "tool", "observation": "tool", "function": "tool", "function_call": "assistant"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
ROLES_HELP = "use user, assistant, system or tool (aliases: human, gpt, function_call, observation)"


class TurnProblem(Exception):
    """A problem of one turn: ``what`` it is, the ``fix``, and its ``kind`` (as :class:`sft.data.records.sources.
    Problem`)."""

    def __init__(self, what: str, fix: str, kind: str):
        super().__init__(what)
        self.what, self.fix, self.kind = what, fix, kind


def message_text(message: dict) -> str:
    """The text of one message (a validated message dict, a probe, or a message in the template's form): its
    ``content``, ``""`` where it has none. The one reader of a message's text in ``sft.data``, so that a content may
    later hold parts (text beside an image placeholder) without every reader changing."""
    return message.get("content") or ""


def text_of(value: Any, key: str) -> str:
    """A content value as text: a string as it is, a list of text parts joined with ``"\\n"``.

    Raises:
        TurnProblem: another type, a part that is not ``{"type": "text", "text": str}``.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for p, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and kind not in (None, "text"):
                raise TurnProblem(f"'{key}' part {p} is of type '{kind}'", "this toolkit trains on text only: remove "
                                  "the part (or describe it in a text part)", "non-text content")
            else:
                raise TurnProblem(f"'{key}' part {p} is {json.dumps(part)[:60]}",
                                  'write text parts as {"type": "text", "text": "..."}', "bad type")
        return "\n".join(texts)
    raise TurnProblem(f"'{key}' is {json.dumps(value)[:40]}, not a string", f"give '{key}' a string value (or a list "
                      "of text parts)", "not a string")


def _split_think(content: str) -> tuple[Optional[str], str]:
    """``<think>R</think>C`` (leading whitespace allowed) -> ``(R, C)``; content without it -> ``(None, content)``."""
    head = content.lstrip()
    if not head.startswith("<think>") or "</think>" not in head:
        return None, content
    reasoning, rest = head[len("<think>"):].split("</think>", 1)
    return reasoning.strip("\n"), rest.lstrip("\n")


def _why(e: Exception) -> str:
    """Why ``json.loads`` failed, in a few words (a RecursionError: nested too deeply to read)."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at character {e.pos}"
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def tool_call(raw: Any, c: int) -> dict:
    """One tool call in the form templates read (see the module docstring).

    Raises:
        TurnProblem: no name, arguments that are not a JSON object.
    """
    if not isinstance(raw, dict):
        raise TurnProblem(f"tool call {c} is {json.dumps(raw)[:40]}, not an object",
                          'write it as {"type": "function", "function": {"name": ..., "arguments": {...}}}', "bad type")
    fn = raw.get("function", raw)
    name, args = (fn.get("name"), fn.get("arguments", {})) if isinstance(fn, dict) else (None, None)
    if not isinstance(name, str) or not name.strip():
        raise TurnProblem(f"tool call {c} has no function name", "give it \"function\": {\"name\": ..., \"arguments\": "
                          "...}", "bad tool call")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            raise TurnProblem(f"tool call {c} ({name}): 'arguments' is not valid JSON ({_why(e)})",
                              "write the arguments as a JSON object (or its JSON string)", "bad tool call") from None
    if not isinstance(args, dict):
        raise TurnProblem(f"tool call {c} ({name}): 'arguments' is {json.dumps(args)[:40]}, not a JSON object",
                          "write the arguments as a JSON object of parameter: value", "bad tool call")
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    if raw.get("id") is not None:
        out["id"] = str(raw["id"])
    return out


def normalize_tools(value: Any) -> list[dict]:
    """The record's ``tools`` (a list, or its JSON string) in OpenAI's form.

    Raises:
        TurnProblem: not a list, a tool without a name.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except (ValueError, RecursionError) as e:
            raise TurnProblem(f"'tools' is a string that is not valid JSON ({_why(e)})",
                              "write 'tools' as a JSON list of function schemas", "bad tools") from None
    if not isinstance(value, list):
        raise TurnProblem(f"'tools' is {json.dumps(value)[:40]}, not a list", "write 'tools' as a list of function "
                          "schemas", "bad tools")
    out = []
    for k, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise TurnProblem(f"tool {k} of 'tools' has no name", 'write each tool as {"type": "function", "function": '
                              '{"name": ..., "parameters": {...}}}', "bad tools")
        out.append({"type": "function", "function": fn})
    return out


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def normalize_turn(role: str, value: Any, turn: dict, text_key: str) -> dict:
    """One turn (``role`` already an alias of :data:`ROLE_ALIASES`, ``value`` its text field) as a message dict.

    Raises:
        TurnProblem: the first problem of the turn.
    """
    norm = ROLE_ALIASES[role]
    if role == "function_call":  # LLaMA-Factory: the value is the call (or calls) as JSON
        try:
            calls = json.loads(value) if isinstance(value, str) else value
        except (ValueError, RecursionError) as e:
            raise TurnProblem(f"a function_call turn whose '{text_key}' is not valid JSON ({_why(e)})",
                              'write it as {"name": ..., "arguments": {...}} (or a list of them)',
                              "bad tool call") from None
        calls = calls if isinstance(calls, list) else [calls]
        msg = {"role": "assistant", "content": "", "tool_calls": [tool_call(c, k) for k, c in enumerate(calls)]}
    else:
        calls_only = value is None and norm == "assistant" and bool(turn.get("tool_calls"))
        content = "" if calls_only else text_of(value, text_key)
        msg = {"role": norm, "content": content}
        if norm == "assistant":
            reasoning = [k for k in REASONING_KEYS if turn.get(k) is not None]
            if len(reasoning) > 1:
                raise TurnProblem(f"reasoning given twice ({', '.join(reasoning)})", "keep one of them", "ambiguous")
            if reasoning:
                r = text_of(turn[reasoning[0]], reasoning[0])
                if r.strip():
                    msg["reasoning_content"] = r.strip("\n")
                if "</think>" in content:
                    raise TurnProblem(f"reasoning both in '{reasoning[0]}' and as <think>...</think> in the content",
                                      "keep one of them", "ambiguous")
            else:
                r, rest = _split_think(content)
                if r is not None:
                    msg["content"] = rest
                    if r.strip():
                        msg["reasoning_content"] = r
            calls = turn.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise TurnProblem(f"'tool_calls' is {json.dumps(calls)[:40]}, not a list",
                                      "write 'tool_calls' as a list of calls", "bad tool call")
                if calls:
                    msg["tool_calls"] = [tool_call(c, k) for k, c in enumerate(calls)]
        elif norm == "tool":
            for key in ("tool_call_id", "name"):
                if turn.get(key) is not None:
                    msg[key] = str(turn[key])
    flag = _train_flag(turn, norm)
    if flag is False:
        msg["train"] = False
    said = message_text(msg).strip() or msg.get("reasoning_content") or msg.get("tool_calls")
    if not said:
        raise TurnProblem(f"empty '{text_key}' for role {norm}", "give the turn some text or remove it", "empty value")
    return msg


def _train_flag(turn: dict, role: str) -> Optional[bool]:
    given = [k for k in ("train", "weight") if k in turn]
    if not given:
        return None
    if len(given) == 2:
        raise TurnProblem("both 'train' and 'weight'", "keep one of them", "ambiguous")
    key, val = given[0], turn[given[0]]
    if key == "train" and not isinstance(val, bool):
        raise TurnProblem(f"'train' is {json.dumps(val)[:40]}, not true or false", "write \"train\": false (context "
                          "only) or true", "bad flag")
    if key == "weight":
        if isinstance(val, bool) or val not in (0, 1):
            raise TurnProblem(f"'weight' is {json.dumps(val)[:40]}, not 0 or 1", "write \"weight\": 0 (context only) "
                              "or 1 (trained); other loss weights are not supported", "bad flag")
        val = bool(val)
    if val and role != "assistant":
        raise TurnProblem(f"'{key}' asks to train a {role} turn", "only assistant replies are trained: remove the flag",
                          "bad flag")
    return val


def results_in_call_order(messages: list[dict]) -> list[dict]:
    """``messages`` with each run of tool results put in the order of the calls they answer, where every result of
    the run names a distinct call of the assistant turn before it by ``tool_call_id``: results are matched to calls by
    id, and a template that writes no ids (Qwen3's) pairs them by position."""
    out, k = list(messages), 0
    while k < len(out):
        calls = out[k].get("tool_calls") if out[k]["role"] == "assistant" else None
        end = k + 1
        while end < len(out) and out[end]["role"] == "tool":
            end += 1
        if calls and end > k + 1:
            ids = [c.get("id") for c in calls]
            run = out[k + 1:end]
            given = [m.get("tool_call_id") for m in run]
            if all(g is not None and g in ids for g in given) and len(set(given)) == len(given):
                out[k + 1:end] = sorted(run, key=lambda m: ids.index(m["tool_call_id"]))
        k = end if end > k + 1 else k + 1
    return out


def structure_problem(messages: list[dict], tools: Optional[list[dict]]) -> Optional[tuple[str, str, int, str]]:
    """The first problem of the turns' order, as ``(what, fix, turn, kind)``, or None.

    Order: an optional leading system turn, then ``user``; a user turn or an assistant turn without tool calls is
    followed by the other speaker; an assistant turn with tool calls by one tool turn per call (at most); tool turns
    by the assistant. The conversation ends with an assistant turn. A tool turn's ``tool_call_id`` must name a call
    still open; a call must name a tool of ``tools`` when the record defines some.
    """
    order = "turns must go [system,] user, assistant (tool calls -> tool results -> assistant), user, ...; " \
            "merge consecutive turns of one speaker"
    body = messages[1:] if messages[0]["role"] == "system" else messages
    known = set(tool_names(tools)) if tools else None
    prev, open_calls = None, []
    for m in body:
        t, role = m["_turn"], m["role"]
        if role == "system":
            return "a system turn after the first turn", order, t, "roles out of order"
        if role == "tool":
            if prev not in ("assistant", "tool") or not open_calls:
                return ("a tool result that answers no tool call", "put tool results right after the assistant turn "
                        "whose tool_calls they answer, one per call", t, "tool result without call")
            cid = m.get("tool_call_id")
            ids = [c.get("id") for c in open_calls]
            if cid is not None and any(ids) and cid not in ids:
                return (f"tool_call_id '{cid}' answers no open tool call (open: {', '.join(i for i in ids if i)})",
                        "give the id of the call this result answers", t, "tool result without call")
            open_calls.pop(ids.index(cid) if cid in ids else 0)
        elif role == "user":
            if prev not in (None, "assistant") or open_calls:
                what = ("a user turn while tool calls wait for their results" if open_calls
                        else f"role user where {'assistant' if prev else 'user'} was expected (roles out of order)")
                return what, order, t, "roles out of order"
        else:  # assistant
            if prev not in ("user", "tool"):
                return "role assistant where user was expected (roles out of order)", order, t, "roles out of order"
            if open_calls:
                return (f"{len(open_calls)} tool call(s) of the previous assistant turn got no result",
                        "add a tool turn with the result of each call", t, "tool call without result")
            open_calls = list(m.get("tool_calls", []))
            for c in open_calls:
                name = c["function"]["name"]
                if known is not None and name not in known:
                    return (f"a tool call to '{name}', which the record's 'tools' does not define (defined: "
                            f"{', '.join(sorted(known))})", "add the tool to 'tools' or fix the name", t,
                            "unknown tool")
        prev = role
    if not any(m["role"] == "assistant" for m in body):
        return "no assistant turn", "add the assistant's reply: only replies are trained", -1, "no assistant turn"
    if body[-1]["role"] != "assistant":
        return ("the last turn is from the " + body[-1]["role"] + ", so nothing after it is trained",
                "remove the trailing turn or add the assistant's reply", body[-1]["_turn"], "roles out of order")
    if all(m.get("train") is False for m in body if m["role"] == "assistant"):
        return ("every assistant turn is marked not to be trained", "mark at least one reply trained (remove its "
                "\"train\": false / \"weight\": 0)", -1, "no assistant turn")
    return None
