"""Templates whose generation prompt opens a reasoning block the rendered reply never contains (DeepSeek-R1 distills,
gemma-4's thought channel, Command-R's thinking switched off), the opposite case (a prompt that opens ``<think>``
and a reply that opens it again), and whitespace that differs only at the prompt's end: the trained text is what the
model generates after the prompt, checked against the definition recomputed through apply_chat_template
(tests/helpers/template_corpus.py) and spelled out. Small stand-ins for the real templates on the tiny Qwen
vocabulary (the real ones: tests/integration/data/test_template_corpus.py)."""
import copy

import pytest

from sft.data.chat import end_of_turn_id
from sft.data.records import normalize_record
from sft.data.samples import encode_samples
from sft.errors import TemplateError
from tests.helpers.labels import supervised_spans
from tests.helpers.template_corpus import check_definition

R1_DISTILL = ("{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% elif m.role == 'assistant' %}"
              "{% set c = m.content %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
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
TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
          "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|USER_TOKEN|>",
          "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>"]
RECORD = {"messages": [{"role": "user", "content": "Is 91 prime?"},
                       {"role": "assistant", "reasoning_content": "91 = 7 x 13.", "content": "No."},
                       {"role": "user", "content": "And 97?"}, {"role": "assistant", "content": "Yes."}]}


@pytest.fixture(scope="module")
def family_tok(qwen_tok):
    tok = copy.deepcopy(qwen_tok[0])
    tok.add_special_tokens({"extra_special_tokens": TOKENS}, replace_extra_special_tokens=False)
    return tok


def trained(tok, template, record=RECORD):
    """``[(text before the sample's first supervised token, [supervised text, ...]), ...]`` per sample, checked
    against the definition."""
    tok.chat_template = template
    eot = end_of_turn_id(tok)
    conv = normalize_record("r.jsonl", 0, record)
    samples = encode_samples(tok, [conv.messages], eot, 4096, None, "split", [conv.tools])[0]
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
    assert ctx1.endswith("prime?<｜Assistant｜><think>\n") and ctx2.endswith("97?<｜Assistant｜><think")
    assert first == ["91 = 7 x 13.\n</think>\n\nNo.<｜end▁of▁sentence｜>"]
    # no reasoning: an empty block (">\n\n" is one token, overlapping the prompt's end)
    assert second == [">\n\n</think>\n\nYes.<｜end▁of▁sentence｜>"]


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
    assert ctx1.endswith("assistant\n<think>\n") and ctx2.endswith("assistant\n<think")  # ">\n\n" is one token
    assert first == ["91 = 7 x 13.\n</think>\n\nNo.<|im_end|>"]
    assert second == [">\n\n</think>\n\nYes.<|im_end|>"]


def test_whitespace_only_at_the_prompts_end_is_tolerated_and_anything_else_is_refused(family_tok):
    ((ctx, spans),) = trained(family_tok, INDENTED, {"messages": RECORD["messages"][:2]})
    assert ctx.endswith("assistant\n ") and spans == [" <think>\n91 = 7 x 13.\n</think>\n\nNo.<|im_end|>"]
    with pytest.raises(TemplateError, match="generation prompt for this reply ends with 'x'"):
        trained(family_tok, INDENTED.replace("'  '", "'x'"), {"messages": RECORD["messages"][:2]})


def test_a_template_that_cannot_render_without_tools_renders_with_an_empty_list(family_tok):
    needs_tools = ("<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
                   + INDENTED.replace("{{ '  ' }}", ""))
    ((_ctx, spans),) = trained(family_tok, needs_tools, {"messages": RECORD["messages"][2:]})
    assert spans == ["Yes.<|im_end|>"]
