"""Templates whose generation prompt opens a reasoning block the rendered reply never contains (DeepSeek-R1 distills,
gemma-4's thought channel, Command-R's thinking switched off), the opposite case (a prompt that opens ``<think>``
and a reply that opens it again), and whitespace that differs only at the prompt's end: the trained text is what the
model generates after the prompt, checked against the definition recomputed through apply_chat_template
(tests/helpers/template_corpus.py) and spelled out. Small stand-ins for the real templates on the tiny Qwen
vocabulary (the real ones: tests/integration/data/test_template_corpus.py)."""
import copy
import json

import pytest

from sft.data.encode.samples import encode_samples
from sft.data.records.records import normalize_record
from sft.data.spec import PreparationSpec
from sft.data.template.chat_template import parse_template_kwargs, with_template_kwargs
from sft.data.template.end_tokens import end_of_turn_id, model_end_ids
from sft.errors import TemplateError
from tests.helpers.labels import split_reused_and_fresh, supervised_spans
from tests.helpers.template_corpus import check_definition

R1_DISTILL = ("{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
              "{% elif m.role == 'assistant' %}{% set c = m.content %}"
              "{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
              "<｜Assistant｜>{{ c }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
GEMMA4 = ("{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<turn|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{{ '<|channel>thought\\n<channel|>' }}{% endif %}")
COMMAND_R = ("{% for m in messages %}<|START_OF_TURN_TOKEN|>{% if m.role == 'assistant' %}<|CHATBOT_TOKEN|>"
             "<|START_RESPONSE|>{{ m.content }}<|END_RESPONSE|>{% else %}<|USER_TOKEN|>{{ m.content }}{% endif %}"
             "<|END_OF_TURN_TOKEN|>{% endfor %}{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
             "<|START_THINKING|><|END_THINKING|>{% endif %}")
THINKS_TWICE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}<think>\n{% endif %}"
                "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
                "{% endif %}")
INDENTED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{{ '  ' }}{% endif %}")
GLM = ("[gMASK]<sop>{% if tools %}<|system|>\n{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
       "{% for m in messages %}<|{{ 'observation' if m.role == 'tool' else m.role }}|>\n{{ m.content }}"
       "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
       "</tool_call>{% endfor %}{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TOKENS = ["<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "<tool_call>", "</tool_call>", "<｜User｜>",
          "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
          "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|USER_TOKEN|>",
          "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>", "[INST]", "[/INST]",
          "</s>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", "<|begin_user|>",
          "<|begin_assistant|>", "<|end|>"]
# Apriel-1.6: the prompt opens reasoning in words; the last reply's reasoning and [BEGIN FINAL RESPONSE] are rendered,
# <|end|> only after a reply that another turn follows
APRIEL = ("{% for m in messages %}{% if m.role == 'user' %}<|begin_user|>\n{{ m.content }}\n{% else %}"
          "\n<|begin_assistant|>\n{% if m.reasoning_content and loop.last %}{{ m.reasoning_content }}"
          "\n[BEGIN FINAL RESPONSE]\n{% endif %}{{ m.content }}{% if not loop.last %}\n<|end|>\n{% endif %}"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}\n<|begin_assistant|>\nHere are my reasoning steps:\n"
          "{% endif %}")
# Laguna-XS: reasoning off by default, the prompt then ends with </think> alone
LAGUNA = ("{% set enable_thinking = enable_thinking | default(false) %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n"
          "{% if m.role == 'assistant' %}{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n"
          "{% else %}</think>\n{% endif %}{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{{ '<think>' if enable_thinking else '</think>' }}"
          "{% endif %}")
# gemma-4's tool calls: a call with no result after it ends with <|tool_response>, where the model stops
GEMMA4_TOOLS = ("{% for m in messages %}{% if m.role == 'tool' %}<|tool_response>{{ m.content }}<tool_response|>"
                "{% else %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}"
                "{{ c.function.arguments | tojson }}<tool_call|>{% endfor %}"
                "{% if m.tool_calls and loop.last %}<|tool_response>{% elif not m.tool_calls %}<turn|>\n{% endif %}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<|turn>model\n<|channel>thought\n<channel|>"
                "{% endif %}")
SYSTEM_IN_LAST_TURN = ("{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}"
                       "{% set msgs = messages[1:] %}{% else %}{% set msgs = messages %}{% endif %}"
                       "{% for m in msgs %}{% if m.role == 'user' %}[INST]{% if loop.last and sys is defined %}"
                       "{{ sys }}\n\n{% endif %}{{ m.content }}[/INST]{% else %}{{ m.content }}</s>{% endif %}"
                       "{% endfor %}")
RECORD = {"messages": [{"role": "user", "content": "Is 91 prime?"},
                       {"role": "assistant", "reasoning_content": "91 = 7 x 13.", "content": "No."},
                       {"role": "user", "content": "And 97?"}, {"role": "assistant", "content": "Yes."}]}


@pytest.fixture(scope="module")
def family_tok(qwen_tok):
    tok = copy.deepcopy(qwen_tok[0])
    tok.add_special_tokens({"extra_special_tokens": TOKENS}, replace_extra_special_tokens=False)
    return tok


def trained(tok, template, record=RECORD, model_end=()):
    """``[(text before the sample's first supervised token, [supervised text, ...]), ...]`` per sample, checked
    against the definition; ``model_end``: the model's end token ids."""
    tok.chat_template = template
    eot = end_of_turn_id(tok, model_end)
    conv = normalize_record("r.jsonl", 0, record)
    samples = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=4096), [conv.tools])[0]
    if isinstance(samples, Exception):
        raise samples
    check_definition(tok, conv, samples, eot)
    out = []
    for ex in samples:
        first = next(i for i, lab in enumerate(ex["labels"]) if lab != -100)
        out.append((tok.decode(ex["input_ids"][:first]), supervised_spans(tok, ex["input_ids"], ex["labels"])))
    return out


def test_r1_distill_trains_reasoning_close_and_answer_after_the_prompts_think(family_tok):
    (ctx1, first), (ctx2, second) = trained(family_tok, R1_DISTILL)
    assert ctx1.endswith("prime?<｜Assistant｜><think>\n") and ctx2.endswith("97?<｜Assistant｜><think>\n")
    assert first == ["91 = 7 x 13.\n</think>\n\nNo.<｜end▁of▁sentence｜>"]
    # no reasoning: an empty block (">\n\n" would be one token across the prompt's end: the prompt's own tokens)
    assert second == ["\n</think>\n\nYes.<｜end▁of▁sentence｜>"]


def test_gemma4_channel_and_command_r_thinking_switched_off(family_tok):
    # the prompt closes an empty block: a reply with reasoning fills it, one without is generated after it
    (ctx1, first), (ctx2, second) = trained(family_tok, GEMMA4)
    assert ctx1.endswith("prime?<turn|>\n<|turn>model\n<|channel>thought\n")
    assert first == ["91 = 7 x 13.\n<channel|>No.<turn|>"]
    assert ctx2.endswith("97?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>") and second == ["Yes.<turn|>"]
    (ctx1, first), (ctx2, second) = trained(family_tok, COMMAND_R)
    assert ctx1.endswith("<|CHATBOT_TOKEN|><|START_THINKING|>")
    assert first == ["91 = 7 x 13.<|END_THINKING|><|START_RESPONSE|>No.<|END_RESPONSE|>"]
    assert ctx2.endswith("<|START_THINKING|><|END_THINKING|>")
    assert second == ["<|START_RESPONSE|>Yes.<|END_RESPONSE|>"]


def test_no_reply_trains_a_second_opening_of_the_block_its_prompt_opened(family_tok):
    (ctx1, first), (ctx2, second) = trained(family_tok, THINKS_TWICE)
    assert ctx1.endswith("assistant\n<think>\n") and ctx2.endswith("assistant\n<think>\n")  # the prompt's tokens
    assert first == ["91 = 7 x 13.\n</think>\n\nNo.<|im_end|>"]
    assert second == ["\n</think>\n\nYes.<|im_end|>"]


def test_whitespace_only_at_the_prompts_end_is_tolerated_and_anything_else_is_refused(family_tok):
    ((ctx, spans),) = trained(family_tok, INDENTED, {"messages": RECORD["messages"][:2]})
    assert ctx.endswith("assistant\n  ") and spans == ["<think>\n91 = 7 x 13.\n</think>\n\nNo.<|im_end|>"]
    with pytest.raises(TemplateError, match="generation prompt for this reply ends with 'x'"):
        trained(family_tok, INDENTED.replace("'  '", "'x'"), {"messages": RECORD["messages"][:2]})


def test_a_template_that_cannot_render_without_tools_renders_with_an_empty_list(family_tok):
    needs_tools = ("<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
                   + INDENTED.replace("{{ '  ' }}", ""))
    ((_ctx, spans),) = trained(family_tok, needs_tools, {"messages": RECORD["messages"][2:]})
    assert spans == ["Yes.<|im_end|>"]


def test_glm_replies_end_at_the_next_roles_token_that_generation_config_lists(family_tok, tmp_path):
    family_tok.chat_template = GLM
    with pytest.raises(TemplateError, match="writes nothing after the last reply .* and no end token of the model"):
        end_of_turn_id(family_tok, model_end_ids(str(tmp_path)))  # no generation_config.json: no evidence
    ends = family_tok.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    assert model_end_ids(str(tmp_path)) == ends
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    record = {"tools": [weather], "messages": [
        {"role": "user", "content": "Rain in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "yes"}, {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]}
    ((_ctx, spans),) = trained(family_tok, GLM, record, model_end_ids(str(tmp_path)))
    assert spans == ['<tool_call>get_weather {"city": "Paris"}</tool_call><|observation|>', "Yes.<|user|>",
                     "You are welcome.<|user|>"]


def test_chat_template_kwargs_reach_every_rendering_and_bad_ones_are_refused_up_front(family_tok):
    switch = R1_DISTILL.replace("<think>\n{% endif %}", "<think>\n{% if not enable_thinking %}</think>{% endif %}"
                                "{% endif %}")
    on = with_template_kwargs(switch, parse_template_kwargs('{"enable_thinking": true}'))
    (ctx, first), _second = trained(family_tok, on)
    assert ctx.endswith("<｜Assistant｜><think>\n") and first == ["91 = 7 x 13.\n</think>\n\nNo.<｜end▁of▁sentence｜>"]
    assert family_tok.apply_chat_template(RECORD["messages"][:1], tokenize=False, add_generation_prompt=True,
                                          enable_thinking=False).endswith("<think>\n</think>")  # a caller's own wins
    for bad, why in (('{"enable_thinking": fals}', "not JSON"), ("[1]", "a JSON object is needed"),
                     ('{"tools": []}', "not a name a chat template can read")):
        with pytest.raises(ValueError, match=why):
            parse_template_kwargs(bad)


def test_refusals_name_file_record_id_and_turn_and_no_length_warning_leaks(family_tok, caplog):
    import logging

    from sft.data.store.dataset import LazySupervisedDataset
    from sft.errors import DataError

    family_tok.chat_template = INDENTED.replace("'  '", "'x'")  # a prompt the reply's rendering does not continue
    rec = {"id": "r7", "record": 7, "messages": RECORD["messages"][2:]}
    ds = LazySupervisedDataset([rec], family_tok, end_of_turn_id(family_tok), PreparationSpec(64), "chats.jsonl")
    with pytest.raises(DataError, match=r"^chats.jsonl, record 7, id='r7', turn 1: the chat template's generation "
                                        r"prompt for this reply ends with 'x'.*; use a template"):
        ds[0]
    tok, limit = family_tok, family_tok.model_max_length
    tok.chat_template = INDENTED.replace("{{ '  ' }}", "")
    conv = normalize_record("r.jsonl", 0, {"messages": [{"role": "user", "content": "word " * 40},
                                                        {"role": "assistant", "content": "Yes."}]})
    tok.model_max_length = 16  # the conversation is longer: transformers would warn about indexing errors
    try:
        with caplog.at_level(logging.WARNING):
            (ex,) = encode_samples(tok, [conv.messages], end_of_turn_id(tok), PreparationSpec(max_len=4096), [None])[0]
    finally:
        tok.model_max_length = limit
    assert supervised_spans(tok, ex["input_ids"], ex["labels"]) == ["Yes.<|im_end|>"]
    assert "Token indices sequence length" not in caplog.text


def test_shared_prefixes_are_tokenized_once_with_the_tokens_of_the_whole_text(qwen_tok):
    from sft.data.encode.shared_prefix import common_prefix_length, tokenize_shared

    tok = qwen_tok[0]
    turn = "<|im_start|>{}\n{}<|im_end|>\n"
    history = turn.format("user", "Is 91 prime?") + turn.format("assistant", "No.") + turn.format("user", "And 97?")
    texts = [history + turn.format("assistant", "<think>\n97 has no divisor.\n</think>\n\nYes."),
             history + turn.format("assistant", "Yes.") + turn.format("user", "Thanks!"),
             "no special token at all", "no special token here either", history]
    got = tokenize_shared(tok, texts, [0, 0, 1, 1, 2])
    whole = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    assert [ids for ids, _ in got] == whole["input_ids"]
    assert [[tuple(o) for o in offs] for _, offs in got] == [
        [tuple(o) for o in offs] for offs in whole["offset_mapping"]]
    assert [common_prefix_length(a, b) for a, b in (("abc", "abd"), ("", "x"), ("ab", "ab"), ("xab", "ab"))] == [
        2, 0, 2, 0]


def test_a_reply_that_changes_the_history_before_it_is_trained_as_rendered_after_the_prompt(family_tok):
    # Mistral-Nemo's template writes the system prompt into the last user turn only while it is the last message
    record = {"messages": [{"role": "system", "content": "Be terse."}, *RECORD["messages"]]}
    record["messages"][2] = {"role": "assistant", "content": "No."}
    (ctx1, first), (ctx2, second) = trained(family_tok, SYSTEM_IN_LAST_TURN, record)
    assert ctx1.endswith("[INST]Be terse.\n\nIs 91 prime?[/INST]") and first == ["No.</s>"]
    assert ctx2.endswith("No.</s>[INST]Be terse.\n\nAnd 97?[/INST]") and second == ["Yes.</s>"]


def test_a_prompt_that_opens_reasoning_in_words_trains_the_reasoning(family_tok):
    record = copy.deepcopy(RECORD)
    record["messages"][3]["reasoning_content"] = "97 has no divisor up to 9."
    end = family_tok.convert_tokens_to_ids(["<|end|>"])
    (ctx1, first), (ctx2, second) = trained(family_tok, APRIEL, record, end)
    assert ctx1.endswith("<|begin_assistant|>\nHere are my reasoning steps:\n") and ctx2.endswith("steps:\n")
    assert first[0].endswith("91 = 7 x 13.\n[BEGIN FINAL RESPONSE]\nNo.<|end|>")  # trim_blocks: no "\\n"
    assert second[0].endswith("97 has no divisor up to 9.\n[BEGIN FINAL RESPONSE]\nYes.<|end|>")
    # a reply without reasoning: test_template_shapes.py


def test_a_prompt_that_switches_reasoning_off_refuses_reasoning_naming_the_switch_that_trains_it(family_tok):
    with pytest.raises(TemplateError, match="ends with '</think>' alone: reasoning switched off.*"
                                           "enable_thinking.*: true"):
        trained(family_tok, LAGUNA)
    # ">\\n" would be one token across the first prompt's end: that reply is a sample of its own, each context its
    # prompt's own tokens (the history keeps the reasoning)
    (ctx1, first), (ctx2, second) = trained(family_tok, with_template_kwargs(LAGUNA, {"enable_thinking": True}))
    assert ctx1.endswith("assistant\n<think>") and ctx2.endswith("assistant\n<think>"), (ctx1, ctx2)
    assert first[0].endswith("91 = 7 x 13.\n</think>\nNo.<|im_end|>") and second[0].endswith("</think>\nYes.<|im_end|>")


def test_a_tool_call_ends_where_the_template_writes_the_tool_results_opening(family_tok):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    record = {"tools": [weather], "messages": [
        {"role": "user", "content": "Rain in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "yes"}, {"role": "assistant", "content": "Yes."}]}
    samples = trained(family_tok, GEMMA4_TOOLS, record)
    call = '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|><|tool_response>'
    assert [spans for _ctx, spans in samples] == [[call], ["Yes.<turn|>"]]


def test_glm_split_reuses_a_reply_only_where_its_next_roles_token_is_the_same(family_tok, tmp_path, monkeypatch):
    """A GLM reply ends at the next message's role token (a call at <|observation|>), or at the end-of-turn token
    where its piece ends with it: a reply taken from the whole plan or an earlier piece is reused only where the
    piece has the same next message (the same pieces as planning each from scratch)."""
    family_tok.chat_template = GLM
    ends = family_tok.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    eot = end_of_turn_id(family_tok, model_end_ids(str(tmp_path)))
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    msgs = [m for r in range(6) for m in (
        {"role": "user", "content": f"Rain in city {r}, and some words around it?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{r}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": f"{r}"}}}]},
        {"role": "tool", "tool_call_id": f"c{r}", "content": "yes"},
        {"role": "assistant", "content": f"Yes, it rains in city {r}."})]
    conv = normalize_record("r.jsonl", 0, {"tools": [weather], "messages": msgs})
    reused, fresh, renders, fresh_renders = split_reused_and_fresh(family_tok, eot, conv.messages, conv.tools,
                                                                   90, monkeypatch)
    assert len(fresh) > 2 and renders < fresh_renders, (len(fresh), renders, fresh_renders)
    assert reused == fresh
    calls = {run.split("</tool_call>")[1] for ids, labels in fresh for run in supervised_spans(family_tok, ids, labels)
             if "</tool_call>" in run}
    assert calls == {"<|observation|>", "<|user|>"}, calls  # a call with its result in the piece, and one without
