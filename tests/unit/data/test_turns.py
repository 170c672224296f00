"""Labels by the definition (sft.data.encode.turns through sft.data.encode.samples.encode_samples) on Qwen3's published
chat template: reasoning, tool calls, per-reply flags, several samples where the template rewrites history; templates
that drop part of a conversation are refused by name, or trained with what they drop counted. The whole corpus of real
templates: tests/integration/data/test_template_corpus.py."""
import pytest

from sft.data.encode.conversation_samples import ConversationSamples
from sft.data.encode.report import TruncationReport
from sft.data.encode.samples import encode_samples
from sft.data.records.records import normalize_record
from sft.data.spec import PreparationSpec
from sft.data.template.chat import IGNORE_INDEX
from sft.errors import TemplateError
from tests.helpers import assets
from tests.helpers.data import AGENT
from tests.helpers.labels import split_reused_and_fresh, supervised_spans, template_copy
from tests.helpers.template_corpus import check_definition


@pytest.fixture(scope="module")
def qwen3():
    from sft.model.loading import load_tokenizer

    tok, eot, _ = load_tokenizer(assets.tiny_qwen3_chat_dir())
    return tok, eot


def encode(tok, eot, rec, **kw):
    conv = normalize_record("agent.jsonl", 0, rec)
    assert not isinstance(conv, list), [str(p) for p in conv]
    return conv, encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096, **kw), [conv.tools])[0]


@pytest.mark.parametrize("rec", AGENT, ids=[r["id"] for r in AGENT])
def test_every_agent_form_trains_exactly_the_definition_on_qwen3(qwen3, rec):
    tok, eot = qwen3
    conv, samples = encode(tok, eot, rec)
    assert isinstance(samples, ConversationSamples), samples
    trained = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant" and m.get("train") is not False]
    check_definition(tok, conv, samples, eot, trained)


def test_multi_turn_reasoning_is_one_sample_per_user_query_with_earlier_reasoning_dropped_from_context(qwen3):
    tok, eot = qwen3
    _conv, samples = encode(tok, eot, AGENT[0])
    assert len(samples) == 2 and samples.extra_samples == 1
    first, second = ([supervised_spans(tok, s["input_ids"], s["labels"]) for s in samples])
    assert first == ["<think>\nTen threes are 30, two more are 6.\n</think>\n\n36.<|im_end|>"]
    assert second == ["<think>\n36 / 2 = 18.\n</think>\n\n18.<|im_end|>"]
    context = tok.decode(samples[1]["input_ids"])
    assert "Ten threes" not in context and "<|im_start|>assistant\n36.<|im_end|>" in context  # as at inference
    report = TruncationReport()
    report.count_conversation(samples, "think-inline")
    assert any("1 conversations became 2 samples" in line for line in report.lines("train", 4096))


def test_tool_calls_are_trained_and_tool_results_and_definitions_are_not(qwen3):
    tok, eot = qwen3
    _conv, samples = encode(tok, eot, AGENT[2])
    spans = [supervised_spans(tok, s["input_ids"], s["labels"]) for s in samples]
    assert spans == [['<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                      '</tool_call><|im_end|>'],
                     ["<think>\n\n</think>\n\nYes, it is raining in Paris (11 degrees).<|im_end|>"]]
    text = tok.decode(samples[1]["input_ids"])
    assert "<tools>" in text and "<tool_response>\n{\"rain\": true, \"temp\": 11}\n</tool_response>" in text


def test_train_false_and_mask_history(qwen3):
    tok, eot = qwen3
    _conv, samples = encode(tok, eot, AGENT[5])
    assert [supervised_spans(tok, s["input_ids"], s["labels"]) for s in samples] == [
        ["<think>\n\n</think>\n\nYou are doing great.<|im_end|>"]]
    _conv, samples = encode(tok, eot, AGENT[0], last_reply_only=True)
    assert [supervised_spans(tok, s["input_ids"], s["labels"]) for s in samples] == [
        ["<think>\n36 / 2 = 18.\n</think>\n\n18.<|im_end|>"]]


# A template that strips reasoning even from the last reply, as DeepSeek-R1's does (content.split('</think>')[-1]),
# and reads no reasoning_content
STRIPS_REASONING = ("{% for m in messages %}{% set c = m.content.split('</think>')[-1] %}<|im_start|>{{ m.role }}\n"
                    "{{ c }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_drops_reasoning_or_tools_refuses_by_name_or_trains_counting_it(qwen_tok):
    tok, eot = qwen_tok
    tok = template_copy(tok, STRIPS_REASONING)
    conv = normalize_record("agent.jsonl", 3, AGENT[1])
    out = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096), [None])[0]
    assert isinstance(out, TemplateError)
    assert str(out) == ("the chat template drops reasoning of turn 1 (12 characters), so the model would never see "
                        "it; use a template that renders it (--chat_template FILE), remove it, or pass "
                        "--allow_dropped_content True to train without it")
    out = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096, allow_dropped_content=True),
                         [None])[0]
    assert supervised_spans(tok, out[0]["input_ids"], out[0]["labels"]) == ["No, 91 = 7 x 13.<|im_end|>"]
    assert out.dropped == 12
    report = TruncationReport()
    report.count_conversation(out, "reasoning-field")
    assert "train: the chat template dropped 12 characters of 1 conversations (--allow_dropped_content True)" in \
        report.lines("train", 4096)
    # ChatML writes content verbatim, reasoning too (inside it, as <think>...</think>), but neither tools nor calls
    tok, eot = qwen_tok
    conv = normalize_record("agent.jsonl", 4, AGENT[2])
    out = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096), [conv.tools])[0]
    assert isinstance(out, TemplateError) and "tool call get_weather of turn 2" in str(out)
    assert "tool definition get_weather" in str(out)
    # --allow_dropped_content: trained without the call (not trained itself) or the tools, counted
    allowed = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096, allow_dropped_content=True),
                             [conv.tools])[0]
    assert [supervised_spans(tok, ex["input_ids"], ex["labels"]) for ex in allowed] == [
        ["Yes, it is raining in Paris (11 degrees).<|im_end|>"]] and allowed.dropped > 0
    conv = normalize_record("agent.jsonl", 5, {"tools": [AGENT[2]["tools"][0]], **AGENT[3]})
    out = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096), [conv.tools])[0]
    assert isinstance(out, TemplateError) and "drops tool definition get_weather" in str(out)
    conv = normalize_record("agent.jsonl", 1, AGENT[1])
    (inline,) = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096), [None])[0]
    assert supervised_spans(tok, inline["input_ids"], inline["labels"]) == [
        "<think>\n91 = 7 x 13.\n</think>\n\nNo, 91 = 7 x 13.<|im_end|>"]


def test_a_template_that_cannot_render_a_conversation_is_one_line_naming_the_turn(qwen3):
    tok, eot = qwen3
    conv = normalize_record("agent.jsonl", 0, {"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    tok = template_copy(tok, ("{% for m in messages %}{% if m.role == 'assistant' and loop.index0 > 0 %}"
                         "{{ raise_exception('Assistant turns are not supported by this model') }}{% endif %}"
                         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    out = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096), [None])[0]
    assert isinstance(out, TemplateError) and out.turn == 1 and "\n" not in str(out)
    assert "the chat template cannot render this conversation: Assistant turns are not supported" in str(out)


def test_fast_path_labels_are_unchanged_for_plain_chatml_conversations(qwen_tok):
    """A template whose replies' trained text is exactly their content (ChatML) keeps one sample per conversation
    and the content-plus-end-of-turn labels it always had."""
    tok, eot = qwen_tok
    conv = normalize_record("toy", 0, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                       "content": "b"}, {"role": "user", "content": "c"},
                                       {"role": "assistant", "content": "d"}]})
    (sample,) = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096))[0]
    assert supervised_spans(tok, sample["input_ids"], sample["labels"]) == ["b<|im_end|>", "d<|im_end|>"]
    assert sample["labels"].count(IGNORE_INDEX) == len(sample["labels"]) - 4
    check_definition(tok, conv, [sample], eot)


def long_agent_record(rounds: int = 6, calls: int = 3) -> dict:
    """A system prompt, then ``rounds`` user queries, each answered after ``calls`` tool round trips (with reasoning
    on the final answers): an agent trajectory far longer than a small --model_max_length."""
    msgs = [{"role": "system", "content": "You are a weather agent."}]
    for r in range(rounds):
        msgs.append({"role": "user", "content": f"Question {r}: compare the weather of {calls} cities, please."})
        for c in range(calls):
            msgs.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{r}{c}", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": f"City {r}-{c}"}}}]})
            msgs.append({"role": "tool", "tool_call_id": f"c{r}{c}", "content": f"{{\"temp\": {r * 10 + c}}}"})
        msgs.append({"role": "assistant", "reasoning_content": f"Comparing the {calls} temperatures of round {r}.",
                     "content": f"Round {r}: City {r}-{calls - 1} is the warmest."})
    return {"id": "long-agent", "tools": [AGENT[2]["tools"][0]], "messages": msgs}


def runs(tok, samples):
    return sorted(s for ex in samples for s in supervised_spans(tok, ex["input_ids"], ex["labels"]))


def test_split_of_a_long_agent_conversation_trains_every_reply_once_in_pieces_that_fit(qwen3):
    tok, eot = qwen3
    conv = normalize_record("agent.jsonl", 0, long_agent_record())
    whole = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=100_000), [conv.tools])[0]
    assert max(len(ex["input_ids"]) for ex in whole) > 600
    pieces = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=300), [conv.tools])[0]
    assert isinstance(pieces, ConversationSamples) and len(pieces) >= len(whole)
    assert all(len(ex["input_ids"]) <= 300 and not ex["truncated"] for ex in pieces)
    assert runs(tok, pieces) == runs(tok, whole)  # every reply once, with the same trained tokens
    for ex in pieces:
        text = tok.decode(ex["input_ids"])
        assert text.startswith("<|im_start|>system\nYou are a weather agent.") and "<|im_start|>user\nQuestion" in text
        # a tool result never without the call it answers
        assert text.count("<tool_response>") <= text.count("<tool_call>\n{\"name\"")
    truncated = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=300, long_conversations="truncate"),
                               [conv.tools])[0]
    assert sum(ex["n_supervised"] for ex in truncated) < sum(ex["n_supervised"] for ex in pieces)


def test_split_of_a_long_reasoning_conversation_on_a_template_that_keeps_history(qwen_tok):
    """ChatML writes reasoning inside the content (<think>...</think>) and never rewrites history: one sample,
    split for length into pieces with earlier turns as context; a reply marked "train": false stays context."""
    tok, eot = qwen_tok
    msgs = [{"role": "system", "content": "Think first."}]
    for r in range(12):
        msgs += [{"role": "user", "content": f"Problem {r}: what is {r} squared plus one?"},
                 {"role": "assistant", "reasoning_content": f"{r} squared is {r * r}; plus one is {r * r + 1}.",
                  "content": f"{r * r + 1}.", **({"train": False} if r == 4 else {})}]
    conv = normalize_record("agent.jsonl", 0, {"id": "long-reasoning", "messages": msgs})
    (whole,) = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=100_000), [None])[0]
    assert len(whole["input_ids"]) > 400
    pieces = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=160), [None])[0]
    assert len(pieces) > 2 and all(len(ex["input_ids"]) <= 160 for ex in pieces)
    assert runs(tok, pieces) == runs(tok, [whole]) and len(runs(tok, pieces)) == 11
    assert all(tok.decode(ex["input_ids"]).startswith("<|im_start|>system\nThink first.<|im_end|>") for ex in pieces)
    later = tok.decode(pieces[-1]["input_ids"])  # context before its replies: earlier turns, unsupervised
    assert later.index("<|im_start|>user") < later.index("<|im_start|>assistant\n<think>")


# Found by trying to break issue 32's forms (each input kept as it was found)
KEYS_ONLY = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}{{- message['content'] }}"
             "{%- if message['tool_calls'] %}{%- for c in message['tool_calls'] %}{{- '<tool_call>' + c['function']"
             "['name'] + '(' }}{%- for k in c['function']['arguments'] %}{{- k + ',' }}{%- endfor %}"
             "{{- ')</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
NO_SYSTEM = ("{%- for message in messages %}{%- if message['role'] != 'system' %}"
             "{{- '<|im_start|>' + message['role'] + "
             "'\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def with_template(qwen_tok, template):
    tok = template_copy(qwen_tok[0], template)
    return tok, qwen_tok[1]


def test_dropped_argument_values_and_text_found_only_inside_longer_text_are_refused(qwen_tok):
    tok, eot = with_template(qwen_tok, KEYS_ONLY)
    conv = normalize_record("b.jsonl", 7, {"id": "argvals", "messages": [
        {"role": "user", "content": "Wire money"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "transfer", "arguments": {"to": "ACCOUNT-12345",
                                                                               "amount": "999999"}}}]},
        {"role": "tool", "content": "done"}, {"role": "assistant", "content": "Sent."}]})
    out = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096), [None])[0]
    assert isinstance(out, TemplateError) and "tool call transfer's argument value(s) of turn 1" in str(out)
    tok, eot = with_template(qwen_tok, NO_SYSTEM)
    for system, user in (("Hello", "Hello there"), ("Reply in French.", "Hi")):
        conv = normalize_record("b.jsonl", 8, {"messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": user},
                                                            {"role": "assistant", "content": "Hi."}]})
        out = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096), [None])[0]
        assert isinstance(out, TemplateError) and "drops system text of turn 0" in str(out), (system, out)


def test_mask_history_with_the_last_reply_not_trained_is_a_record_problem(qwen3, qwen_tok):
    rec = {"id": "mh", "messages": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"},
                                    {"role": "user", "content": "C"},
                                    {"role": "assistant", "content": "D", "train": False}]}
    for tok, eot in (qwen3, qwen_tok):  # the per-turn path and the fast path alike
        conv = normalize_record("b.jsonl", 0, rec)
        out = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096, last_reply_only=True), [None])[0]
        assert isinstance(out, TemplateError) and out.turn == 3 and "no reply left to train" in str(out)


def test_split_never_trains_an_answer_without_the_call_and_result_it_answers(qwen3):
    tok, eot = qwen3
    conv = normalize_record("b.jsonl", 3, {"id": "split-tool", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in city0?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "city0"}}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "RES0"}, {"role": "assistant", "content": "Answer0."}]})
    for max_len in (40, 64, 90):  # at 40 the answer's piece is too long by itself: truncated before it, counted
        samples = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=max_len), [None])[0]
        answers = [ex for ex in samples if "Answer0" in "".join(supervised_spans(tok, ex["input_ids"], ex["labels"]))]
        assert len(answers) == (max_len > 40), (max_len, [tok.decode(ex["input_ids"]) for ex in samples])
        for ex in answers:
            text = tok.decode(ex["input_ids"])
            assert "RES0" in text and '"city": "city0"' in text and "Weather in city0?" in text, (max_len, text)
        if max_len == 40:
            assert any(ex["truncated"] and ex["n_lost"] > 0 for ex in samples)
    pieces = encode_samples(tok, [normalize_record("b", 0, long_agent_record()).messages], eot,
                            PreparationSpec(max_len=300), [AGENT[2]["tools"]])[0]
    for ex in pieces:
        for run in supervised_spans(tok, ex["input_ids"], ex["labels"]):
            if "warmest" in run:  # a final answer: the results it compares are in its context
                assert "<tool_response>" in tok.decode(ex["input_ids"])


@pytest.mark.parametrize("max_len", [200, 300, 500])
def test_split_takes_replies_from_the_whole_plan_and_earlier_pieces_and_trains_the_same(qwen3, monkeypatch, max_len):
    """split_turns reuses what the whole conversation's plan (and a piece with the same first unit, after an
    overflow) found for a reply instead of rendering it again: the same pieces, ids and labels as planning every
    piece from scratch, with fewer renderings."""
    tok, eot = qwen3
    rec = long_agent_record()
    rec["messages"] += [m for r in range(4) for m in (
        {"role": "user", "content": f"And now think about question {r} again, at length."},
        {"role": "assistant", "reasoning_content": f"Round {r} again: " + "thinking " * 30, "content": f"Done {r}."})]
    conv = normalize_record("agent.jsonl", 0, rec)
    reused, fresh, renders, fresh_renders = split_reused_and_fresh(tok, eot, conv.messages, conv.tools, max_len,
                                                                   monkeypatch)
    assert len(fresh) > 2  # several pieces (at 200 a round with its tool results is longer by itself)
    assert reused == fresh
    assert renders < fresh_renders, (renders, fresh_renders)


@pytest.mark.parametrize("mode", ["split", "refuse"])
def test_a_conversation_known_split_by_its_longest_sample_gives_the_same_samples(qwen3, monkeypatch, mode):
    """encode_samples tokenizes a split conversation's longest sample first and, when that is longer than max_len,
    none of its whole plan's other samples (nobody reads them); split_turns' estimates take that sample's tokens and
    the plan's rendering of the whole conversation. The same samples, ids, labels and counts as tokenizing every
    sample (a batch with conversations that fit, one split, one with a unit too long by itself)."""
    import sft.data.encode.samples as samples_mod

    tok, eot = qwen3
    long = long_agent_record()
    huge = long_agent_record(rounds=2)
    huge["messages"][-1]["content"] = "Warm " * 400  # longer than max_len by itself: truncated and named
    short = {"messages": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"}]}
    convs = [normalize_record("agent.jsonl", k, r) for k, r in enumerate([short, long, huge, short])]
    spec = PreparationSpec(max_len=300, long_conversations=mode)
    texts = []
    real = samples_mod.tokenize_shared
    monkeypatch.setattr(samples_mod, "tokenize_shared", lambda t, xs, *a: texts.append(len(xs)) or real(t, xs, *a))
    got = encode_samples(tok, [c.messages for c in convs], eot, spec, [c.tools for c in convs])
    probed = sum(texts)
    monkeypatch.setattr(samples_mod, "_closes_at_cut_tokens", lambda *a: False)
    texts.clear()
    every = encode_samples(tok, [c.messages for c in convs], eot, spec, [c.tools for c in convs])
    assert [str(x) if isinstance(x, Exception) else x for x in got] == \
        [str(x) if isinstance(x, Exception) else x for x in every]
    assert probed < sum(texts), (probed, sum(texts))
    if mode == "split":
        assert any(ex["truncated"] and ex.get("cut_turn") is not None for ex in got[2])
