"""Labels by the definition, reply by reply: what the model must generate at inference, on any chat template.

For an assistant turn ``k`` of ``turns`` the trained text is

    render(turns[:k+1])  minus  render(turns[:k], add_generation_prompt=True)

up to and including the end-of-turn token that closes it (the template's,
:func:`sft.data.template.end_tokens.end_of_turn_id`):
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

Content the template drops is counted, never silent (:class:`TurnPlan` ``dropped``): a reply's content, reasoning or
tool call (its function name) missing from its trained text; a system, user or tool text missing from a sample;
the record's tools missing from a sample.

How reasoning is handed over: as ``reasoning_content`` (Qwen3, GLM, DeepSeek-V3.1, ... read it; transformers also
copies it to ``thinking``, gpt-oss's name) when the template writes that field, else as ``reasoning_content`` where the
template has a reasoning channel of its own that is not ``<think>`` (gemma-4's ``<|channel>thought``: the model
generates the reasoning in it, :mod:`sft.data.encode.thinking`), else inside the content as
``<think>\\n...\\n</think>\\n\\n`` when the template writes that, else as ``reasoning_content`` (and then counted as
dropped). Decided once per template by rendering a probe
(:attr:`sft.data.template.profile.TemplateProfile.reasoning_form`).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from sft.data.encode.dropped import dropped as _dropped
from sft.data.encode.thinking import Need, Parted, ReplyTexts, continuation
from sft.data.records.messages import message_text
from sft.data.refusal import Refusal
from sft.data.template.forms import (
    PROBE_CONTENT,
    PROBE_REASONING,
    PROBE_TOOL,
    probe_call,
    render_with_tools,
    template_cache,
    with_reasoning,
)
from sft.data.template.profile import template_messages, template_profile
from sft.errors import TemplateError


@dataclass
class TurnPlan:
    """The samples of one conversation: ``samples`` = ``[(text, spans, last_turn), ...]`` in conversation order, each
    ``text`` a rendering of ``turns[:last_turn + 1]`` and ``spans`` its trained replies' ``(start, end)`` characters
    (end = where the end-of-turn token starts); ``dropped`` = ``[(turn, what, characters), ...]`` the template left
    out (see the module docstring)."""

    samples: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    replies: dict = field(default_factory=dict)  # per trained reply, what plan found (plan's ``known``)
    rendering: Optional[str] = None  # render(turns) when plan rendered it (the last turn a reply it trains)


def trained_turns(messages: Sequence[dict], last_reply_only: bool = False) -> list[int]:
    """Indices of the assistant turns to train: all not marked ``"train": False``; with ``last_reply_only`` (the
    peers' ``mask_history``) only the last assistant turn, if it is not so marked."""
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if last_reply_only:
        replies = replies[-1:]
    return [k for k in replies if messages[k].get("train") is not False]


def plan(tokenizer, messages: Sequence[dict], tools: Optional[list], stops: Sequence[str],
         last_reply_only: bool = False, known: Optional[dict] = None, count_dropped: bool = True) -> TurnPlan:
    """The samples of one conversation by the definition (module docstring).

    Args:
        messages: validated message dicts (:mod:`sft.data.records.messages`), the default system prompt applied.
        tools: the record's tool schemas, or None.
        stops: the texts of the tokens that close a reply (:func:`stop_tokens`); a reply ends at the first of them.
        known: per reply index, its result from another plan whose messages up to that reply (and the next
            message, for a template whose replies end at the next role's token) are these (:attr:`TurnPlan.replies`:
            :mod:`sft.data.encode.split_turns` reuses the whole conversation's plan for a piece that starts with it);
            those replies are not rendered again.
        count_dropped: False: leave :attr:`TurnPlan.dropped` empty (a caller that does not read it).

    Seven parameters, one over the house's six: the last three are options with defaults, passed by keyword by the
    one caller that sets them (:mod:`sft.data.encode.split_turns`); a value type for them would serve that caller alone.

    Raises:
        TemplateError: the template cannot render the conversation (its own message), renders a reply's context
            differently from its generation prompt, or does not close a reply with one of ``stops``; the message
            names the turn. A reply the template writes nothing of (a tool call under a template that ignores
            ``tool_calls``) is not trained and is counted in :attr:`TurnPlan.dropped`.
    """
    shown = template_messages(tokenizer, messages)
    info, empty, renders = {}, [], {}
    out = TurnPlan()
    for k in trained_turns(messages, last_reply_only):
        got = known.get(k) if known else None
        out.replies[k] = got = got or _reply(tokenizer, messages, shown, k, tools, stops, renders)
        if got[0] == "empty":
            empty.append(got[1])
        else:
            info[k] = got[1]
    out.rendering = renders.get(len(messages))
    todo = sorted(info, reverse=True)
    while todo:
        text = info[todo[0]][0]
        group = [j for j in todo if text.startswith(info[j][0][:info[j][3]])]
        out.samples.append((text, [info[j][1:3] for j in sorted(group)], todo[0]))
        todo = [j for j in todo if j not in group]
    out.samples.reverse()
    if count_dropped:
        out.dropped = sorted(empty + _dropped(messages, tools, info, out.samples), key=lambda x: x[0])
    return out


def _reply(tokenizer, messages: Sequence[dict], shown: list[dict], k: int, tools, stops: Sequence[str],
           renders: Optional[dict] = None) -> tuple:
    """Reply ``k`` of :func:`plan`: ``("info", (text, prompt_end, end, close_end))``, its sample text up to its end
    (``text[prompt_end:end]`` trained, ``text[end:close_end]`` the stop token), or ``("empty", (k, what, chars))``
    where the template writes nothing of it; ``renders[k + 1]`` = ``render(turns[:k+1])``. Raises as :func:`plan`.
    Seven parameters: the conversation in the record's form (``messages``: reasoning, calls, flags) and in the
    template's (``shown``) are both read, and ``renders`` is :func:`plan`'s memo across its replies."""
    source = tokenizer.chat_template or ""
    reasoning = messages[k].get("reasoning_content") or ""
    try:
        prompt = render_with_tools(tokenizer, shown[:k], tools, generation_prompt=True)
        full = render_with_tools(tokenizer, shown[:k + 1], tools)
        texts = ReplyTexts(prompt, full, reasoning, message_text(shown[k - 1]).strip() if k else "",
                           template_profile(tokenizer).reasoning_channel)
        given = {}
        while isinstance(got := continuation(source, texts, given), Need):  # each rendering made where a rule reads it
            given[got.what] = _rendering(tokenizer, _At(shown, k, tools, messages[k]), texts, got.what)
    except TemplateError as e:
        raise Refusal(k, str(e), "the template's own limit: rewrite the conversation in a form it renders, or use "
                      "another template") from None
    if isinstance(got, Parted):
        raise _parted(k, source, texts, got.at)
    prompt, reply, own = got
    rendered, full = full, prompt + reply
    if renders is not None and k + 1 == len(messages):
        renders[k + 1] = rendered
    ends = [(at, t) for t in stops if (at := full.find(t, len(prompt) + own)) >= 0]  # after the block's close
    next_role = template_profile(tokenizer).ends_at_next_role
    if not ends and next_role and not full[len(prompt) + own:].endswith(tuple(stops)):
        full += _next_role(tokenizer, shown, k, tools, rendered, stops)
        ends = [(at, t) for t in stops if (at := full.find(t, len(prompt) + own)) >= 0]
    if not ends:
        raise Refusal(k, f"the chat template does not close this reply with its end-of-turn token "
                      f"({' or '.join(stops)})", "use a template whose replies end with one")
    end, stop = min(ends)
    late = [c["function"]["name"] for c in messages[k].get("tool_calls", ())
            if c["function"]["name"] not in full[len(prompt) + own:end] and c["function"]["name"] in full[end:]]
    if late:  # GigaChat3 writes a call as a message of its own role after the reply's end token
        raise Refusal(k, f"the chat template writes tool call {late[0]} after this reply's end token ({stop}), "
                      "where a model that stops at that token never generates it", "use a template that writes "
                      "calls inside the reply (GigaChat3.1's does), or train this reply without its calls")
    if not reasoning and not full[len(prompt) + own:end].strip():  # the template writes nothing of this reply:
        m = messages[k]  # dropped, not trained
        return "empty", (k, " and ".join(f"tool call {c['function']['name']}" for c in m.get("tool_calls", ()))
                         or "content", len(message_text(m)) + len(json.dumps(m.get("tool_calls", ""))))
    return "info", (full, len(prompt), end, end + len(stop))


class _At(NamedTuple):
    """Reply ``k`` of a conversation: its turns in the template's form (``shown``), the record's tools and the reply's
    message as the record has it."""
    shown: list
    k: int
    tools: Optional[list]
    message: dict


def _rendering(tokenizer, at: _At, texts: ReplyTexts, what: str):
    """The rendering :func:`sft.data.encode.thinking.continuation` asks for (:class:`sft.data.encode.thinking.Need`):
    ``"bare"``, the conversation up to the reply without its reasoning; ``"reasoned"``, ``(text, probe)``: with a probe
    reasoning in the template's form; ``"unopened"``, the character where the reply's rendering (a probe content first)
    starts right after the prompt's special tail, or None."""
    shown, k, tools = at.shown, at.k, at.tools
    if what == "bare":
        return render_with_tools(tokenizer, shown[:k] + [_without_reasoning(at.message)], tools)
    if what == "reasoned":
        form = template_profile(tokenizer).reasoning_form
        probe = with_reasoning(shown[k], PROBE_REASONING, "field" if form == "none" else form)
        return render_with_tools(tokenizer, shown[:k] + [probe], tools), PROBE_REASONING
    text = texts.prompt
    end = _special_tail(tokenizer, text)
    if end == len(text) or not texts.full.startswith(text[:end]):
        return None
    probe = {x: v for x, v in shown[k].items() if x not in ("reasoning_content", "thinking")}
    marked = render_with_tools(tokenizer, shown[:k] + [{**probe, "content": PROBE_CONTENT}], tools)
    return end if marked.startswith(text[:end]) and marked[end:].lstrip().startswith(PROBE_CONTENT) else None


def _parted(k: int, source: str, texts: ReplyTexts, c: int) -> Refusal:
    """The refusal of reply ``k`` whose rendering parts from its generation prompt at character ``c``
    (:class:`sft.data.encode.thinking.Parted`)."""
    prompt, full = texts.prompt, texts.full
    off = re.search(r"</[^<>\s]*(?:think|thought|reason)[^<>\s]*>\s*\Z", prompt, re.IGNORECASE)
    if texts.reasoning and off:  # Laguna-XS: <assistant>\n</think> by default, <think> with enable_thinking
        switch = (" (--chat_template_kwargs '{\"enable_thinking\": true}': this template reads it)"
                  if "enable_thinking" in source else "")
        return Refusal(k, f"the chat template's generation prompt for this reply ends with {off[0].strip()!r} "
                       "alone: reasoning switched off, so the model generates no reasoning after it, and this "
                       "reply has some", f"switch the template's reasoning on{switch}, or remove the reply's "
                       "reasoning_content")
    return Refusal(k, f"the chat template's generation prompt for this reply ends with {prompt[c:][:40]!r}, but "
                   f"its rendering of the reply has {full[c:c + 40]!r} there, so what the model generates "
                   "after the prompt is not defined", "use a template whose replies continue its generation "
                   "prompt")


def _special_tail(tokenizer, text: str, window: int = 400) -> int:
    """Where the run of special (or added) tokens that ``text`` ends with begins, whitespace before and between them
    included; ``len(text)`` where it ends with none. Only the last ``window`` characters are tokenized (a special
    token cut there is text, so the run ends after it)."""
    from sft.data.template.end_tokens import token_spans

    at = max(0, len(text) - window)
    start, seen = len(text), False
    for _tid, a, b, special in reversed(token_spans(tokenizer, text[at:])):
        if special:
            start, seen = at + a, True
        elif not text[at + a:at + b].strip():
            start = at + a if seen else start
        else:
            break
    return start if seen else len(text)


def _next_role(tokenizer, shown, k: int, tools, rendered: str, stops: Sequence[str]) -> str:
    """What closes reply ``k`` under a template that writes nothing after the last reply: the text up to and
    including the first of ``stops`` that the rendering with the next message puts after ``rendered`` (the rendering
    of ``shown[:k+1]``), or the end-of-turn token ``stops[0]`` after the last message (the model stops there)."""
    if k + 1 < len(shown):
        try:
            nxt = render_with_tools(tokenizer, shown[:k + 2], tools)
        except TemplateError:
            nxt = ""
        if nxt.startswith(rendered):
            after = nxt[len(rendered):]
            found = [(at, t) for t in stops if (at := after.find(t)) >= 0 and not after[:at].strip()]
            if found:
                at, stop = min(found)
                return after[:at + len(stop)]
    return stops[0]


def _without_reasoning(msg: dict) -> dict:
    return {k: v for k, v in msg.items() if k not in ("train", "reasoning_content")}


def describe_dropped(dropped: Sequence[tuple]) -> str:
    """One phrase for :attr:`TurnPlan.dropped`: ``"the reasoning of turn 3 (120 characters), ..."``."""
    parts = [f"{what} of turn {t} ({n} characters)" if t >= 0 else f"{what} ({n} characters)"
             for t, what, n in dropped[:4]]
    return ", ".join(parts) + (f" and {len(dropped) - 4} more" if len(dropped) > 4 else "")


def one_sample_of_contents(tokenizer, roles: tuple, stops: Sequence[str]) -> bool:
    """Whether, for conversations with these roles and plain contents, the definition's trained text of every reply is
    exactly its content, all in one sample: then the content spans of :class:`sft.data.template.chat.Renderer` (one
    rendering
    per conversation, or none for an opaque template) are the definition's labels. Decided once per sequence of roles
    on a rendering with sentinel contents (for an opaque template that is a proof, since it writes any content as it
    writes the sentinel; for any other the conversation's own rendering is also compared with its filled skeleton)."""
    cache = template_cache(tokenizer)
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
                ok = [text[a:b] for a, b in spans] == [message_text(m) for m in msgs if m["role"] == "assistant"] \
                    and text == render_with_tools(tokenizer, msgs, None)  # not a prompt's whitespace or block
            cache[key] = ok
    return cache[key]


def stop_tokens(tokenizer, eot_id: int) -> list[str]:
    """The texts of the tokens that close a reply: the end-of-turn token (:func:`sft.data.template.end_tokens.
    end_of_turn_id`), and the token that closes a reply holding a tool call when the template closes those with
    another one (gpt-oss's ``<|call|>``, Llama 3.1's ``<|eom_id|>``, gemma-4's ``<|tool_response>``): the last special
    token of such a reply rendered alone (only whitespace after it; the reply: the rendering after the text it shares
    with the generation prompt), or, where a reply ends at the next role's token
    (:attr:`sft.data.template.profile.TemplateProfile.ends_at_next_role`), the first special token after it when a tool
    result
    follows. Probed once per template and cached."""
    cache = template_cache(tokenizer)
    key = ("stops", eot_id)
    if key not in cache:
        stops = [tokenizer.convert_ids_to_tokens(eot_id)]
        call = probe_call({})
        try:
            user = [{"role": "user", "content": "Hi"}]
            prompt = render_with_tools(tokenizer, user, [PROBE_TOOL], True)
            full = render_with_tools(tokenizer, user + [call], [PROBE_TOOL])
        except TemplateError:
            full = prompt = ""
        next_role = template_profile(tokenizer).ends_at_next_role
        if full.startswith(prompt) and "probe_tool" in full[len(prompt):] and next_role:
            result = {"role": "tool", "tool_call_id": "123456789", "name": "probe_tool", "content": "ok"}
            try:  # the reply holding the call ends at the token that opens the tool result (GLM's <|observation|>)
                after = render_with_tools(tokenizer, user + [call, result], [PROBE_TOOL])
            except TemplateError:
                after = ""
            if after.startswith(full):
                from sft.data.template.end_tokens import special_run

                run = special_run(tokenizer, after, len(full))
                token = tokenizer.convert_ids_to_tokens(run[0]) if run else None
                if token and token not in stops:
                    stops.append(token)
        elif "probe_tool" in full[len(os.path.commonprefix([prompt, full])):]:
            # after the text the prompt and the reply share: a prompt that ends with an empty thought channel
            # (gemma-4's <|channel>thought\n<channel|>) is not what a reply holding a call renders
            from sft.data.template.end_tokens import token_spans

            reply = full[len(os.path.commonprefix([prompt, full])):]
            for tid, a, b, special in reversed(token_spans(tokenizer, reply)):
                if special:
                    token = tokenizer.convert_ids_to_tokens(tid)
                    if token not in stops:
                        stops.append(token)
                    break
                if reply[a:b].strip():
                    break
        cache[key] = stops
    return cache[key]
