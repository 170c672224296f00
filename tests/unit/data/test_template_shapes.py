"""Template shapes past the ones of test_template_families.py: a reply whose first closing token also opens it
(Kimi-K3), tool call arguments the template needs as a string (functionary-v3.2), a turn the rendering continues
without the generation prompt's opening (Apertus after tool results), a tool call written as a turn of its own after
the reply's end token (GigaChat3), a reply without reasoning after a prompt that opens reasoning in words (Apriel-1.6),
and the refusals that name the template's own fault. Small stand-ins on the tiny Qwen vocabulary, checked against the
definition recomputed through apply_chat_template (tests/helpers/template_corpus.py); the real templates:
tests/integration/data/test_template_corpus.py."""
import copy

import pytest

from sft.data.chat import render
from sft.data.end_tokens import end_of_turn_id
from sft.data.turns import arguments_form
from sft.errors import TemplateError
from tests.unit.data.test_template_families import APRIEL, RECORD, TOKENS, trained

SHAPE_TOKENS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|user_start|>", "<|user_end|>",
                "<|assistant_start|>", "<|assistant_end|>", "<|tools_prefix|>", "<|tools_suffix|>", "<|role_sep|>",
                "<|message_sep|>"]
# Kimi-K3: <|close|> ends the thinking section inside the reply, and the message ends with <|end_of_msg|>
KIMI_K3 = ("{% for m in messages %}<|open|>{{ m.role }}<|sep|>{% if m.role == 'assistant' %}<|open|>think<|sep|>"
           "{{ m.reasoning_content or '' }}<|close|>think<|sep|>{% endif %}{{ m.content }}<|close|>message<|sep|>"
           "<|end_of_msg|>{% endfor %}{% if add_generation_prompt %}<|open|>assistant<|sep|><|open|>think<|sep|>"
           "{% endif %}")
# functionary-v3.2: "\n" + arguments, a string concatenation that a JSON object fails
STRING_ARGUMENTS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
                    ">>>{{ c.function.name + '\\n' + c.function.arguments }}{% endfor %}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Apertus: a reply after tool results continues the assistant turn of the call; the generation prompt opens a new one
APERTUS = ("{% for m in messages %}{% if m.role == 'user' %}<|user_start|>{{ m.content }}<|user_end|>"
           "{% elif m.role == 'tool' %}[{{ m.content }}]{% else %}"
           "{% if not (loop.previtem and loop.previtem.role == 'tool') %}<|assistant_start|>{% endif %}{{ m.content }}"
           "{% for c in m.tool_calls or [] %}<|tools_prefix|>{{ c.function.name }}{{ c.function.arguments | tojson }}"
           "<|tools_suffix|>{% endfor %}"
           "{% if not m.tool_calls %}<|assistant_end|>{% endif %}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant_start|>{% endif %}")
# GigaChat3: the reply's message, then its call as a message of the role "function call" that no prompt opens
GIGACHAT3 = ("{% for m in messages %}{{ m.role }}<|role_sep|>\n{{ m.content }}<|message_sep|>\n\n"
             "{% if m.tool_calls %}function call<|role_sep|>\n{{ m.tool_calls[0].function | tojson }}"
             "<|message_sep|>\n\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}assistant<|role_sep|>\n{% endif %}")
CALL = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "messages": [{"role": "user", "content": "Rain in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "yes"},
                     {"role": "assistant", "content": "Yes."}]}


@pytest.fixture(scope="module")
def shape_tok(qwen_tok):
    tok = copy.deepcopy(qwen_tok[0])
    tok.add_special_tokens({"extra_special_tokens": TOKENS + SHAPE_TOKENS}, replace_extra_special_tokens=False)
    return tok


def spans(samples):
    return [s for _ctx, run in samples for s in run]


def test_a_token_that_also_opens_the_reply_is_not_where_it_ends(shape_tok):
    shape_tok.chat_template = KIMI_K3
    assert shape_tok.convert_ids_to_tokens(end_of_turn_id(shape_tok)) == "<|end_of_msg|>"  # not <|close|>
    assert spans(trained(shape_tok, KIMI_K3)) == [
        "91 = 7 x 13.<|close|>think<|sep|>No.<|close|>message<|sep|><|end_of_msg|>",
        "<|close|>think<|sep|>Yes.<|close|>message<|sep|><|end_of_msg|>"]


def test_tool_call_arguments_go_as_a_string_to_a_template_that_needs_one(shape_tok):
    shape_tok.chat_template = STRING_ARGUMENTS
    assert arguments_form(shape_tok) == "string"
    assert spans(trained(shape_tok, STRING_ARGUMENTS, CALL)) == ['>>>get_weather\n{"city": "Paris"}<|im_end|>',
                                                                 "Yes.<|im_end|>"]
    shape_tok.chat_template = STRING_ARGUMENTS.replace("c.function.arguments", "c.function.arguments | tojson")
    assert arguments_form(shape_tok) == "object"


def test_a_reply_after_tool_results_continues_a_turn_the_prompt_opens_again(shape_tok):
    # one sample: the call's rendering begins the answer's context, "[yes]<|assistant_start|>" (the prompt) before it
    ((ctx, runs),) = trained(shape_tok, APERTUS, CALL)
    assert ctx.endswith("Rain in Paris?<|user_end|><|assistant_start|>")
    assert runs == ['<|tools_prefix|>get_weather{"city": "Paris"}<|tools_suffix|>', "Yes.<|assistant_end|>"]
    # (trained checks the sample against the definition: "Yes." after "[yes]<|assistant_start|>", the prompt)
    record = copy.deepcopy(CALL)
    record["messages"][3]["content"] = "<|assistant_end|>s aside, yes."  # starts as the prompt's token does
    with pytest.raises(TemplateError, match="drops content of turn 3"):
        trained(shape_tok, APERTUS, record)  # it ends where it starts: refused, not trained short
    record["messages"][3]["content"] = "<b>Yes</b>."
    assert spans(trained(shape_tok, APERTUS, record))[1] == "<b>Yes</b>.<|assistant_end|>"


def test_a_call_written_as_a_turn_of_its_own_after_the_replys_end_is_generated_with_it(shape_tok):
    assert spans(trained(shape_tok, GIGACHAT3, CALL)) == [
        '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '<|message_sep|>', "Yes.<|message_sep|>"]


def test_a_reply_without_reasoning_after_a_prompt_that_opens_it_in_words_trains_the_close(shape_tok):
    end = shape_tok.convert_tokens_to_ids(["<|end|>"])
    (ctx1, first), (ctx2, second) = trained(shape_tok, APRIEL, RECORD, end)
    assert ctx2.endswith("<|begin_assistant|>\nHere are my reasoning steps") and first[0].endswith("No.<|end|>")
    # empty reasoning, then the close the template writes after reasoning (":\n\n" one token, overlapping the prompt)
    assert second == [":\n\n[BEGIN FINAL RESPONSE]\nYes.<|end|>"]


@pytest.mark.parametrize("template, why", [
    ("{{ 'Functions: ' + functions }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}",
     "reads a variable functions that apply_chat_template does not give: pass it with --chat_template_kwargs "
     "'{\"functions\": ...}'"),
    ("{% set q = [] %}{% for m in messages %}{% set _ = q.append(m.role) %}{{ m.content }}<|im_end|>{% endfor %}",
     "the sandboxed Jinja of transformers' apply_chat_template refuses this operation"),
    ("{{ messages | map(attribute='role') | tojson }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}",
     "the template gives tojson a jinja2 generator"),
])
def test_a_template_that_cannot_render_says_why_it_is_the_templates_fault(shape_tok, template, why):
    shape_tok.chat_template = template
    with pytest.raises(TemplateError, match="cannot render this conversation: .*" + why.replace("(", r"\(")):
        render(shape_tok, RECORD["messages"])


def test_a_dropped_reasoning_or_call_names_the_templates_switch_or_the_calls_place(shape_tok):
    off = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if enable_thinking and m.reasoning_content %}"
           "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
           "{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="drops reasoning of turn 1.*--chat_template_kwargs "
                                           "'{\"enable_thinking\": true}'"):
        trained(shape_tok, off)
    no_calls = STRING_ARGUMENTS.replace("{% for c in m.tool_calls or [] %}", "{% for c in [] %}")
    with pytest.raises(TemplateError, match="drops .*tool call get_weather of turn 1.*inside the reply's content"):
        trained(shape_tok, no_calls, CALL)
