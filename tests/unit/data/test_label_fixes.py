"""The label fixes of issue 53 on a real template of the corpus (tests/helpers/template_corpus.py): Qwen3.5's
generation prompt ends in ``<think>\\n`` and its reply without reasoning starts ``\\n</think>``; tokenized whole, one
``\\n\\n`` token crosses the two. A sample's context must be the prompt's own tokens at inference (the prompt rendered
with ``add_generation_prompt=True``, tokenized alone), its labels starting right after."""
import os

import pytest

from sft.data.end_tokens import end_of_turn_id
from sft.data.records import normalize_record
from sft.data.samples import encode_samples
from sft.data.spec import PreparationSpec
from tests.helpers import assets, template_corpus as tc


@pytest.fixture(scope="module")
def qwen35():
    from transformers import AutoTokenizer

    text = open(os.path.join(assets.chat_template_corpus_dir(), "Qwen3.5-4B.jinja"), encoding="utf-8").read()
    tok = AutoTokenizer.from_pretrained(assets.qwen_tokenizer_dir())
    tok.add_special_tokens({"extra_special_tokens": sorted(tc.control_tokens(text))},
                           replace_extra_special_tokens=False)
    tok.chat_template = text
    return tok, end_of_turn_id(tok)


@pytest.mark.parametrize("kind", ["multi-turn with a system prompt", "tool round trip"])
def test_a_samples_context_is_its_prompt_tokenized_alone_where_the_reply_would_swallow_its_end(qwen35, kind):
    tok, eot = qwen35
    conv = normalize_record("corpus", 0, tc.KINDS[kind])
    samples = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=100_000,
                                                                       long_conversations="truncate"), [conv.tools])[0]
    assert isinstance(samples, list), samples
    swallowed = 0
    for k in [k for k, m in enumerate(conv.messages) if m["role"] == "assistant"]:
        prompt = tok.apply_chat_template(conv.messages[:k], tools=conv.tools, add_generation_prompt=True,
                                         tokenize=False)
        own = tok(prompt, add_special_tokens=False)["input_ids"]
        whole = tok(tok.apply_chat_template(conv.messages[:k + 1], tools=conv.tools, tokenize=False),
                    add_special_tokens=False)["input_ids"]
        swallowed += whole[:len(own)] != own  # tokenized whole, the reply's first token takes the prompt's end
        n = len(own)
        holding = [ex for ex in samples if ex["input_ids"][:n] == own and ex["labels"][n] != -100
                   and set(ex["labels"][:n]) == {-100}]
        assert len(holding) == 1, f"reply {k}: no sample whose context is its prompt's own tokens"
    assert swallowed  # the case the fix is for occurs here
