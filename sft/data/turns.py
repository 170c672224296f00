"""Labels by the definition, reply by reply: what the model must generate at inference, on any chat template.

For an assistant turn ``k`` of ``turns`` the trained text is

    render(turns[:k+1])  minus  render(turns[:k], add_generation_prompt=True)

up to and including the end-of-turn token that closes it (the template's, :func:`sft.data.chat.end_of_turn_id`):
reasoning, text and tool calls alike, exactly the tokens the model samples after the generation prompt. Nothing else
is trained (tool results, tool definitions, system and user text, whatever follows the end-of-turn token).
``render`` is ``tokenizer.apply_chat_template`` with the record's ``tools``.

Templates that render earlier turns differently once later turns exist (Qwen3 drops earlier turns' reasoning and
writes an empty ``<think></think>`` only in the last turn; others move the system prompt or the tool list): reply
``j`` can share the sample of a later reply ``k`` only when ``render(turns[:k+1])`` begins with
``render(turns[:j+1])`` up to ``j``'s end-of-turn token (then both its context and its text are those of inference).
The replies are grouped greedily from the last: the last trained reply's rendering is a sample, holding every earlier
reply it begins with; the latest reply left over starts the next sample, and so on. Every trained reply is in exactly
one sample; for a template that never rewrites history that is one sample per conversation.

Content the template drops is counted, never silent (:class:`Plan` ``dropped``): a reply's content, reasoning or
tool call (its function name) missing from its trained text; a system, user or tool text missing from a sample;
the record's tools missing from a sample.

How reasoning is handed over: as ``reasoning_content`` (Qwen3, GLM, DeepSeek-V3.1, ... read it; transformers also
copies it to ``thinking``, gpt-oss's name) when the template writes that field, else inside the content as
``<think>\\n...\\n</think>\\n\\n`` when the template writes that, else as ``reasoning_content`` (and then counted as
dropped). Decided once per template by rendering a probe (:func:`reasoning_form`).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from sft.errors import TemplateError

_PROBE_REASONING = "\ue010probe reasoning\ue011"


@dataclass
class Plan:
    """The samples of one conversation: ``samples`` = ``[(text, spans, last_turn), ...]`` in conversation order, each
    ``text`` a rendering of ``turns[:last_turn + 1]`` and ``spans`` its trained replies' ``(start, end)`` characters
    (end = where the end-of-turn token starts); ``dropped`` = ``[(turn, what, characters), ...]`` the template left
    out (see the module docstring)."""

    samples: list = field(default_factory=list)
    dropped: list = field(default_factory=list)


def render(tokenizer, messages: Sequence[dict], tools, generation_prompt: bool = False) -> str:
    """``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)``
    for validated messages (:mod:`sft.data.messages`), through the compiled template directly (what it calls after
    converting its inputs: the identity on plain dicts, plus its copy of ``reasoning_content`` to ``thinking``, done
    here too); the template's own refusals (jinja2's ``raise_exception``, a template bug) as :class:`TemplateError`.
    """
    from sft.data.chat import _Renderer

    shown = [{"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m for m in messages]
    try:
        return _Renderer.of(tokenizer).render(shown, tools, generation_prompt)
    except Exception as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise TemplateError(f"the chat template cannot render this conversation: {reason}") from None


def reasoning_form(tokenizer) -> str:
    """``"field"`` (the template writes ``reasoning_content``), ``"inline"`` (it writes ``<think>...</think>`` from the
    content) or ``"none"`` (neither: reasoning would be dropped); probed once per template and cached."""
    cache = _cache(tokenizer)
    if "reasoning" not in cache:
        form = "none"
        for candidate in ("field", "inline"):
            msg = _with_reasoning({"role": "assistant", "content": "Hello"}, _PROBE_REASONING, candidate)
            try:
                text = render(tokenizer, [{"role": "user", "content": "Hi"}, msg], None)
            except TemplateError:
                continue
            if _PROBE_REASONING in text:
                form = candidate
                break
        cache["reasoning"] = form
    return cache["reasoning"]


def _cache(tokenizer) -> dict:
    from sft.data.chat import _Renderer

    memo = _Renderer.of(tokenizer).memo
    return memo.setdefault("turns", {})


def _with_reasoning(msg: dict, reasoning: str, form: str) -> dict:
    if form == "inline":
        return {**msg, "content": f"<think>\n{reasoning}\n</think>\n\n{msg['content']}"}
    return {**msg, "reasoning_content": reasoning}


def template_messages(tokenizer, messages: Sequence[dict]) -> list[dict]:
    """``messages`` as the template takes them: the private ``train`` flag removed, reasoning in the template's form."""
    form = None
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "train"}
        if "reasoning_content" in m:
            form = form or reasoning_form(tokenizer)
            m = _with_reasoning({k: v for k, v in m.items() if k != "reasoning_content"}, m["reasoning_content"],
                                form)
        out.append(m)
    return out


def trained_turns(messages: Sequence[dict], last_reply_only: bool = False) -> list[int]:
    """Indices of the assistant turns to train: all not marked ``"train": False``; with ``last_reply_only`` (the
    peers' ``mask_history``) only the last assistant turn, if it is not so marked."""
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if last_reply_only:
        replies = replies[-1:]
    return [k for k in replies if messages[k].get("train") is not False]


def plan(tokenizer, messages: Sequence[dict], tools: Optional[list], stops: Sequence[str],
         last_reply_only: bool = False) -> Plan:
    """The samples of one conversation by the definition (module docstring).

    Args:
        messages: validated message dicts (:mod:`sft.data.messages`), the default system prompt applied.
        tools: the record's tool schemas, or None.
        stops: the texts of the tokens that close a reply (:func:`stop_tokens`); a reply ends at the first of them.

    Raises:
        TemplateError: the template cannot render the conversation (its own message), renders a reply's context
            differently from its generation prompt, or does not close a reply with one of ``stops``; the message
            names the turn. A reply the template writes nothing of (a tool call under a template that ignores
            ``tool_calls``) is not trained and is counted in :attr:`Plan.dropped`.
    """
    shown = template_messages(tokenizer, messages)
    info, empty = {}, []
    source = tokenizer.chat_template or ""
    for k in trained_turns(messages, last_reply_only):
        reasoning = messages[k].get("reasoning_content") or ""
        try:
            prompt = render(tokenizer, shown[:k], tools, generation_prompt=True)
            full = render(tokenizer, shown[:k + 1], tools)
            bare = (lambda: render(tokenizer, shown[:k] + [_without_reasoning(messages[k])], tools)) if reasoning \
                else (lambda: full)
            prompt, reply, own = continuation(source, prompt, full, bare, reasoning)
        except TemplateError as e:
            raise refusal(k, str(e), "the template's own limit: rewrite the conversation in a form it renders, or use "
                          "another template") from None
        except _Diverges as e:
            c = e.at
            raise refusal(k, f"the chat template's generation prompt for this reply ends with {prompt[c:][:40]!r}, but "
                          f"its rendering of the reply has {full[c:c + 40]!r} there, so what the model generates "
                          "after the prompt is not defined", "use a template whose replies continue its generation "
                          "prompt") from None
        full = prompt + reply
        ends = [(at, t) for t in stops if (at := full.find(t, len(prompt) + own)) >= 0]  # after the block's close
        if not ends:
            raise refusal(k, f"the chat template does not close this reply with its end-of-turn token "
                          f"({' or '.join(stops)})", "use a template whose replies end with one")
        end, stop = min(ends)
        if not reasoning and not full[len(prompt) + own:end].strip():  # the template writes nothing of this reply:
            m = messages[k]  # dropped, not trained
            empty.append((k, " and ".join(f"tool call {c['function']['name']}" for c in m.get("tool_calls", ()))
                          or "content", len(m["content"]) + len(json.dumps(m.get("tool_calls", "")))))
            continue
        info[k] = (full, len(prompt), end, end + len(stop))
    out, todo = Plan(), sorted(info, reverse=True)
    while todo:
        text = info[todo[0]][0]
        group = [j for j in todo if text.startswith(info[j][0][:info[j][3]])]
        out.samples.append((text, [info[j][1:3] for j in sorted(group)], todo[0]))
        todo = [j for j in todo if j not in group]
    out.samples.reverse()
    out.dropped = sorted(empty + _dropped(messages, tools, info, out.samples), key=lambda x: x[0])
    return out


class _Diverges(Exception):
    """The reply's rendering does not continue its generation prompt under any rule of :func:`continuation`; ``at``
    is where the two texts part."""

    def __init__(self, at: int):
        super().__init__(at)
        self.at = at


def _without_reasoning(msg: dict) -> dict:
    return {k: v for k, v in msg.items() if k not in ("train", "reasoning_content")}


_TAG = r"<[^<>\s]{1,40}>"
_OPEN_TAIL = re.compile(rf"(?P<open>{_TAG})(?P<label>[^<>\s]{{0,20}})(?P<ws>\s*)\Z")
_CLOSED_TAIL = re.compile(rf"(?P<open>{_TAG})(?P<label>[^<>\s]{{0,20}})(?P<ws>\s*)(?P<close>{_TAG})\s*\Z")
_THINKING = re.compile(r"think|thought|reason", re.IGNORECASE)
_CLOSE_RULES = ((re.compile(r"<([A-Za-z_][\w:.\-]*)>"), "</{}>"), (re.compile(r"<\|START_(\w+)\|>"), "<|END_{}|>"),
                (re.compile(r"<\|(\w+)_start\|>"), "<|{}_end|>"), (re.compile(r"<\|begin_of_(\w+)\|>"), "<|end_of_{}|>"),
                (re.compile(r"<\|(\w+)>"), "<{}|>"), (re.compile(r"<｜(.+)▁begin｜>"), "<｜{}▁end｜>"))


def close_tag(tag: str) -> Optional[str]:
    """The tag that closes ``tag`` (``<think>`` -> ``</think>``, ``<|START_THINKING|>`` -> ``<|END_THINKING|>``,
    ``<|channel>`` -> ``<channel|>``, ``<|x_start|>`` -> ``<|x_end|>``, ``<｜x▁begin｜>`` -> ``<｜x▁end｜>``), or None for
    a tag of no such form (a closing tag among them)."""
    for pattern, form in _CLOSE_RULES:
        m = pattern.fullmatch(tag)
        if m:
            return form.format(m[1])
    return None


def thinking_block(prompt: str, template: str) -> Optional[dict]:
    """The reasoning block a generation prompt ends with, or None: ``{"start", "inside", "open", "close", "closed"}``
    where ``prompt[start:]`` is the block (an opening tag naming thinking, thought or reasoning, with an optional
    label such as gemma-4's ``thought`` and whitespace, then optionally its closing tag and whitespace), ``inside``
    the character where its inside begins, ``close`` its closing tag (:func:`close_tag`) and ``closed`` whether the prompt already closes it (an empty block: thinking switched off)."""
    for pattern in (_CLOSED_TAIL, _OPEN_TAIL):
        m = pattern.search(prompt)
        if m is None or not _THINKING.search(m["open"] + m["label"]):
            continue
        close = close_tag(m["open"])
        closed = pattern is _CLOSED_TAIL
        if close is None or (closed and m["close"] != close):
            continue
        return {"start": m.start(), "inside": m.end("ws"), "open": m["open"], "close": close, "closed": closed}
    return None


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


def _past_whitespace(prompt: str, full: str) -> int:
    """Where ``prompt`` ends in ``full`` when the two differ only in whitespace after their common prefix (the
    characters that are not whitespace are the same, in order); raises :class:`_Diverges` otherwise."""
    c = len(os.path.commonprefix([prompt, full]))
    j = c
    for ch in prompt[c:]:
        if ch.isspace():
            continue
        while j < len(full) and full[j].isspace():
            j += 1
        if j == len(full) or full[j] != ch:
            raise _Diverges(c)
        j += 1
    return j


def continuation(template: str, prompt: str, full: str, bare, reasoning: str) -> tuple[str, str, int]:
    """What the model sees and generates for one reply: ``(context, generated, own)``, ``context + generated`` the
    reply's sample text up to the end of its rendering, ``generated[own:]`` the reply's own rendering.

    ``prompt`` = ``render(turns[:k], add_generation_prompt=True)``, ``full`` = ``render(turns[:k+1])``, ``bare()``
    the latter without the reply's reasoning (called only where needed), ``reasoning`` the reply's reasoning ("" for
    none), ``template`` the chat template's source. The rules, in order:

    - the prompt ends inside an opened reasoning block (:func:`thinking_block`, ``<think>\n``): the model generates
      the block's inside (the reasoning, "" without), its close (as the reply's rendering writes it, else
      :func:`close_text`), then the reply as rendered, without a second opening of the block; where the template
      writes the block's inside and close itself (``full`` continues ``prompt`` and closes the block, with no
      second opening), that is it;
    - the prompt closes an empty reasoning block (thinking switched off, ``<think>\n</think>``,
      ``<|channel>thought\n<channel|>``): a reply without reasoning is generated after the prompt (a close that its
      rendering repeats is not trained twice); a reply with reasoning is generated from the block's inside on: the
      reasoning, the close (:func:`close_text`), the reply as rendered;
    - ``full`` continues ``prompt``: the definition, ``full`` minus ``prompt``;
    - whitespace tolerance: ``full`` and ``prompt`` differ only in whitespace after their common prefix (a
      template's indentation or line breaks leaking into one of them; the characters that are not whitespace are
      the same, in order): the prompt as it is, then the reply's own rendering from its first character that is
      not whitespace after the prompt's last one.

    Raises:
        _Diverges: none of these applies (the caller's refusal names where the texts part).
    """
    block = thinking_block(prompt, template)
    if block is None:
        if full.startswith(prompt):
            return prompt, full[len(prompt):], 0
        return prompt, full[_past_whitespace(prompt, full):].lstrip(), 0
    opening, close = block["open"], block["close"]
    reply = full[len(prompt):] if full.startswith(prompt) else None
    if reply is not None and not reply.lstrip().startswith(opening) and (
            (block["closed"] and not reasoning) or (not block["closed"] and close in reply)):
        return prompt, reply, 0  # the template writes the block's inside and close itself
    rendered = bare() if reasoning else full
    c = len(os.path.commonprefix([prompt, rendered]))
    if c < block["start"] and prompt[c:block["start"]].strip():
        raise _Diverges(c)
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
            return prompt, rest, 0
        shut = close_text(template, close, prompt[block["start"] + len(opening):block["inside"]])
        return prompt[:block["inside"]], reasoning + shut + rest, len(reasoning) + len(shut)
    if rest.startswith(close):
        return prompt, reasoning + rest, len(reasoning)
    shut = close_text(template, close, prompt[block["start"] + len(opening):])
    return prompt, reasoning + shut + rest, len(reasoning) + len(shut)


def refusal(turn: Optional[int], what: str, fix: str) -> TemplateError:
    """A :class:`TemplateError` about one conversation: ``what`` happened at message ``turn`` (None: the whole
    conversation) and the ``fix``; these three are attributes too (a record problem, :func:`sft.data.records.
    template_problem`)."""
    e = TemplateError(f"turn {turn}: {what}; {fix}" if turn is not None else f"{what}; {fix}")
    e.turn, e.what, e.fix = turn, what, fix
    return e


def _found(text: str, part: str) -> bool:
    part = part.strip()
    return not part or part in text or json.dumps(part, ensure_ascii=False)[1:-1] in text


def _claim(text: str, part: str, claimed: list) -> bool:
    """Whether ``part`` (stripped; or its JSON-escaped form) occurs in ``text`` outside the ``claimed`` character
    ranges; the first such occurrence is added to them."""
    part = part.strip()
    if not part:
        return True
    for form in (part, json.dumps(part, ensure_ascii=False)[1:-1]):
        at = text.find(form)
        while at >= 0:
            if not any(a < at + len(form) and at < b for a, b in claimed):
                claimed.append((at, at + len(form)))
                return True
            at = text.find(form, at + 1)
    return False


def _argument_values(args: dict) -> list[str]:
    """The texts of a tool call's argument values (strings as they are, other values as JSON), nested ones too."""
    out = []
    for v in args.values():
        if isinstance(v, dict):
            out += _argument_values(v)
        elif isinstance(v, str):
            out.append(v)
        else:
            out.append(json.dumps(v, ensure_ascii=False))
    return out


def _dropped(messages, tools, info, samples) -> list:
    """What the template left out (see the module docstring): ``[(turn, what, characters), ...]``. A text counts as
    present only where no longer text of the same sample claimed it first (a system prompt "Hello" is not found
    inside a user's "Hello there")."""
    out = []
    for k, (full, start, end, _close) in info.items():
        reply, m = full[start:end], messages[k]
        claimed: list = []
        parts = [("content", m["content"]), ("reasoning", m.get("reasoning_content") or "")]
        for what, part in sorted(parts, key=lambda p: -len(p[1].strip())):  # the longer claims its text first
            if not _claim(reply, part, claimed):
                out.append((k, what, len(part)))
        for c in m.get("tool_calls", ()):
            name, args = c["function"]["name"], c["function"]["arguments"]
            if name not in reply:
                out.append((k, f"tool call {name}", len(name) + len(json.dumps(args))))
                continue
            missing = [a for a in args if a not in reply]
            if missing:
                out.append((k, f"tool call {name}'s argument(s) {', '.join(missing)}", sum(map(len, missing))))
            values = [v for v in _argument_values(args) if not _found(reply, v)]
            if values:
                out.append((k, f"tool call {name}'s argument value(s)", sum(map(len, values))))
    seen = set()
    for text, _spans, last in samples:
        claimed = []
        for j, m in sorted(enumerate(messages[:last + 1]), key=lambda jm: -len(jm[1]["content"].strip())):
            present = _claim(text, m["content"], claimed)
            if m["role"] != "assistant" and (j, m["role"]) not in seen and not present:
                seen.add((j, m["role"]))
                out.append((j, f"{m['role']} text", len(m["content"])))
        for t in tools or ():
            name = t["function"]["name"]
            if ("tools", name) not in seen and name not in text:
                seen.add(("tools", name))
                out.append((-1, f"tool definition {name}", len(json.dumps(t))))
    return sorted(out, key=lambda x: x[0])


def describe_dropped(dropped: Sequence[tuple]) -> str:
    """One phrase for :attr:`Plan.dropped`: ``"the reasoning of turn 3 (120 characters), ..."``."""
    parts = [f"{what} of turn {t} ({n} characters)" if t >= 0 else f"{what} ({n} characters)"
             for t, what, n in dropped[:4]]
    return ", ".join(parts) + (f" and {len(dropped) - 4} more" if len(dropped) > 4 else "")


def one_sample_of_contents(tokenizer, roles: tuple, stops: Sequence[str]) -> bool:
    """Whether, for conversations with these roles and plain contents, the definition's trained text of every reply is
    exactly its content, all in one sample: then the content spans of :class:`sft.data.chat._Renderer` (one rendering
    per conversation, or none for an opaque template) are the definition's labels. Decided once per sequence of roles
    on a rendering with sentinel contents (for an opaque template that is a proof, since it writes any content as it
    writes the sentinel; for any other the conversation's own rendering is also compared with its filled skeleton)."""
    cache = _cache(tokenizer)
    key = ("contents", roles, tuple(stops))
    if key not in cache:
        msgs = [{"role": r, "content": f"\ue000{k}\ue001"} for k, r in enumerate(roles)]
        try:
            p = plan(tokenizer, msgs, None, stops)
        except TemplateError:
            cache[key] = False
        else:
            ok = len(p.samples) == 1 and not p.dropped
            if ok:
                text, spans, _last = p.samples[0]
                ok = [text[a:b] for a, b in spans] == [m["content"] for m in msgs if m["role"] == "assistant"] \
                    and text == render(tokenizer, msgs, None)  # not a prompt's whitespace or block in its place
            cache[key] = ok
    return cache[key]


_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "A probe.",
                                                  "parameters": {"type": "object", "properties": {}}}}


def stop_tokens(tokenizer, eot_id: int) -> list[str]:
    """The texts of the tokens that close a reply: the end-of-turn token (:func:`sft.data.chat.end_of_turn_id`), and
    the token that closes a reply holding a tool call when the template closes those with another one (gpt-oss's
    ``<|call|>``, Llama 3.1's ``<|eom_id|>``): the last special token of such a reply rendered alone (only whitespace
    after it). Probed once per template and cached."""
    cache = _cache(tokenizer)
    key = ("stops", eot_id)
    if key not in cache:
        stops = [tokenizer.convert_ids_to_tokens(eot_id)]
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "123456789", "function": {"name": "probe_tool", "arguments": {}}}]}
        try:
            user = [{"role": "user", "content": "Hi"}]
            prompt = render(tokenizer, user, [_PROBE_TOOL], True)
            full = render(tokenizer, user + [call], [_PROBE_TOOL])
        except TemplateError:
            full = prompt = ""
        if full.startswith(prompt) and "probe_tool" in full[len(prompt):]:
            enc = tokenizer(full[len(prompt):], add_special_tokens=False, return_offsets_mapping=True)
            special, added = set(tokenizer.all_special_ids), tokenizer.get_added_vocab()
            for tid, (a, b) in reversed(list(zip(enc["input_ids"], enc["offset_mapping"]))):
                token = tokenizer.convert_ids_to_tokens(tid)
                if tid in special or token in added:
                    if token not in stops:
                        stops.append(token)
                    break
                if full[len(prompt):][a:b].strip():
                    break
        cache[key] = stops
    return cache[key]
