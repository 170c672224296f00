"""--long_conversations split: every reply supervised exactly once, cut at turn boundaries, on the real Qwen
vocabulary (ChatML fallback) and the real SmolLM2 tokenizer (its own template and default system prompt)."""
import re

import pytest

from sft.data.encode.long_conversations import split_conversation
from sft.data.records.records import normalize_record
from sft.data.spec import PreparationSpec
from sft.data.store.dataset import build_dataset
from sft.data.template.chat import IGNORE_INDEX, encode_conversation, with_system
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.labels import supervised_spans

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def long_chat(n_pairs, system=None, sizes=None):
    """A conversation of ``n_pairs`` user/assistant pairs with distinct texts of varied lengths (words); ``sizes``
    sets each reply's length in words (its question is then 3 words)."""
    msgs = [{"role": "system", "content": system}] if system else []
    for k in range(n_pairs):
        size = sizes[k] if sizes else 3 + (k * 7) % 11
        question = 3 if sizes else size
        msgs.append({"role": "user",
                     "content": f"question {k}: " + " ".join(WORDS[(k + i) % 16] for i in range(question))})
        msgs.append({"role": "assistant", "content": f"answer {k}: " + " ".join(WORDS[(k * 3 + i) % 16]
                                                                              for i in range(size + 2))})
    return msgs


def replies(msgs):
    return [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]


@pytest.mark.parametrize("which,system", [("qwen", None), ("qwen", "You are terse."), ("smol", None)])
def test_every_reply_is_supervised_exactly_once(which, system, qwen_tok, smol_tok):
    tok, eot = qwen_tok if which == "qwen" else smol_tok
    msgs = with_system(long_chat(12, system), None)
    full_ids, _ = encode_conversation(tok, msgs, eot)
    max_len = 160
    assert len(full_ids) > 3 * max_len
    samples = split_conversation(tok, msgs, eot, max_len).samples
    assert len(samples) > 3 and all(len(ids) == len(lab) <= max_len for ids, lab in samples)
    spans = [s for ids, lab in samples for s in supervised_spans(tok, ids, lab)]
    assert spans == replies(msgs)  # all replies, in order, each exactly once
    head = tok.decode(full_ids[:8])  # the system prompt's first tokens (the template's own default without one)
    assert "You are" in head
    contexts = 0
    for ids, lab in samples:
        text = tok.decode(ids)
        assert text.startswith(head)  # every sample starts with the (template's) system prompt
        first_sup = next(k for k, x in enumerate(lab) if x != IGNORE_INDEX)
        contexts += "answer" in tok.decode(ids[:first_sup])  # an earlier reply as unsupervised context
    assert contexts >= len(samples) - 1  # every sample after the first has context before its first reply


def test_conversation_that_fits_is_unchanged(qwen_tok):
    tok, eot = qwen_tok
    msgs = long_chat(3)
    full = encode_conversation(tok, msgs, eot)
    assert split_conversation(tok, msgs, eot, len(full[0])) == ([full], 0)


def test_reply_too_long_by_itself_gets_its_own_sample(qwen_tok):
    """A reply too long for the length by itself is left whole (for the caller to truncate), in a sample of its own."""
    tok, eot = qwen_tok
    msgs = long_chat(6, sizes=[4, 4, 90, 4, 4, 4])
    samples, cut = split_conversation(tok, msgs, eot, 64)
    assert cut == 0  # its 3-word question already leaves the reply the first half of the sample
    over = [(ids, lab) for ids, lab in samples if len(ids) > 64]
    assert len(over) == 1 and supervised_spans(tok, *over[0]) == [replies(msgs)[2]]
    assert [s for ids, lab in samples for s in supervised_spans(tok, ids, lab)] == replies(msgs)


@pytest.mark.parametrize("n_pairs", [1, 4])
def test_user_turn_too_long_for_its_reply_is_cut_from_the_start(qwen_tok, n_pairs):
    """A user turn that leaves its reply no room is cut from the start, at a word: the reply is trained whole."""
    tok, eot = qwen_tok
    msgs = long_chat(n_pairs)
    question = " ".join(f"w{k}" for k in range(150))
    msgs[-2] = {"role": "user", "content": question}
    samples, cut = split_conversation(tok, msgs, eot, 64)
    assert cut == 1 and all(len(ids) <= 64 for ids, _ in samples)
    assert [s for ids, lab in samples for s in supervised_spans(tok, ids, lab)] == replies(msgs)
    text = tok.decode(samples[-1][0])
    kept = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    assert question.endswith(" " + kept) and kept  # its last words, from a word boundary
    assert len(samples[-1][0]) > 64 - 6  # as many as fit (a word here is at most 3 tokens)


def test_dataset_split_report_and_truncate_mode(tmp_path, qwen_tok, caplog):
    tok, eot = qwen_tok
    long_rec = {"id": "long", "messages": long_chat(10, sizes=[4, 4, 90, 4, 4, 4, 4, 4, 4, 4])}
    question = {"id": "long-question", "messages": [{"role": "user", "content": "word " * 200},
                                                     {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [TOY[0], long_rec, question])
    spec = PreparationSpec(64, cache_dir=str(tmp_path / "c"))  # split is the default
    with caplog.at_level("WARNING"):
        ds, report = build_dataset([path], tok, eot, spec)
    assert "more than once" not in caplog.text  # the samples of a split conversation share its id: not duplicates
    assert report.mode == "split" and report.conversations == 3 and report.split == 1
    ids = list(ds["id"])
    assert ids[0] == "add" and ids.count("long") > 3 and ids[-1] == "long-question"  # its question cut, "ok" trained
    assert report.truncated == 1 and report.dropped_ids == [] and report.user_turns_cut == 1  # the 92-word reply
    assert all(len(x) <= 64 for x in ds["input_ids"])
    sup = [s for row in ds if row["id"] == "long" for s in supervised_spans(tok, row["input_ids"], row["labels"])]
    assert sup[:2] == replies(long_rec["messages"])[:2] and sup[3:] == replies(long_rec["messages"])[3:]
    assert replies(long_rec["messages"])[2].startswith(sup[2])  # the reply too long alone: its first tokens
    lines = "\n".join(report.lines("train", 64))
    assert "1 of 3 conversations longer than --model_max_length 64 were split at turn boundaries" in lines
    assert "1 user turns too long to fit with their reply within --model_max_length 64 were cut from the start " \
        "(their last words kept): long-question" in lines  # the record named
    assert "1 replies are too long for --model_max_length 64 by themselves" in lines
    truncate = PreparationSpec(64, long_conversations="truncate", cache_dir=spec.cache_dir)
    cut, cut_report = build_dataset([path], tok, eot, truncate)
    assert list(cut["id"]) == ["add", "long"] and cut_report.split == 0 and cut_report.truncated == 2
    assert cut_report.dropped_ids == ["long-question"]
    assert cut_report.supervised_tokens < report.supervised_tokens
    assert "(--long_conversations split keeps them)" in "\n".join(cut_report.lines("train", 64))


def test_chitchat_split_supervises_every_reply_once(smol_tok):
    """Real data at the example's length: every reply that fits with its user turn is supervised exactly once."""
    from scripts import prepare_example

    tok, eot = smol_tok
    checked = split = 0
    for rec in prepare_example.chitchat_records(300):
        msgs = normalize_record("chitchat", 0, rec).messages
        samples = split_conversation(tok, msgs, eot, 256).samples
        split += len(samples) > 1
        assert [s for ids, lab in samples for s in supervised_spans(tok, ids, lab)] == replies(msgs), rec["id"]
        for ids, lab in samples:  # only a reply too long even alone is over the limit, alone in its sample
            assert len(ids) <= 256 or len(supervised_spans(tok, ids, lab)) == 1
        checked += all(len(ids) <= 256 for ids, _ in samples)
    assert split > 100 and checked > 250



def test_a_plan_that_overflows_when_encoded_is_made_again(qwen_tok, monkeypatch):
    """Token counts read off the conversation's encoding only plan the cuts; the samples are encoded for real and
    checked. Here the first plan gets costs 10 tokens too low per pair (as a template whose turns do not add up
    would): its samples overflow, the plan is made again with a smaller budget, and the result fits and covers every
    reply."""
    import sft.data.encode.long_conversations as lc

    tok, eot = qwen_tok
    budgets, plan = [], lc.plan_pieces

    def optimistic_first(lengths, costs, head_len, max_len, budget):
        budgets.append(budget)
        return plan(lengths, [c - 10 for c in costs] if len(budgets) == 1 else costs, head_len, max_len, budget)

    monkeypatch.setattr(lc, "plan_pieces", optimistic_first)
    msgs = long_chat(20, sizes=[2] * 20)
    samples = split_conversation(tok, msgs, eot, 200).samples
    assert len(budgets) > 1 and budgets[-1] < 200  # the first plan did not fit as encoded
    assert all(len(ids) <= 200 for ids, _ in samples)
    assert [s for ids, lab in samples for s in supervised_spans(tok, ids, lab)] == replies(msgs)


def test_show_sample_prints_every_sample_of_a_split_record(tmp_path, tiny_model_dir, capsys):
    from sft.cli import show_sample_main

    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "long", "messages": long_chat(12)}])
    assert show_sample_main([tiny_model_dir, path, "--model_max_length", "160"]) == 0
    out = capsys.readouterr().out
    n = out.count("record 0 id=long: sample ")
    assert n > 3 and f"sample {n} of {n}:" in out and out.count("«answer ") == 12
    assert show_sample_main([tiny_model_dir, path, "--model_max_length", "160",
                             "--long_conversations", "truncate"]) == 0
    out = capsys.readouterr().out
    assert "sample 1 of" not in out and "truncated (" in out
    assert re.search(r"supervised tokens lost; cut in turn \d+ \(\d+ tokens\)\)", out), out[:400]


def test_bracket_holds_the_largest_keep_from_any_guess():
    """sft.data.encode.long_conversations._bracket: for a monotone ok (true up to some answer), from any guess, the
    bracket it returns holds the answer and ok holds at its low end, so the binary search after it finds the same
    largest keep as a search over the whole range; and it narrows the range (few probes) when the guess is close."""
    import random

    from sft.data.encode.long_conversations import _bracket

    rng = random.Random(3)
    for _ in range(3000):
        hi = rng.randint(1, 3000)
        answer = rng.randint(1, hi)
        guess = rng.choice([rng.randint(-5, hi + 5), answer + rng.randint(-30, 30)])
        probes = []

        def ok(keep):
            probes.append(keep)
            return keep <= answer

        lo2, hi2 = _bracket(ok, 1, hi, guess)
        assert 1 <= lo2 <= answer <= hi2 <= hi and ok(lo2), (hi, answer, guess, lo2, hi2)
        if abs(guess - answer) <= 24 and 1 < guess <= hi:
            assert hi2 - lo2 <= 48 and len(probes) <= 4, (hi, answer, guess, lo2, hi2, probes)
