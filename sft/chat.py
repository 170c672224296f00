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
from typing import Optional, Sequence

from .errors import TemplateError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# ChatML, as Qwen renders it (Qwen2 tokenizer_config.json, without tools), used when a tokenizer
# has no chat template of its own.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]


def ensure_chat_template(tokenizer) -> bool:
    """Give ``tokenizer`` the ChatML template if it has none; add ChatML's special tokens if missing.

    Returns:
        True when tokens were added to the vocabulary (the model's embeddings must then be resized).
    """
    if tokenizer.chat_template:
        return False
    logger.info("the tokenizer has no chat template: using ChatML (<|im_start|>{role}\\n{content}<|im_end|>\\n)")
    tokenizer.chat_template = CHATML_TEMPLATE
    vocab = tokenizer.get_vocab()
    missing = [t for t in (IM_START, IM_END) if t not in vocab]
    if missing:
        logger.warning("adding ChatML tokens %s to the vocabulary; their embeddings will be trained", missing)
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_additional_special_tokens=False)
    return bool(missing)


def render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """Render ``messages`` to text with the tokenizer's chat template."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def end_of_turn_id(tokenizer) -> int:
    """The special token that closes an assistant turn in this chat template (e.g. ``<|im_end|>``).

    Found by rendering a probe conversation and taking the token right after the reply.

    Raises:
        TemplateError: the template puts something other than a special token after the reply.
    """
    text, spans = render_with_spans(tokenizer, _PROBE)
    end = spans[0][1]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for tid, (s, _e) in zip(enc["input_ids"], enc["offset_mapping"]):
        if s >= end:
            if tid in set(tokenizer.all_special_ids) or tokenizer.convert_ids_to_tokens(tid) in tokenizer.get_added_vocab():
                return tid
            break
    raise TemplateError("the chat template does not close an assistant reply with a special token "
                        f"(rendered: {text!r}); use a template whose assistant turns end with one, e.g. ChatML")


def chat_token_ids(tokenizer) -> list[int]:
    """Ids of the special tokens the chat template emits (e.g. ``<|im_start|>``, ``<|im_end|>``)."""
    text = render(tokenizer, [{"role": "system", "content": "S"}, *_PROBE])
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
        spans.append((out_len, out_len + len(m["content"])))
        pieces.append(m["content"])
        out_len += len(m["content"])
        pos = at + len(mark)
    pieces.append(s_text[pos:])
    if "".join(pieces) == text and len(spans) == sum(m["role"] == "assistant" for m in messages):
        return text, spans
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:k], add_generation_prompt=True)
        start, end = len(prefix), len(prefix) + len(m["content"])
        if not text.startswith(prefix) or text[start:end] != m["content"]:
            raise TemplateError("the chat template renders earlier turns differently once later turns are added "
                                f"(turn {k}), so reply spans cannot be located; use a template without such rewriting")
        spans.append((start, end))
    return text, spans


def labels_from_spans(ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]],
                      eot_id: int) -> list[int]:
    """Labels for tokenized text: ``ids[i]`` where token i overlaps a reply span, the end-of-turn token
    right after each reply, ``-100`` elsewhere.

    Raises:
        TemplateError: a reply is not followed by ``eot_id``.
    """
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


def encode_conversations(tokenizer, conversations: Sequence[Sequence[dict]], eot_id: int,
                         context_replies: Optional[Sequence[int]] = None) -> list[tuple[list[int], list[int]]]:
    """Token ids and labels of many conversations, built together (one batched tokenizer call).

    Args:
        tokenizer: a fast (``tokenizers``-backed) tokenizer with a chat template.
        conversations: each ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``, validated.
        eot_id: the end-of-turn token id (:func:`end_of_turn_id`).
        context_replies: per conversation, how many of its leading assistant replies are context only
            (rendered, not supervised; used for the later pieces of a split long conversation,
            :mod:`sft.long_conversations`). Default: every reply is supervised.

    Returns:
        One ``(input_ids, labels)`` per conversation: lists of int of equal length, not truncated.
        ``input_ids`` equals ``tokenizer.apply_chat_template(messages)``; ``labels[i]`` is
        ``input_ids[i]`` for supervised tokens and ``-100`` otherwise.

    Raises:
        TemplateError: see :func:`render_with_spans` and :func:`labels_from_spans`.
    """
    rendered = [render_with_spans(tokenizer, msgs) for msgs in conversations]
    skip = context_replies if context_replies is not None else [0] * len(rendered)
    enc = tokenizer([t for t, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    return [(ids, labels_from_spans(ids, offs, spans[k:], eot_id))
            for ids, offs, (_, spans), k in zip(enc["input_ids"], enc["offset_mapping"], rendered, skip)]


def encode_conversation(tokenizer, messages: Sequence[dict], eot_id: int) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation; see :func:`encode_conversations`."""
    return encode_conversations(tokenizer, [messages], eot_id)[0]


def _close_turn(ids, labels, last, eot_id, j):
    nxt = last + 1
    if last < 0 or nxt >= len(ids) or ids[nxt] != eot_id:
        raise TemplateError(f"assistant reply {j} is not followed by the end-of-turn token id {eot_id}")
    labels[nxt] = eot_id


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
