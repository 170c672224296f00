"""The 70 real chat templates of llama.cpp's collection (PyPI's llama-cpp-python==0.3.36 source distribution,
downloaded once) x {multi-turn with a system prompt, multi-turn reasoning, a tool round trip}: each either trains with
labels equal to the definition (checked against apply_chat_template, tests/helpers/template_corpus.py) or is refused
in one line with the template's reason; never a crash or a silent loss. The outcome table is docs/data-format.md's."""
import os

from tests.helpers.paths import ROOT
from tests.helpers.template_corpus import KINDS, markdown_table, outcomes


def test_every_real_template_trains_each_kind_by_the_definition_or_refuses_it_in_one_line():
    table = outcomes()  # AssertionError on labels that differ from the definition, any other error on a crash
    assert len(table) == 70
    for name, row in table.items():
        for kind, out in zip(KINDS, row):
            assert out.startswith(("trains", "refused: ")) and "\n" not in out, (name, kind, out)
    # the templates people fine-tune for reasoning and agents
    assert table["Qwen-Qwen3-0.6B"] == ["trains (2 samples)"] * 3
    assert table["Qwen-Qwen2.5-7B-Instruct"] == ["trains"] * 3
    assert table["meta-llama-Llama-3.1-8B-Instruct"] == ["trains"] * 3
    assert table["openai-gpt-oss-120b"][2] == "trains"  # a tool call closed by <|call|>, not <|end|>
    # thinking prompts: the block's inside, its close and the reply are trained after the prompt's opening
    assert table["deepseek-ai-DeepSeek-R1-Distill-Llama-8B"][:2] == ["trains (2 samples)"] * 2
    assert table["google-gemma-4-31B-it"][:2] == ["trains (2 samples)"] * 2
    assert table["deepseek-ai-DeepSeek-V3.1"][1] == "trains (2 samples)"  # reasoning fills its empty <think></think>
    assert table["NousResearch-Hermes-3-Llama-3.1-8B-tool_use"] == ["trains"] * 3  # an empty tool list; whitespace
    trained = [sum(row[k].startswith("trains") for row in table.values()) for k in range(len(KINDS))]
    # the model's end tokens (generation_config.json): GLM stops at the next role's token
    assert table["GLM-4.6"][0] == "trains" and table["GLM-4.7-Flash"][2].startswith("trains")
    # the reply as rendered after the prompt's last turn where the history changes with it
    assert table["mistralai-Mistral-Nemo-Instruct-2407"][0] == "trains (2 samples)"
    # templates that write nothing after the last reply, with their model's end token (Apertus, Apriel-1.6, Hy3)
    assert table["Apertus-8B-Instruct"][:2] == ["trains"] * 2 and table["tencent-Hy3"][0] == "trains"
    assert table["Apriel-1.6-15b-Thinker-fixed"][1] == "trains (2 samples)"  # reasoning opened in words
    assert table["google-gemma-4-31B-it"][2] == "trains (2 samples)"  # a tool call ends at <|tool_response>
    assert table["poolside-Laguna-XS-2.1"][1].endswith("""'{"enable_thinking": true}'""")
    assert "plain text" in table["llama-cpp-rwkv-world"][0]
    # an end token its reply opens with is not where it ends (Kimi-K3); string arguments (functionary-v3.2); a
    # turn continued without the prompt's opening (Apertus); a reply without reasoning after reasoning opened in
    # words (Apriel-1.6); variables of its own (firefunction-v2)
    for name in ("Kimi-K3", "meetkai-functionary-medium-v3.2", "Apertus-8B-Instruct", "Apriel-1.6-15b-Thinker-fixed",
                 "fireworks-ai-llama-3-firefunction-v2"):
        assert table[name][2].startswith("trains"), (name, table[name][2])
    # what stays refused says it is the template's: Jinja that apply_chat_template's sandbox refuses, a call
    # written after the reply's end token
    assert "sandboxed Jinja of transformers' apply_chat_template" in table["Kimi-K2-Instruct"][2]
    assert "after this reply's end token" in table["GigaChat3-10B-A1.8B"][2]
    assert trained == [67, 68, 57], trained
    docs = open(os.path.join(ROOT, "docs", "data-format.md"), encoding="utf-8").read()
    assert markdown_table(table) in docs, \
        "docs/data-format.md: regenerate its table: python -m tests.helpers.template_corpus"
