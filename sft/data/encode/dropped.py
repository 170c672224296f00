"""The dropped-content check of :func:`sft.data.encode.turns.plan`: what a chat template left out of a conversation's
samples (a reply's content, reasoning or tool call missing from its trained text; a system, user or tool text missing
from a sample; the record's tools missing from a sample), each text claiming its own occurrence."""
from __future__ import annotations

import json
from bisect import bisect_left, insort
from functools import lru_cache

from sft.data.records.messages import message_text


def _found(text: str, part: str) -> bool:
    part = part.strip()
    return not part or part in text or _escaped(part) in text


@lru_cache(maxsize=4096)
def _escaped(part: str) -> str:
    """``part`` as a JSON string writes it, without the quotes (a template that writes a text through ``tojson``);
    memoized: :func:`dropped` checks a conversation's texts once per sample that holds them."""
    return json.dumps(part, ensure_ascii=False)[1:-1]


def _claim(text: str, part: str, claimed: list) -> bool:
    """Whether ``part`` (stripped; or its JSON-escaped form) occurs in ``text`` outside the ``claimed`` character
    ranges (disjoint, kept sorted: an occurrence is checked against its neighbour only); the first such occurrence is
    added to them."""
    part = part.strip()
    if not part:
        return True
    if _claim_form(text, part, claimed):
        return True
    escaped = _escaped(part)  # only where the text itself is not found (nothing to escape: the same search)
    return escaped != part and _claim_form(text, escaped, claimed)


def _claim_form(text: str, form: str, claimed: list) -> bool:
    at = text.find(form)
    while at >= 0:
        i = bisect_left(claimed, (at + len(form),)) - 1  # the last range starting before the occurrence ends
        if i < 0 or claimed[i][1] <= at:
            insort(claimed, (at, at + len(form)))
            return True
        at = text.find(form, claimed[i][1])  # an occurrence starting inside that range overlaps it too
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


def dropped(messages, tools, info, samples) -> list:
    """What the template left out (:mod:`sft.data.encode.turns`' docstring): ``[(turn, what, characters), ...]``. A text
    counts as present only where no longer text of the same sample claimed it first (a system prompt "Hello" is not
    found inside a user's "Hello there")."""
    out = []
    for k, (full, start, end, _close) in info.items():
        reply, m = full[start:end], messages[k]
        claimed: list = []
        parts = [("content", message_text(m)), ("reasoning", m.get("reasoning_content") or "")]
        for what, part in sorted(parts, key=lambda p: -len(p[1].strip())):  # the longer claims its text first
            if not _claim(reply, part, claimed):
                out.append((k, what, len(part)))
        # each call claims its own occurrence of its name, the longer first (a call "search" is not found inside
        # "web_search", a second identical call not in the first, a call named in the content not in the content)
        for c in sorted(m.get("tool_calls", ()), key=lambda c: -len(c["function"]["name"])):
            name, args = c["function"]["name"], c["function"]["arguments"]
            if not _claim(reply, name, claimed):
                out.append((k, f"tool call {name}", len(name) + len(json.dumps(args))))
                continue
            missing = [a for a in args if a not in reply]
            if missing:
                out.append((k, f"tool call {name}'s argument(s) {', '.join(missing)}", sum(map(len, missing))))
            values = [v for v in _argument_values(args) if not _found(reply, v)]
            if values:
                out.append((k, f"tool call {name}'s argument value(s)", sum(map(len, values))))
    seen = set()
    # the longer claims its text first; sorted once (a stable sort: each sample's messages in the same order), each
    # text stripped once (what _claim would do per sample)
    order = sorted(((j, m["role"], message_text(m).strip(), len(message_text(m))) for j, m in enumerate(messages)),
                   key=lambda x: -len(x[2]))
    for text, _spans, last in samples:
        claimed = []
        for j, role, part, chars in order:
            if j > last:
                continue
            present = (not part or _claim_form(text, part, claimed)
                       or ((escaped := _escaped(part)) != part and _claim_form(text, escaped, claimed)))
            if role != "assistant" and (j, role) not in seen and not present:
                seen.add((j, role))
                out.append((j, f"{role} text", chars))
        for t in tools or ():
            name = t["function"]["name"]
            if ("tools", name) not in seen and name not in text:
                seen.add(("tools", name))
                out.append((-1, f"tool definition {name}", len(json.dumps(t))))
    return sorted(out, key=lambda x: x[0])
