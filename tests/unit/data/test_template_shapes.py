"""Template shapes past the ones of test_template_families.py: a reply whose first closing token also opens it
(Kimi-K3), tool call arguments the template needs as a string (functionary-v3.2), a turn the rendering continues
without the generation prompt's opening (Apertus after tool results), a reply without reasoning after a prompt that
opens reasoning in words (Apriel-1.6); what stays refused (a call written after the reply's end token, GigaChat3; a
call the template does not write; a rendering that does not continue with the reply) and how refusals name the
template's own fault. Small stand-ins on the tiny Qwen vocabulary, checked against the definition recomputed through
apply_chat_template (tests/helpers/template_corpus.py); the real templates: tests/integration/data/
test_template_corpus.py."""
import copy
import dataclasses

import pytest

from sft.data.template.chat import render
from sft.data.template.chat_template import with_template_kwargs
from sft.data.template.end_tokens import end_of_turn_id
from sft.data.template.profile import template_profile
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


def with_calls(content: str, names: list) -> dict:
    """CALL with these calls (each defined in ``tools``, each with its result) and this content."""
    record = copy.deepcopy(CALL)
    record["tools"] = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                       for n in dict.fromkeys(names)]
    record["messages"][1]["content"] = content
    record["messages"][1]["tool_calls"] = [
        {"id": f"c{j + 1}", "type": "function", "function": {"name": n, "arguments": {"city": "Paris"}}}
        for j, n in enumerate(names)]
    record["messages"][2:3] = [{"role": "tool", "tool_call_id": f"c{j + 1}", "content": "yes"}
                               for j in range(len(names))]
    return record


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
    profile = template_profile(shape_tok)
    assert profile.arguments_form == "string" and template_profile(shape_tok) is profile  # probed once per template
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.arguments_form = "object"
    assert spans(trained(shape_tok, STRING_ARGUMENTS, CALL)) == ['>>>get_weather\n{"city": "Paris"}<|im_end|>',
                                                                 "Yes.<|im_end|>"]
    shape_tok.chat_template = STRING_ARGUMENTS.replace("c.function.arguments", "c.function.arguments | tojson")
    assert template_profile(shape_tok).arguments_form == "object"


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


def test_a_call_written_after_the_replys_end_token_is_refused_not_trained_past_the_stop(shape_tok):
    # the model stops at <|message_sep|>, the end of every reply, so it would never generate a call written after it
    with pytest.raises(TemplateError, match=r"turn 1: the chat template writes tool call get_weather after this "
                                            r"reply's end token \(<\|message_sep\|>\)"):
        trained(shape_tok, GIGACHAT3, CALL)


def test_each_call_needs_its_own_rendering_not_a_name_found_elsewhere(shape_tok):
    """A call whose name is in the content, inside a longer call's name, or the same as an earlier call's: dropped
    when the template does not write it (a template that writes only the first call)."""
    first_only = STRING_ARGUMENTS.replace("{% for c in m.tool_calls or [] %}",
                                          "{% for c in (m.tool_calls or [])[:1] %}")
    no_calls = STRING_ARGUMENTS.replace("{% for c in m.tool_calls or [] %}", "{% for c in [] %}")
    for template, content, names in ((no_calls, "I will use get_weather.", ["get_weather"]),
                                     (first_only, "", ["web_search", "search"]),
                                     (first_only, "", ["get_weather", "get_weather"])):
        with pytest.raises(TemplateError, match=f"drops .*tool call {names[-1]} of turn 1"):
            trained(shape_tok, template, with_calls(content, names))


def test_a_prompt_that_the_rendering_does_not_continue_with_the_reply_stays_refused(shape_tok):
    """Not "a turn the rendering does not open": the rendering writes something else before the reply (another
    opening, a header), or the prompt's extra text is an instruction, not reasoning opened in words."""
    opening = "{% if add_generation_prompt %}<|assistant_start|>{% endif %}"
    for reply in ("[BOT]{{ m.content }}", "Note: answer follows\n<|assistant_start|>{{ m.content }}"):
        template = ("{% for m in messages %}{% if m.role == 'user' %}<|user_start|>{{ m.content }}<|user_end|>"
                    "{% else %}" + reply + "<|assistant_end|>{% endif %}{% endfor %}" + opening)
        with pytest.raises(TemplateError, match="generation prompt for this reply ends with"):
            trained(shape_tok, template, {"messages": RECORD["messages"][2:]})
    instruction = ("{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}{% else %}<|assistant|>"
                   "{% if m.reasoning_content %}{{ m.reasoning_content }}\nFINAL: {% endif %}{{ m.content }}<|end|>"
                   "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>Answer in one word.\n{% endif %}")
    with pytest.raises(TemplateError, match="ends with 'Answer in one word"):
        trained(shape_tok, instruction, {"messages": RECORD["messages"][2:]})


def test_a_reply_without_reasoning_after_a_prompt_that_opens_it_in_words_trains_the_close(shape_tok):
    end = shape_tok.convert_tokens_to_ids(["<|end|>"])
    (ctx1, first), (ctx2, second) = trained(shape_tok, APRIEL, RECORD, end)
    assert ctx2.endswith("<|begin_assistant|>\nHere are my reasoning steps:\n") and first[0].endswith("No.<|end|>")
    # empty reasoning, then the close the template writes after reasoning (":\n\n" would be one token across the
    # prompt's end: the context is the prompt's own tokens)
    assert second == ["\n[BEGIN FINAL RESPONSE]\nYes.<|end|>"]


@pytest.mark.parametrize("template, why", [
    ("{{ 'Functions: ' + functions }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}",
     "reads a variable functions that it does not set for this conversation and apply_chat_template does not "
     "give: where the model's card passes functions to apply_chat_template, pass it with --chat_template_kwargs "
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


def test_an_end_token_written_inside_every_reply_too_and_a_missing_bos_are_named(shape_tok):
    shape_tok.chat_template = ("{% for m in messages %}<|open|>{{ m.role }}<|role_sep|>{% if m.role == 'assistant' %}"
                               "{{ m.reasoning_content or '' }}<|sep|>{% endif %}{{ m.content }}<|sep|>{% endfor %}"
                               "{% if add_generation_prompt %}<|open|>assistant<|role_sep|>{% endif %}")
    with pytest.raises(TemplateError, match=r"closes a reply with <\|sep\|>, which it also writes inside a reply"):
        end_of_turn_id(shape_tok, shape_tok.convert_tokens_to_ids(["<|sep|>"]))
    shape_tok.chat_template = "{{ bos_token + '' }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    bos = shape_tok.bos_token
    shape_tok.bos_token = None
    try:
        with pytest.raises(TemplateError, match="writes the tokenizer's bos token, and the tokenizer has none"):
            render(shape_tok, RECORD["messages"])
    finally:
        shape_tok.bos_token = bos


def test_a_dropped_reasoning_or_call_names_the_templates_switch_or_the_calls_place(shape_tok):
    off = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if enable_thinking and m.reasoning_content %}"
           "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
           "{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="drops reasoning of turn 1.*--chat_template_kwargs "
                                           "'{\"enable_thinking\": true}'"):
        trained(shape_tok, off)
    with pytest.raises(TemplateError, match="drops reasoning of turn 1") as e:  # already switched on: no such hint
        trained(shape_tok, with_template_kwargs(off.replace("enable_thinking and ", "enable_thinking and false and "),
                                                {"enable_thinking": True}))
    assert "chat_template_kwargs" not in str(e.value)
    no_calls = STRING_ARGUMENTS.replace("{% for c in m.tool_calls or [] %}", "{% for c in [] %}")
    with pytest.raises(TemplateError, match="drops .*tool call get_weather of turn 1.*inside the reply's content"):
        trained(shape_tok, no_calls, CALL)
    first_only = STRING_ARGUMENTS.replace("{% for c in m.tool_calls or [] %}",
                                          "{% for c in (m.tool_calls or [])[:1] %}")
    with pytest.raises(TemplateError, match="drops .*tool call get_time of turn 1") as e:  # it writes calls: no hint
        trained(shape_tok, first_only, with_calls("", ["get_weather", "get_time"]))
    assert "inside the reply's content" not in str(e.value)
