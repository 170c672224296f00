"""--eval_split_ratio: a held-out set chosen by record id (stable when the file is reordered or grows), its rules
(each a bad-input case: exit 2, one message, nothing written), and sft-check's counts."""
import os
import random

import pytest

from sft.app.train import log_eval_change
from sft.cli import check_main, train_main
from sft.data.records.eval_split import empty_side_error, in_eval, record_key
from sft.data.records.records import Conversation, load_conversations
from sft.errors import DataError
from tests.helpers.data import TOY, write_jsonl


def convs(n, start=0):
    return [Conversation(id=f"c{k}", index=k - start, messages=[{"role": "user", "content": f"q{k}"},
                                                                {"role": "assistant", "content": f"a{k}"}])
            for k in range(start, start + n)]


def ids(cs):
    return [c.id for c in cs]


def split_records(records, ratio, seed):
    """(train, held): the records on each side of the split, as the data pipeline decides it per record."""
    held = [c for c in records if in_eval(record_key(c), ratio, seed)]
    return [c for c in records if not in_eval(record_key(c), ratio, seed)], held


def test_split_is_by_id_stable_under_reordering_and_growth():
    records = convs(2000)
    train, held = split_records(records, 0.1, 0)
    assert 140 < len(held) < 260 and len(train) + len(held) == 2000  # about 10%, chosen per record
    assert not set(ids(train)) & set(ids(held))
    shuffled = records[:]
    random.Random(1).shuffle(shuffled)
    assert sorted(ids(split_records(shuffled, 0.1, 0)[1])) == sorted(ids(held))  # reordered: same set
    _, held_grown = split_records(records + convs(500, start=2000), 0.1, 0)
    assert set(ids(held)) <= set(ids(held_grown)) and set(ids(held_grown)) - set(ids(held))  # grown: old ones stay
    assert set(ids(split_records(records, 0.1, 1)[1])) != set(ids(held))  # another seed, another set


def test_records_without_id_are_keyed_on_their_text(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{k: v for k, v in r.items() if k != "id"} for r in TOY])
    first = load_conversations(path)
    moved = load_conversations(write_jsonl(tmp_path / "e.jsonl", [{k: v for k, v in r.items() if k != "id"}
                                                                  for r in TOY[::-1]]))
    assert first[0].id == "#0" and moved[-1].id == "#7"
    assert {record_key(c) for c in first} == {record_key(c) for c in moved}  # index-free keys
    assert record_key(first[0]) == record_key(moved[-1])


def test_a_split_that_leaves_one_side_empty_is_an_error():
    assert split_records(convs(3), 1e-9, 0)[1] == [] and split_records(convs(3), 1 - 1e-9, 0)[0] == []
    err = empty_side_error("d.jsonl", 1e-9, 3, held_all=False)
    assert isinstance(err, DataError) and "held out none of its 3 records; raise the ratio" in str(err)
    err = empty_side_error("d.jsonl", 0.99, 3, held_all=True)
    assert "held out all 3 records, leaving none to train on; lower the ratio" in str(err)


def test_eval_change_line():
    history = [{"eval_loss": 2.5, "step": 0}, {"loss": 2.0, "step": 4}, {"eval_loss": 1.25, "step": 8}]
    assert log_eval_change(history, {"eval_loss": 1.25}, 8) == \
        "eval loss 2.5000 (before training) -> 1.2500 (after step 8)"
    assert "pass --eval_on_start True" in log_eval_change(history[1:], {"eval_loss": 1.25}, 8)


@pytest.fixture
def data(tmp_path):
    write_jsonl(tmp_path / "eval.jsonl", TOY[:2])
    return write_jsonl(tmp_path / "d.jsonl", TOY)


CASES = [
    ("ratio-zero", ["--eval_split_ratio", "0"], "--eval_split_ratio 0.0: must be a fraction with 0 < R < 1"),
    ("ratio-one", ["--eval_split_ratio", "1"], "--eval_split_ratio 1.0: must be a fraction with 0 < R < 1"),
    ("ratio-nan", ["--eval_split_ratio", "nan"], "--eval_split_ratio nan: must be a fraction"),
    ("ratio-and-eval-file", ["--eval_split_ratio", "0.2", "--eval_data_path", "{d}/eval.jsonl"],
     "--eval_split_ratio 0.2 with --eval_data_path {d}/eval.jsonl: choose one"),
    ("eval-on-start-without-data", ["--eval_on_start", "True"], "--eval_on_start True: the evaluation before "
     "training needs --eval_data_path or --eval_split_ratio"),
    ("eval-strategy-without-data", ["--eval_strategy", "steps", "--eval_steps", "1"],
     "evaluation needs --eval_data_path or --eval_split_ratio"),
    ("split-with-lazy", ["--long_conversations", "split", "--lazy_preprocess", "True"],
     "--long_conversations split with --lazy_preprocess True"),
    ("refuse-with-lazy", ["--long_conversations", "refuse", "--lazy_preprocess", "True"],
     "--long_conversations refuse with --lazy_preprocess True"),
    ("refuse-a-turn-too-long", ["--long_conversations", "refuse", "--model_max_length", "24"],
     "d.jsonl, record 0, id='add', turn 0: this turn"),
    ("long-conversations-unknown", ["--long_conversations", "drop"],
     "invalid choice: 'drop' (choose from 'split', 'truncate', 'refuse')"),
    ("split-holds-out-everything", ["--eval_split_ratio", "0.999999999"], "d.jsonl: --eval_split_ratio 0.999999999 "
     "held out all 8 records, leaving none to train on"),
    ("split-holds-out-nothing", ["--eval_split_ratio", "0.000000001"], "held out none of its 8 records"),
]


@pytest.mark.parametrize("flags,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_eval_and_long_conversation_flags(data, tiny_model_dir, capsys, flags, fragment):
    d = os.path.dirname(data)
    out = os.path.join(d, "out")
    flags = [f.replace("{d}", d) for f in flags]
    rc = train_main(["--model_name_or_path", tiny_model_dir, "--data_path", data, "--output_dir", out,
                     "--max_steps", "1", "--report_to", "none", *flags])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert fragment.replace("{d}", d) in err and "Traceback" not in err, err[-2000:]
    assert not os.path.exists(out)


def test_check_reports_the_split(data, tiny_model_dir, capsys):
    rc = check_main(["--model_name_or_path", tiny_model_dir, "--data_path", data, "--output_dir",
                     os.path.join(os.path.dirname(data), "out"), "--eval_split_ratio", "0.3"])
    out = capsys.readouterr()
    held = len(split_records(load_conversations(data), 0.3, 0)[1])
    assert rc == 0, out.err[-2000:]
    assert f"d.jsonl: 8 valid conversations ({8 - held} for training, {held} held out for evaluation by " \
           "--eval_split_ratio 0.3)" in out.out + out.err
