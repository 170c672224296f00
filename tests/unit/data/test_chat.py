"""Rendering and label masks on the real Qwen vocabulary (ChatML fallback) and the real SmolLM2 tokenizer."""

import pytest

from sft.data.records.records import normalize_record
from sft.data.template.chat import IGNORE_INDEX, encode_conversation, visualize, with_system
from sft.data.template.end_tokens import end_of_turn_id
from sft.errors import TemplateError
from tests.helpers.labels import supervised_spans, template_copy

CONVS = {
    "single": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 is 4."}],
    "multi": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
              {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red, or green.\nMaybe both."}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello."}],
    "unicode": [{"role": "user", "content": "你好，世界！"}, {"role": "assistant", "content": "你好！😀 Ça va?"}],
    "specials_in_text": [{"role": "user", "content": "Print <|endoftext|> please"},
                         {"role": "assistant", "content": "Here: <|endoftext|> done"}],
}


def check(tok, eot, messages):
    ids, labels = encode_conversation(tok, messages, eot)
    assert len(ids) == len(labels)
    ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids == ref, "ids differ from the tokenizer's own apply_chat_template"
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert supervised_spans(tok, ids, labels) == replies
    return ids, labels


@pytest.mark.parametrize("name", sorted(CONVS))
def test_qwen_vocab_chatml_fallback(qwen_tok, name):
    tok, eot = qwen_tok
    assert tok.convert_ids_to_tokens(eot) == "<|im_end|>" and eot == 151645
    ids, labels = check(tok, eot, CONVS[name])
    # <|im_start|>, role headers, system and user turns are never supervised
    for i, lab in zip(ids, labels):
        if i == 151644:
            assert lab == IGNORE_INDEX


@pytest.mark.parametrize("name", sorted(CONVS))
def test_smollm2_tokenizer(smol_tok, name):
    tok, eot = smol_tok
    assert tok.convert_ids_to_tokens(eot) == "<|im_end|>"
    check(tok, eot, CONVS[name])


def test_fallback_is_chatml_with_qwen_default_system(qwen_tok):
    tok, _ = qwen_tok
    text = tok.apply_chat_template(CONVS["single"], tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                    "<|im_end|>\n<|im_start|>assistant\n2+2 is 4.<|im_end|>\n")


def test_system_message_default_and_record_override(qwen_tok):
    tok, eot = qwen_tok
    msgs = with_system(CONVS["single"], "Be kind.")
    assert msgs[0] == {"role": "system", "content": "Be kind."}
    assert with_system(CONVS["system"], "Be kind.")[0]["content"] == "You are terse."
    ids, labels = encode_conversation(tok, msgs, eot)
    assert "Be kind." in tok.decode(ids) and "helpful assistant" not in tok.decode(ids)


def test_aliases_and_both_forms_render_identically(qwen_tok):
    tok, eot = qwen_tok
    qwen = normalize_record("f", 0, {"id": "x", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]})
    openai = normalize_record("f", 1, {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]})
    assert qwen.messages == openai.messages
    assert encode_conversation(tok, qwen.messages, eot) == encode_conversation(tok, openai.messages, eot)


def test_pad_token_is_never_the_end_of_turn_token(qwen_tok, smol_tok):
    for tok, eot in (qwen_tok, smol_tok):
        assert tok.pad_token_id is not None and tok.pad_token_id != eot
    # SmolLM2 ships pad = <|im_end|>; it must have been replaced
    assert smol_tok[0].pad_token == "<|endoftext|>"


def test_visualize_marks_supervised_spans(qwen_tok):
    tok, eot = qwen_tok
    ids, labels = encode_conversation(tok, CONVS["single"], eot)
    out = visualize(tok, ids, labels)
    assert "«2+2 is 4.<|im_end|>»" in out and out.count("«") == 1


def test_template_without_special_end_token_is_refused(qwen_tok):
    tok = template_copy(qwen_tok[0], "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TemplateError, match="writes nothing after the last reply .* not a special end-of-turn token"):
        end_of_turn_id(tok)
    tok.chat_template = tok.chat_template.replace("{% endfor %}", "\n\n{% endfor %}")  # RWKV World's plain-text end
    with pytest.raises(TemplateError, match="writes only whitespace .'.n.n'. after a reply, no special token: a model "
                                            "that stops at plain text"):
        end_of_turn_id(tok)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} END\n{% endfor %}"
    with pytest.raises(TemplateError, match="writes ' END.n' after the last reply, not a special end-of-turn token"):
        end_of_turn_id(tok)
    # whitespace before the special token is part of the reply (trained), as Nemotron-Nano-v2 and Reka write it
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n<|im_end|>\n" \
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|im_end|>")


def _with_template(qwen_tok, template):
    tok = template_copy(qwen_tok[0], template)
    return tok


def test_template_whose_header_depends_on_the_reply_is_refused(qwen_tok):
    # the header depends on the reply's length, so the sentinel rendering cannot be mapped back
    tok = _with_template(qwen_tok, "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content']|length }}\n"
                                   "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                   "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
    msgs = CONVS["multi"]
    with pytest.raises(TemplateError):  # the generation prompt cannot know the reply's length either
        encode_conversation(tok, msgs, qwen_tok[1])


def test_template_rewriting_earlier_turns_is_refused(qwen_tok):
    # like Qwen3's template: drops <think>...</think> from earlier assistant turns
    tok = _with_template(qwen_tok, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                   "{% if m['role'] == 'assistant' and not loop.last %}"
                                   "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
                                   "<|im_end|>\n{% endfor %}"
                                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(TemplateError, match="renders earlier turns differently"):
        encode_conversation(tok, msgs, qwen_tok[1])


def test_prefix_method_matches_fast_path(qwen_tok, monkeypatch):
    import sft.data.template.chat as chat

    tok, eot = qwen_tok
    fast = encode_conversation(tok, CONVS["multi"], eot)
    real_render = chat.render

    def no_sentinels(t, messages, add_generation_prompt=False):  # break the fast path on purpose
        out = real_render(t, messages, add_generation_prompt)
        return out.replace("\ue000", "[") if any("\ue000" in m["content"] for m in messages) else out

    monkeypatch.setattr(chat, "render", no_sentinels)
    assert encode_conversation(tok, CONVS["multi"], eot) == fast


def test_a_tokenizer_without_template_or_chatml_tokens_gets_both():
    """ensure_chat_template on a vocabulary without <|im_start|> / <|im_end|> (transformers 5's add_special_tokens
    takes extra_special_tokens: the older additional_special_tokens keyword raised TypeError here until issue 32)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sft.data.template.chat import ensure_chat_template

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert ensure_chat_template(tok) is True
    ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids == [3, 4] and set(ids) <= set(tok.all_special_ids)
    assert end_of_turn_id(tok) == 4
    assert ensure_chat_template(tok) is False  # has a template now: nothing added


def test_vocabulary_questions_answered_from_the_backend_match_get_vocab():
    """sft/data/vocab.py answers without get_vocab() where the backend can; the answers are get_vocab()'s: a token
    present or not (added tokens included), and a vocabulary of special tokens only (refused by load_tokenizer)
    told from an ordinary one."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from sft.data.vocab import has_token, special_only_size

    def fast(vocab, **special):
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                       unk_token="[UNK]", **special)

    tok = fast({"[UNK]": 0, "hi": 1, "there": 2})
    tok.add_special_tokens({"extra_special_tokens": ["<|im_end|>"]})
    for t in ("hi", "<|im_end|>", "bye"):
        assert has_token(tok, t) == (t in tok.get_vocab())
    assert special_only_size(tok) is None
    only = fast({"[UNK]": 0, "<s>": 1}, bos_token="<s>")
    assert special_only_size(only) == len(only.get_vocab()) == 2
