"""The label fixes of issue 53 on real templates of the corpus (tests/helpers/template_corpus.py).

(a) Qwen3.5's generation prompt ends in ``<think>\\n`` and its reply without reasoning starts ``\\n</think>``;
tokenized whole, one ``\\n\\n`` token crosses the two. A sample's context must be the prompt's own tokens at inference
(the prompt rendered with ``add_generation_prompt=True``, tokenized alone), its labels starting right after.
(b) gemma-4's reasoning channel is ``<|channel>thought``, not ``<think>``: a reasoning record's reasoning is trained in
that channel (and left out of the history, as the template leaves it), never as ``<think>`` text, with its thinking
switched off (the prompt closes an empty channel) or on (``enable_thinking``: the model opens the channel)."""
import os

import pytest

from sft.data.encode.conversation_samples import ConversationSamples
from sft.data.encode.samples import encode_samples
from sft.data.records.records import normalize_record
from sft.data.spec import PreparationSpec
from sft.data.template.chat_template import with_template_kwargs
from sft.data.template.end_tokens import end_of_turn_id
from tests.helpers import assets, template_corpus as tc

NAMES = ["Qwen3.5-4B", "google-gemma-4-31B-it"]


@pytest.fixture(scope="module")
def corpus():
    """``(tokenizer, {name: template})``: the real Qwen vocabulary with the control tokens of :data:`NAMES`."""
    from transformers import AutoTokenizer

    found = {n: open(os.path.join(assets.chat_template_corpus_dir(), f"{n}.jinja"), encoding="utf-8").read()
             for n in NAMES}
    tok = AutoTokenizer.from_pretrained(assets.qwen_tokenizer_dir())
    tok.add_special_tokens({"extra_special_tokens": sorted(set().union(*map(tc.control_tokens, found.values())))},
                           replace_extra_special_tokens=False)
    return tok, found


@pytest.fixture
def qwen35(corpus):
    tok, found = corpus
    tok.chat_template = found["Qwen3.5-4B"]
    return tok, end_of_turn_id(tok)


@pytest.mark.parametrize("kind", ["multi-turn with a system prompt", "tool round trip"])
def test_a_samples_context_is_its_prompt_tokenized_alone_where_the_reply_would_swallow_its_end(qwen35, kind):
    tok, eot = qwen35
    conv = normalize_record("corpus", 0, tc.KINDS[kind])
    samples = encode_samples(tok, [conv.messages], eot, PreparationSpec(max_len=100_000,
                                                                       long_conversations="truncate"), [conv.tools])[0]
    assert isinstance(samples, ConversationSamples), samples
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


@pytest.mark.parametrize("thinking", [False, True])
def test_b_reasoning_goes_in_the_templates_own_channel_never_as_think_text(corpus, thinking):
    tok, found = corpus
    template = found["google-gemma-4-31B-it"]
    tok.chat_template = with_template_kwargs(template, {"enable_thinking": True}) if thinking else template
    conv = normalize_record("corpus", 0, tc.KINDS["multi-turn reasoning"])
    samples = encode_samples(tok, [conv.messages], end_of_turn_id(tok), PreparationSpec(max_len=100_000),
                             [conv.tools])[0]
    assert isinstance(samples, ConversationSamples), samples
    tc.check_definition(tok, conv, samples, end_of_turn_id(tok))  # labels by the definition (the reference's rules)
    texts = [tok.decode(ex["input_ids"]) for ex in samples]
    trained = [tok.decode([i for i in ex["labels"] if i != -100]) for ex in samples]
    assert not any("<think>" in t for t in texts), texts
    reasonings = [m["reasoning_content"] for m in conv.messages if m.get("reasoning_content")]
    opened = "" if not thinking else "<|channel>thought\n"  # switched off, the prompt opens (and closes) the channel
    assert trained == [f"{opened}{r}\n<channel|>{a}<turn|>" for r, a in zip(reasonings, ["36.", "18."])]
