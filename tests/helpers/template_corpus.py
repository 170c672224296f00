"""Real chat templates (llama.cpp's collection, :func:`tests.helpers.assets.chat_template_corpus_dir`) against three
kinds of conversation, with labels checked against the definition computed independently here through
``tokenizer.apply_chat_template`` (the public API). Used by tests/integration/data/test_template_corpus.py and by
``python -m tests.helpers.template_corpus`` (the table in docs/data-format.md).

The tokenizer of every template is the real Qwen vocabulary with the template's own control tokens (``<|...|>``,
``<｜...｜>``, ``<tag>``, ``[TAG]`` literals) added as special tokens, ``<s>`` / ``</s>`` as its bos / eos.
"""
from __future__ import annotations

import json
import os
import re

from sft.data.spec import PreparationSpec
from tests.helpers import assets

CONTROL = re.compile(r"<\|[^|\s'\"<>]{1,60}?\|>|<\|[a-z_]{1,30}>|<[a-z_]{1,30}\|>|<｜[^｜'\"]{1,60}?｜>|〈\|[A-Z]+\|〉"
                     r"|</?[A-Za-z_][A-Za-z0-9_\-.:]{0,40}>|\[/?[A-Z][A-Z_]{1,30}\]|\]~!?b\[|\]~b\]|\[e~\[")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
KINDS = {
    "multi-turn with a system prompt": {"messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "And an even one?"}, {"role": "assistant", "content": "Two is the only one."}]},
    "multi-turn reasoning": {"messages": [
        {"role": "user", "content": "What is 12 times 3?"},
        {"role": "assistant", "reasoning_content": "12 x 3: ten threes are 30, two more are 6, so 36.",
         "content": "36."},
        {"role": "user", "content": "Halve it."},
        {"role": "assistant", "reasoning_content": "36 / 2 = 18.", "content": "18."}]},
    "tool round trip": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Is it raining in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a1b2c3d4e", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather",
         "content": "{\"rain\": true, \"temp\": 11}"},
        {"role": "assistant", "content": "Yes, it is raining in Paris (11 degrees)."}]},
}


# The end tokens of the models whose templates need them as evidence (their generation_config.json eos_token_id):
# GLM-4.6 / GLM-4.7-Flash stop at the next role's token; Command-R7B at <|END_OF_TURN_TOKEN|> after <|END_RESPONSE|>.
# The templates that write nothing after the last reply, with the end token that they write after every other reply
# and that their model stops at: Apertus' <|assistant_end|> (its tokenizer's eos, id 68); Apriel-1.6's <|end|> (what
# the template writes after the last reply too with its own training_prompt=true, as Apriel-1.5's writes after every
# reply); Hy3's <｜hy_eos:opensource｜> (the template sets eos_token to it, and writes it after the last reply with its
# own is_training=true).
MODEL_END = {"GLM-4.6": ["<|endoftext|>", "<|user|>", "<|observation|>"],
             "GLM-4.7-Flash": ["<|endoftext|>", "<|user|>", "<|observation|>"],
             "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ["<|END_OF_TURN_TOKEN|>"],
             "Apertus-8B-Instruct": ["<|assistant_end|>"],
             "Apriel-1.6-15b-Thinker-fixed": ["<|end|>"],
             "tencent-Hy3": ["<｜hy_eos:opensource｜>"]}

# The --chat_template_kwargs a kind needs where a template's refusal without them names them: Laguna-XS switches its
# reasoning off by default (its generation prompt ends with </think> alone), Reka-Edge writes no reasoning unless
# enable_thinking is true, so reasoning data trains with it on.
# firefunction-v2 reads its function list and the date from two variables of its own (its model card passes
# functions=json.dumps(functions) and datetime to apply_chat_template).
KWARGS = {("poolside-Laguna-XS-2.1", "multi-turn reasoning"): {"enable_thinking": True},
          ("poolside-Laguna-XS.2", "multi-turn reasoning"): {"enable_thinking": True},
          ("Reka-Edge", "multi-turn reasoning"): {"enable_thinking": True},
          **{("fireworks-ai-llama-3-firefunction-v2", kind): {
              "functions": json.dumps([WEATHER["function"]]) if kind == "tool round trip" else "[]",
              "datetime": "2026-12-06"} for kind in KINDS}}

# Control tokens a template builds with str.format from a literal it sets (Hy3: '<｜hy_eos{}｜>'.format(HYTK) with
# HYTK = ':opensource'): the literal and the value.
FORMATTED = re.compile(r"'([^'{}]*\{\}[^'{}]*)'\.format\((\w+)\)")
SET_LITERAL = re.compile(r"set\s+(\w+)\s*=\s*'([^']*)'")


def control_tokens(text: str) -> set:
    """The control tokens of a template's text: :data:`CONTROL`'s matches, with those built by ``str.format``
    (:data:`FORMATTED`) as the template renders them."""
    found = set(CONTROL.findall(text))
    values = dict(SET_LITERAL.findall(text))
    for literal, name in FORMATTED.findall(text):
        if name in values:
            found |= set(CONTROL.findall(literal.replace("{}", values[name])))
    return found


def templates() -> dict[str, str]:
    """``{name: template text}`` of the corpus, by file name without ``.jinja``."""
    folder = assets.chat_template_corpus_dir()
    return {f[:-len(".jinja")]: open(os.path.join(folder, f), encoding="utf-8").read()
            for f in sorted(os.listdir(folder)) if f.endswith(".jinja")}


def shared_tokenizer(all_templates: dict[str, str]):
    """One Qwen-vocabulary tokenizer holding every template's control tokens as special tokens (set a template with
    :func:`use`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.qwen_tokenizer_dir())
    found = sorted({t for text in all_templates.values() for t in control_tokens(text)} | {"<s>", "</s>"})
    tok.add_special_tokens({"extra_special_tokens": found}, replace_extra_special_tokens=False)
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    return tok


def use(tok, template: str):
    tok.chat_template = template
    return tok


# Reasoning blocks as the corpus's templates write them: (opening with its label, closing tag, the close as the model
# writes it after reasoning). A fixed table, independent of sft.data.encode.turns' rules for finding them.
BLOCKS = [("<think>", "</think>", None), ("<|START_THINKING|>", "<|END_THINKING|>", None),
          ("<|channel>thought", "<channel|>", "\n<channel|>"), ("<think:opensource>", "</think:opensource>", None)]


# Reasoning opened in words by the generation prompt, and the close the template writes after reasoning.
WORDS = [("Here are my reasoning steps:\n", "\n[BEGIN FINAL RESPONSE]\n")]


def _generated(tok, original, shown, k, tools):
    """``(context, generated, own)`` text of reply ``k`` (``generated[own:]``: its rendering after the block's
    close): the definition, extended where the generation prompt ends inside
    a reasoning block of :data:`BLOCKS` (open, or closed empty) as docs/data-format.md says, with whitespace
    tolerance at the prompt's end; recomputed through ``apply_chat_template``."""
    def render(msgs, gen=False):
        try:
            return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
        except Exception:
            if tools is not None:
                raise
        # a template that cannot render without a tool list (Hermes' tool_use) gets an empty one
        return tok.apply_chat_template(msgs, tools=[], tokenize=False, add_generation_prompt=gen)

    prompt, full = render(shown[:k], True), render(shown[:k + 1])
    reasoning = original[k].get("reasoning_content") or ""
    tail = prompt.rstrip()
    for opening, close, written in BLOCKS:
        closed = tail.endswith(close) and tail[:-len(close)].rstrip().endswith(opening)
        if not (closed or tail.endswith(opening)):
            continue
        start = (tail[:-len(close)].rstrip() if closed else tail).rindex(opening)
        inside = start + len(opening) + (len(prompt[start + len(opening):]) - len(prompt[start + len(opening):]
                                                                                   .lstrip()))
        written_here = full[len(prompt):] if full.startswith(prompt) else ""
        if written_here and not written_here.lstrip().startswith(opening) and (
                not reasoning if closed else close in written_here):
            return prompt, full[len(prompt):], 0
        bare = render(shown[:k] + [{x: v for x, v in original[k].items() if x not in ("reasoning_content", "train")}]) \
            if reasoning else full
        at = min(len(os.path.commonprefix([prompt, bare])), start)
        rest = bare[at:].lstrip()
        for piece in (opening, close):  # the rendering's own opening / close of the block are not trained twice
            if rest.startswith(piece) and (piece == opening or closed):
                rest = rest[len(piece):].lstrip()
        if written is None:
            written = f"\n{close}\n\n" if "\n" in prompt[start:inside] else close
        if closed:
            return (prompt, rest, 0) if not reasoning else (prompt[:inside], reasoning + written + rest,
                                                             len(reasoning + written))
        head = reasoning if rest.startswith(close) else reasoning + written
        return prompt, head + rest, len(head)
    if full.startswith(prompt):
        source = tok.chat_template or ""
        own = [(o, c, w) for o, c, w in BLOCKS if o != "<think>" and o in source]  # a channel of its own (gemma-4)
        if reasoning and own and reasoning not in full[len(prompt):]:  # ... that it does not write: the model does
            opening, close, written = own[0]
            head = (opening + "\n" if opening + "\\n" in source else opening) + reasoning + (written or close)
            return prompt, head + full[len(prompt):], len(head)
        return prompt, full[len(prompt):], 0
    common = len(os.path.commonprefix([prompt, full]))
    if reasoning and full[common:].lstrip().startswith(reasoning):  # reasoning opened in words (Apriel-1.6)
        return prompt, full[common:].lstrip(), 0
    for opening, close in WORDS:  # ... and a reply without reasoning: the close after empty reasoning
        if not reasoning and prompt.endswith(opening):
            return prompt, close + full[common:], len(close)
    squeezed = re.sub(r"\s+", "", prompt)  # whitespace tolerance: the same text but for whitespace, then the reply
    at = next((j for j in range(len(full) + 1) if re.sub(r"\s+", "", full[:j]) == squeezed), None)
    if at is not None:
        return prompt, full[at:].lstrip(), 0
    opened = re.sub(rf"(?:\s*(?:{CONTROL.pattern}))+\s*\Z", "", prompt)  # a turn the rendering never opens (Apertus)
    if opened != prompt and full.startswith(opened) and full[len(opened):].lstrip().startswith(
            original[k]["content"].strip() or "\0"):  # ... and the reply's content follows the shared text
        return prompt, full[len(opened):], 0
    # history rendered differently once the reply exists: the reply as rendered after the prompt's last turn
    tail = prompt[prompt.rindex(shown[k - 1]["content"].strip()):]
    return prompt, full.split(tail)[-1], 0


def _closing(tok, messages, k, tools, stop_ids) -> str:
    """The text that closes reply ``k`` under a template that writes nothing after a reply: up to the first of
    ``stop_ids`` that the rendering with the next message puts after it, else the first of them the template
    writes after a reply that a user turn follows (the model stops there)."""
    def render(msgs):
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False)

    if k + 1 < len(messages):
        this, nxt = render(messages[:k + 1]), render(messages[:k + 2])
        if nxt.startswith(this):
            for m in CONTROL.finditer(nxt, len(this)):
                if tok.convert_tokens_to_ids(m[0]) in stop_ids and not nxt[len(this):m.start()].strip():
                    return nxt[len(this):m.end()]
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    this, nxt = render(probe), render(probe + [{"role": "user", "content": "Thanks"}])
    return next(m[0] for m in CONTROL.finditer(nxt, len(this)) if tok.convert_tokens_to_ids(m[0]) in stop_ids)


def reference(tok, messages, tools, stop_ids, original=None):
    """Per trained reply (every assistant turn): ``(ids, labels)`` of the reply's sample text (:func:`_generated`:
    ``render(turns[:k], add_generation_prompt=True)`` followed by what the model generates after it, by default
    ``render(turns[:k+1])``) up to and including the first of ``stop_ids`` (the tokens that close a reply,
    :func:`sft.data.encode.turns.stop_tokens`) after the context, labels on the tokens after the context through the
    closing token: the definition, through the public API. The context is tokenized alone (its own tokens at inference),
    what follows it apart. ``original``: the messages before the template's form of reasoning (default ``messages``)."""
    original = original or messages
    out = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        context, generated, own = _generated(tok, original, messages, k, tools)
        full = context + generated
        if not any(tok.convert_tokens_to_ids(t) in stop_ids for t in CONTROL.findall(generated[own:])):
            full += _closing(tok, messages, k, tools, stop_ids)  # a template that writes nothing after the reply
        # the context tokenized alone, as inference does, then what follows it
        ids = tok(context, add_special_tokens=False)["input_ids"]
        first = len(ids)
        enc = tok(full[len(context):], add_special_tokens=False, return_offsets_mapping=True)
        ids = ids + enc["input_ids"]
        offs = [(0, 0)] * first + [(s + len(context), e + len(context)) for s, e in enc["offset_mapping"]]
        end = next(i for i in range(first, len(ids)) if ids[i] in stop_ids and offs[i][0] >= len(context) + own)
        out.append((ids[:end + 1], [-100] * first + ids[first:end + 1]))
    return out


def outcome(tok, kind: str, model_end: tuple = ()) -> str:
    """``"trains"`` (every reply's labels equal :func:`reference`, each reply in exactly one sample; ``"trains (N
    samples)"`` when the template makes several) or ``"refused: <the one-line reason>"``. Raises AssertionError on
    labels that differ from the definition, and any other exception on a crash."""
    from sft.data.encode.samples import encode_samples
    from sft.data.records.records import normalize_record
    from sft.data.template.end_tokens import end_of_turn_id
    from sft.errors import SFTError

    conv = normalize_record("corpus", 0, KINDS[kind])
    assert not isinstance(conv, list), conv
    try:
        eot = end_of_turn_id(tok, tok.convert_tokens_to_ids(list(model_end)))
    except SFTError as e:
        return f"refused: {e}"
    spec = PreparationSpec(max_len=100_000, long_conversations="truncate")
    samples = encode_samples(tok, [conv.messages], eot, spec, [conv.tools])[0]
    if isinstance(samples, Exception):
        assert isinstance(samples, SFTError) and "\n" not in str(samples), repr(samples)
        return f"refused: {samples}"
    check_definition(tok, conv, samples, eot)
    return "trains" + (f" ({len(samples)} samples)" if len(samples) > 1 else "")


def check_definition(tok, conv, samples, eot: int, trained=None) -> None:
    """Assert that ``samples`` (:func:`sft.data.encode.samples.encode_samples`'s list for ``conv``) train every reply of
    ``trained`` (indices of ``conv.messages``; default: every assistant turn) exactly once, with labels equal to
    :func:`reference`, and nothing else."""
    from sft.data.encode.turns import stop_tokens, template_messages

    stops = set(tok.convert_tokens_to_ids(stop_tokens(tok, eot)))
    shown = template_messages(tok, conv.messages)
    replies = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant"]
    refs = reference(tok, shown, conv.tools, stops, conv.messages)
    keep = [j for j, k in enumerate(replies) if trained is None or k in trained]
    refs = [refs[j] for j in keep]
    used = [0] * len(refs)
    for ex in samples:
        ids, labels = ex["input_ids"], ex["labels"]
        expected = [-100] * len(ids)
        for j, (rids, rlabels) in enumerate(refs):
            n = len(rids)
            if ids[:n] == rids and all(labels[i] == rlabels[i] for i in range(n) if rlabels[i] != -100):
                used[j] += 1
                expected[:n] = [r if r != -100 else e for r, e in zip(rlabels, expected[:n])]
        assert labels == expected, "labels differ from the definition"
    assert used == [1] * len(refs), f"replies trained {used} times (each must be trained once)"


def outcomes() -> dict[str, list[str]]:
    """``{template name: [outcome per kind of KINDS]}`` over the whole corpus."""
    from sft.data.template.chat_template import with_template_kwargs

    found = templates()
    tok = shared_tokenizer(found)

    def one(name, text, kind):
        kwargs = KWARGS.get((name, kind))
        out = outcome(use(tok, with_template_kwargs(text, kwargs) if kwargs else text), kind, MODEL_END.get(name, ()))
        return out + (f" with --chat_template_kwargs '{json.dumps(kwargs)}'" if kwargs else "")

    return {name: [one(name, text, kind) for kind in KINDS] for name, text in found.items()}


def markdown_table(table: dict[str, list[str]]) -> str:
    """The outcome table as docs/data-format.md shows it: a refusal's reason without its fix."""
    def cell(text: str) -> str:
        if text.startswith("refused: "):
            text = "refused: " + text[len("refused: "):].split("; ")[0].replace("the chat template ", "")
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| template | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(map(cell, row)) + " |" for name, row in table.items()]
    return "\n".join(lines)


if __name__ == "__main__":  # .venv/bin/python -m tests.helpers.template_corpus (from the repository root)
    import sys

    table = outcomes()
    print(markdown_table(table))
    trained = [sum(row[k].startswith("trains") for row in table.values()) for k in range(len(KINDS))]
    print(f"\n{len(table)} templates; trained per kind: {trained}", file=sys.stderr)
