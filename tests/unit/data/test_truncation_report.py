"""An over-long single turn is never cut silently: every truncated sample names its record, id, the turn it was cut in
and that turn's size in tokens, on the fast path (ChatML) and on the per-turn path (Qwen3), split or truncate."""
import pytest

from sft.data.encode.conversation_samples import ConversationSamples
from sft.data.encode.report import TruncationReport
from sft.data.encode.samples import encode_samples
from sft.data.spec import PreparationSpec
from tests.helpers import assets


@pytest.fixture(scope="module")
def qwen3():
    from sft.model.loading import load_tokenizer

    tok, eot, _ = load_tokenizer(assets.tiny_qwen3_chat_dir())
    return tok, eot


def _report(tok, eot, messages, mode, record=7, rec_id="big"):
    out = encode_samples(tok, [messages], eot, PreparationSpec(max_len=64, long_conversations=mode))[0]
    assert isinstance(out, ConversationSamples), out
    report = TruncationReport(mode=mode)
    report.count_conversation(out, rec_id, record)
    return out, "\n".join(report.lines("train", 64))


def _tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("mode", ["split", "truncate"])
def test_a_reply_too_long_by_itself_is_named_with_its_record_turn_and_size(qwen_tok, qwen3, mode):
    reply = "word " * 300
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Talk."}, {"role": "assistant", "content": reply}]
    for tok, eot in (qwen_tok, qwen3):  # the fast path, then the per-turn path
        out, lines = _report(tok, eot, messages, mode)
        cut = [ex for ex in out if ex["truncated"]]
        assert len(cut) == 1 and cut[0]["cut_turn"] == 3, [(ex["truncated"], ex.get("cut_turn")) for ex in out]
        assert cut[0]["turn_tokens"] == _tokens(tok, reply.strip())
        assert f"record 7, id='big', turn 3 ({_tokens(tok, reply.strip())} tokens)" in lines, lines


def test_a_huge_user_turn_truncated_is_named_by_its_turn_not_the_reply(qwen_tok):
    tok, eot = qwen_tok
    question = "Summarize this: " + "lorem ipsum " * 400
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question},
                {"role": "assistant", "content": "It repeats."}]
    out, lines = _report(tok, eot, messages, "truncate", record=0, rec_id="q")
    assert out[0]["truncated"] and out[0]["cut_turn"] == 1 and out[0]["turn_tokens"] == _tokens(tok, question.strip())
    assert "1 of 1 samples longer than --model_max_length 64 were truncated" in lines
    assert f"record 0, id='q', turn 1 ({out[0]['turn_tokens']} tokens)" in lines


def test_the_report_keeps_the_first_ten_across_merged_parts_and_a_default_system_prompt_is_not_a_turn(qwen_tok):
    tok, eot = qwen_tok
    messages = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "word " * 200}]
    spec = PreparationSpec(max_len=64, long_conversations="truncate", system_message="You are terse.")
    out = encode_samples(tok, [messages] * 12, eot, spec)
    assert all(s[0]["cut_turn"] == 1 for s in out)  # numbered as the record numbers its turns
    parts = []
    for half in (out[:6], out[6:]):
        r = TruncationReport(mode="truncate")
        for j, s in enumerate(half):
            r.count_conversation(s, f"r{j}", j)
        parts.append(r.__dict__)
    merged = TruncationReport.merge(parts)
    assert merged.truncated == 12 and len(merged.cut_turns) == 10
    assert "... (the first 10)" in "\n".join(merged.lines("train", 64))


def test_refuse_names_the_turn_split_would_cut_and_splits_the_rest_as_split_does(qwen_tok, qwen3):
    """--long_conversations refuse: a conversation with a turn too long to fit with its context is refused (a record
    problem: file, record, id, turn, its size in tokens, the fix); one that split cuts at turn boundaries only is
    split exactly as split does."""
    from sft.data.records.records import normalize_record, template_problem
    from sft.errors import TemplateError

    reply, question = "word " * 300, "Summarize this: " + "lorem ipsum " * 400
    long_reply = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Talk."}, {"role": "assistant", "content": reply}]
    long_user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question},
                 {"role": "assistant", "content": "It repeats."}]
    fits = [m for r in range(8) for m in ({"role": "user", "content": f"Question {r}?"},
                                          {"role": "assistant", "content": f"Answer {r}."})]
    spec = PreparationSpec(max_len=64, long_conversations="refuse")
    for tok, eot in (qwen_tok, qwen3):  # the fast path, then the per-turn path
        out = encode_samples(tok, [long_reply, long_user, fits], eot, spec)
        for messages, turn, text in ((long_reply, 3, reply), (long_user, 1, question)):
            e = out[0 if messages is long_reply else 1]
            assert isinstance(e, TemplateError) and e.turn == turn, (turn, e)
            conv = normalize_record("data.jsonl", 5, {"id": "big", "messages": messages})
            line = str(template_problem("data.jsonl", conv, e))
            size = _tokens(tok, text.strip())
            assert line.startswith(f"data.jsonl, record 5, id='big', turn {turn}: this turn ({size} tokens) does not "
                                   "fit in --model_max_length 64"), line
            assert "--long_conversations split" in line and "raise --model_max_length" in line
        split = encode_samples(tok, [fits], eot, PreparationSpec(max_len=64))[0]
        assert out[2] == split and len(split) > 1 and not any(ex["truncated"] for ex in split)
