"""Where a reply ends: the special token that closes an assistant turn in a chat template and stops generation,
found by rendering probes, with the model's own end tokens (``generation_config.json``'s ``eos_token_id``, the
tokenizer's eos) as evidence the template alone does not give (:mod:`sft.data.encode.turns` trains up to it)."""
from __future__ import annotations

import json
import os
from typing import Sequence

from sft.data.template.chat import PROBE, render_with_spans
from sft.errors import TemplateError


def model_end_ids(path: str) -> list[int]:
    """The token ids that stop generation for the model folder ``path``: ``generation_config.json``'s
    ``eos_token_id`` (an id or a list of ids; GLM-4.6 lists ``<|endoftext|>``, ``<|user|>`` and ``<|observation|>``),
    ``[]`` where the folder has none or it does not say."""
    try:
        with open(os.path.join(path, "generation_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    eos = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in eos if isinstance(i, int) and not isinstance(i, bool)]


def end_of_turn_id(tokenizer, model_end: Sequence[int] = ()) -> int:
    """The special token that closes an assistant turn in this chat template and stops generation (e.g.
    ``<|im_end|>``).

    Found by rendering a probe conversation: the first special token after the reply (whitespace before it, as in
    ``reply\n<|end|>``, is allowed: it is trained as part of the reply, :mod:`sft.data.encode.turns`), or, where the
    template writes several in a row, the first of them that is one of the model's end tokens (``model_end``, the ids of
    :func:`model_end_ids`, and the tokenizer's eos): Command-R's ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`` stops at the
    latter. A template that writes nothing after the last reply (GLM-4.6 stops at the next role's token) closes a reply
    with the first special token it writes after a reply that a user turn follows, when that is one of the model's end
    tokens.

    Raises:
        TemplateError: the template writes something other than a special token after the last reply, or nothing
            and no end token of the model follows a reply either.
    """
    ends = set(model_end) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    text, spans = render_with_spans(tokenizer, PROBE)
    run = special_run(tokenizer, text, spans[0][1])
    inside = _opening_tokens(tokenizer, text, spans[0][0])
    if run and run[0] in inside:  # Kimi-K3: <|close|>response<|sep|>...<|end_of_msg|>; <|close|> opens the reply too
        first, run = run[0], [t for t in _specials(tokenizer, text, spans[0][1]) if t not in inside]
        if not run:
            raise TemplateError(f"the chat template closes a reply with {tokenizer.convert_ids_to_tokens(first)}, "
                                "which it also writes inside a reply before its content (a model that stops there "
                                "would stop before its reply), and no other special token follows a reply; use a "
                                "template whose assistant turns end with a token of their own, e.g. ChatML")
    if run:
        return next((t for t in run if t in ends), run[0])
    end = spans[0][1]
    if not text[end:].strip() and ends:
        try:
            longer, at = render_with_spans(tokenizer, [*PROBE, {"role": "user", "content": "Thanks"}])
        except TemplateError:
            at = []
        run = special_run(tokenizer, longer, at[0][1]) if at else []
        if run and run[0] in ends:
            return run[0]
    if text[end:] and not text[end:].strip():  # RWKV World: "\n\n", which its model stops at (llama.cpp's EOT)
        raise TemplateError(f"the chat template writes only whitespace ({text[end:end + 8]!r}) after a reply, no "
                            "special token: a model that stops at plain text cannot be trained to stop here (replies "
                            "end at special tokens), and a reply holding that text itself would end early; use a "
                            "template whose assistant turns end with a special token, e.g. ChatML")
    after = f"writes {text[end:end + 40]!r} after the last reply" if text[end:].strip() else \
        "writes nothing after the last reply (the model would not learn to stop)"
    known = ", ".join(tokenizer.convert_ids_to_tokens(sorted(ends))) or "none"
    raise TemplateError(f"the chat template {after}, not a special end-of-turn token, and no end token of the model "
                        f"(generation_config.json eos_token_id, the tokenizer's eos: {known}) follows a reply either; "
                        "use a template whose assistant turns end with one, e.g. ChatML")


def _opening_tokens(tokenizer, text: str, start: int) -> set:
    """The special tokens the template writes inside the probe's reply before its content (after the generation
    prompt): none of them stops generation, or the model would stop before its reply."""
    from sft.data.template.chat import render

    try:
        prompt = render(tokenizer, PROBE[:1], add_generation_prompt=True)
    except TemplateError:
        return set()
    if not text.startswith(prompt) or start < len(prompt):
        return set()
    return set(_specials(tokenizer, text[len(prompt):start], 0))


def _specials(tokenizer, text: str, end: int) -> list[int]:
    """Every special (or added) token of ``text`` after character ``end``, in order."""
    return [tid for tid, s, _e, special in token_spans(tokenizer, text) if s >= end and special]


def token_spans(tokenizer, text: str) -> list[tuple[int, int, int, bool]]:
    """``text`` tokenized without extra special tokens: ``(id, start, end, special)`` per token, ``special`` for the
    tokenizer's special and added tokens (the chat template's control tokens)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    special, added = set(tokenizer.all_special_ids), tokenizer.get_added_vocab()
    return [(tid, s, e, tid in special or tokenizer.convert_ids_to_tokens(tid) in added)
            for tid, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])]


def special_run(tokenizer, text: str, end: int) -> list[int]:
    """The special tokens right after character ``end`` of ``text``, in a row (whitespace between them allowed)."""
    run = []
    for tid, s, e, special in token_spans(tokenizer, text):
        if s >= end:
            if special:
                run.append(tid)
            elif text[s:e].strip():
                break
    return run
