"""Issue 32's "done when", as a user runs it: a tiny model whose tokenizer carries Qwen3's published chat template,
and one file holding multi-turn <think> replies, reasoning_content, an OpenAI tool round trip, content parts,
LLaMA-Factory's function_call / observation form and a "train": false reply: sft-check says OK, sft-train trains
(saying what the template's history rewriting cost), sft-show-sample shows exactly the trained tokens; a record the
template cannot take is named by sft-check and refused by sft-train alike (check and train agree)."""
import os
import subprocess
import sys

from tests.helpers import assets
from tests.helpers.data import AGENT, write_jsonl
from tests.helpers.paths import ROOT, pythonpath_env


def sft(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "sft", *args], capture_output=True, text=True, cwd=ROOT,
                          env=pythonpath_env({**os.environ, "OMP_NUM_THREADS": "1"}), timeout=timeout)


def test_agent_and_reasoning_records_check_train_and_show_on_qwen3(tmp_path):
    model = assets.tiny_qwen3_chat_dir()
    data = write_jsonl(tmp_path / "agent.jsonl", AGENT)
    common = ["--model_name_or_path", model, "--data_path", data, "--output_dir", str(tmp_path / "out"),
              "--data_cache_dir", str(tmp_path / "cache"), "--report_to", "none"]
    r = sft("check", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "6 valid conversations; all 6 encoded with the chat template" in r.stdout + r.stderr
    r = sft("train", *common, "--max_steps", "2", "--per_device_train_batch_size", "2", "--save_strategy", "no",
            "--use_lora", "True", "--lora_r", "4", "--disable_tqdm", "True")
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    # think-inline (2 user queries), openai-tools and llama-factory-tools (a call after the query, then the answer);
    # train-false trains only its second reply: one sample
    assert "train: 9 of 9 samples kept from 6 conversations" in log, log[-3000:]
    assert "the chat template renders earlier turns differently once later turns exist: 3 conversations became 6 " \
           "samples" in log, log[-3000:]
    r = sft("show-sample", model, data, "--index", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "record 2 id=openai-tools: sample 1 of 2:" in out and "sample 2 of 2:" in out
    assert ('«<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>»') in out
    assert "«<think>\n\n</think>\n\nYes, it is raining in Paris (11 degrees).<|im_end|>»" in out
    assert "<tool_response>\n{\"rain\": true, \"temp\": 11}\n</tool_response>" in out and "«<tool_response>" not in out
    r = sft("show-sample", model, data, "--index", "5")
    assert "You are a potato." in r.stdout and "«You are a potato." not in r.stdout  # "train": false


def test_check_and_train_refuse_the_same_record_the_template_cannot_take(tmp_path):
    """A template that raises for a conversation (jinja's raise_exception, as gemma-2's does for a system turn):
    sft-check names the record and turn (exit 2, no traceback); sft-train stops on the same problem."""
    model = assets.tiny_qwen3_chat_dir()
    template = open(assets.QWEN3_TEMPLATE, encoding="utf-8").read()
    strict = tmp_path / "model"
    os.makedirs(strict)
    for name in os.listdir(model):
        os.symlink(os.path.join(model, name), strict / name) if name != "chat_template.jinja" else None
    (strict / "chat_template.jinja").write_text(
        "{%- if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
        + template)
    data = write_jsonl(tmp_path / "d.jsonl", [AGENT[1], AGENT[2]])  # AGENT[2] has a system turn
    common = ["--model_name_or_path", str(strict), "--data_path", data, "--output_dir", str(tmp_path / "out"),
              "--data_cache_dir", str(tmp_path / "cache"), "--report_to", "none"]
    r = sft("check", *common)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = f"{data}, record 1, id='openai-tools', turn 2: the chat template cannot render this conversation: " \
           "System role not supported"
    assert line in r.stderr, r.stderr
    r = sft("train", *common, "--max_steps", "1", "--save_strategy", "no")
    assert r.returncode == 2 and line in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    # --lazy_preprocess keeps one sample per record: check says so too (it said OK, then training refused)
    data = write_jsonl(tmp_path / "multi.jsonl", [AGENT[0]])
    r = sft("check", "--model_name_or_path", model, "--data_path", data, "--output_dir", str(tmp_path / "out"),
            "--lazy_preprocess", "True")
    assert r.returncode == 2 and "id='think-inline': the chat template renders earlier turns differently once later " \
        "turns exist, so it is 2 samples; --lazy_preprocess keeps one sample per record; drop --lazy_preprocess" \
        in r.stderr, r.stderr[-3000:]


def test_chat_template_flag_renders_tool_calls_on_a_model_whose_template_cannot(tmp_path, capsys):
    """--chat_template FILE replaces the tokenizer's template (a newcomer's SmolLM2 ignores tool_calls); sft-show-sample
    takes it and the boolean flags as sft-train writes them (--mask_history True)."""
    from sft.cli import show_sample_main

    data = write_jsonl(tmp_path / "agent.jsonl", AGENT)
    model = assets.tiny_qwen2_dir()  # no template: ChatML, which writes no tool calls
    assert show_sample_main([model, data, "--index", "2"]) == 2
    assert "drops tool definition get_weather" in capsys.readouterr().err
    assert show_sample_main([model, data, "--index", "2", "--chat_template", assets.QWEN3_TEMPLATE,
                             "--mask_history", "True"]) == 0
    out = capsys.readouterr().out
    assert "«<think>\n\n</think>\n\nYes, it is raining in Paris (11 degrees).<|im_end|>»" in out
    assert '<tool_call>\n{"name": "get_weather"' in out and "«<tool_call>" not in out  # --mask_history: last only
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    assert show_sample_main([model, data, "--chat_template", str(bad)]) == 2
    assert f"--chat_template {bad}: not a Jinja template (line 1" in capsys.readouterr().err


def test_show_sample_on_an_r1_distill_template_supervises_reasoning_close_and_answer_after_the_prompts_think(
        tmp_path):
    """DeepSeek-R1-Distill-Qwen's real template (llama.cpp's collection): its generation prompt ends with
    ``<think>\\n`` and its rendering of a reply strips the reasoning; sft-show-sample shows the reasoning, the block's
    close and the answer supervised right after the prompt's ``<think>\\n``."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "r1-distill"
    shutil.copytree(assets.tiny_qwen3_chat_dir(), model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"extra_special_tokens": ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]},
                           replace_extra_special_tokens=False)
    template = os.path.join(assets.chat_template_corpus_dir(), "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    with open(template, encoding="utf-8") as f:
        tok.chat_template = f.read()
    tok.save_pretrained(model)
    data = write_jsonl(tmp_path / "r1.jsonl", [{"id": "prime", "messages": [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "reasoning_content": "91 = 7 x 13.", "content": "No."}]}])
    r = sft("show-sample", str(model), data, "--index", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "<｜User｜>Is 91 prime?<｜Assistant｜><think>\n«91 = 7 x 13.\n</think>\n\nNo.<｜end▁of▁sentence｜>»" \
        in r.stdout, r.stdout
