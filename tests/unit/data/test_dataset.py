"""Truncation report, dataset cache, lazy mode and the collator."""
import os

import torch

from sft.data.spec import PreparationSpec
from sft.data.store.dataset import LazySupervisedDataset, build_dataset, make_collator
from sft.data.template.chat import IGNORE_INDEX
from tests.helpers.data import TOY, write_jsonl


def test_truncation_is_counted_and_empty_samples_dropped(tmp_path, qwen_tok):
    """--long_conversations truncate (split mode: tests/integration/data/test_long_conversations.py)."""
    tok, eot = qwen_tok
    long_user = {"id": "long-question", "messages": [{"role": "user", "content": "word " * 200},
                                                      {"role": "assistant", "content": "ok"}]}
    long_reply = {"id": "long-reply", "messages": [{"role": "user", "content": "go"},
                                                    {"role": "assistant", "content": "word " * 200}]}
    path = write_jsonl(tmp_path / "d.jsonl", [TOY[0], long_user, long_reply])
    spec = PreparationSpec(64, long_conversations="truncate", cache_dir=str(tmp_path / "c"))
    ds, report = build_dataset([path], tok, eot, spec)
    assert report.truncated == 2 and report.dropped_ids == ["long-question"]
    assert report.samples == 3 and report.kept == 2 and list(ds["id"]) == ["add", "long-reply"]
    assert report.supervised_tokens_lost > 150  # most of the 200-word reply
    assert all(len(x) <= 64 for x in ds["input_ids"]) and all(n > 0 for n in ds["n_supervised"])
    lines = "\n".join(report.lines("train", 64))
    assert "2 of 3 samples longer than --model_max_length 64 were truncated" in lines and "long-question" in lines


def test_cache_is_reused_and_keyed_on_settings(tmp_path, qwen_tok):
    tok, eot = qwen_tok
    path = write_jsonl(tmp_path / "d.jsonl", TOY)
    cache = tmp_path / "c"
    spec = PreparationSpec(128, cache_dir=str(cache))
    build_dataset([path], tok, eot, spec)
    build_dataset([path], tok, eot, spec)
    assert len(os.listdir(cache)) == 1
    build_dataset([path], tok, eot, PreparationSpec(64, cache_dir=str(cache)))
    build_dataset([path], tok, eot, PreparationSpec(128, "Be brief.", cache_dir=str(cache)))
    build_dataset([path], tok, eot, PreparationSpec(128, on_bad_record="skip", cache_dir=str(cache)))
    assert len(os.listdir(cache)) == 4
    write_jsonl(tmp_path / "d.jsonl", TOY[:3])  # different content, same path
    build_dataset([path], tok, eot, spec)
    assert len(os.listdir(cache)) == 5


def test_lazy_equals_eager_and_skips_empty(tmp_path, qwen_tok):
    tok, eot = qwen_tok
    long_user = {"id": "long", "messages": [{"role": "user", "content": "word " * 200},
                                            {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [TOY[0], long_user, TOY[2]])
    spec = PreparationSpec(64, long_conversations="truncate", cache_dir=str(tmp_path / "c"))
    ds, _ = build_dataset([path], tok, eot, spec)
    lazy, report = build_dataset([path], tok, eot, PreparationSpec(64, lazy=True, cache_dir=str(tmp_path / "c")))
    assert isinstance(lazy, LazySupervisedDataset) and report is None and len(lazy) == 3
    assert lazy[0]["input_ids"] == ds[0]["input_ids"] and lazy[0]["labels"] == ds[0]["labels"]
    assert lazy[1]["input_ids"] == ds[1]["input_ids"]  # "long" replaced by the next sample
    assert lazy.report.dropped_ids == ["long"]


def test_collator_pads_dynamically_by_position(qwen_tok):
    tok, eot = qwen_tok
    pad = tok.pad_token_id
    feats = [{"input_ids": [5, pad, 7], "labels": [-100, pad, 7]},  # a real pad-id token inside the text
             {"input_ids": list(range(1, 12)), "labels": list(range(1, 12))}]
    b = make_collator(tok)(feats)
    assert b["input_ids"].shape == (2, 16)  # longest = 11, rounded up to a multiple of 8
    assert b["input_ids"].dtype == torch.long
    assert b["attention_mask"][0].tolist() == [1, 1, 1] + [0] * 13  # position, not id, decides
    assert b["labels"][0].tolist() == [-100, pad, 7] + [IGNORE_INDEX] * 13
    assert b["labels"][1, 11:].eq(IGNORE_INDEX).all() and b["attention_mask"][1].sum() == 11


def test_the_cache_key_changes_with_the_preparation_code(tmp_path, qwen_tok, monkeypatch):
    """A cache prepared by other code (another commit's sft/data, a module of a sub-folder included) is never read:
    its key differs."""
    import shutil

    from sft.data.store import cache_key as ck

    code = tmp_path / "data"
    wing = os.path.dirname(os.path.dirname(ck.__file__))  # sft/data, its stages in sub-folders
    shutil.copytree(wing, code, ignore=shutil.ignore_patterns("__pycache__"))
    before = ck.preparation_code_fingerprint(str(code))
    assert ck.preparation_code_fingerprint() == ck.preparation_code_fingerprint.__wrapped__(wing)  # the whole wing
    (code / "encode" / "samples.py").write_text((code / "encode" / "samples.py").read_text() + "\n# another commit\n")
    changed = ck.preparation_code_fingerprint.__wrapped__(str(code))
    assert changed != before
    (code / "stage").mkdir()
    (code / "stage" / "step.py").write_text("# a module of a new sub-folder\n")
    assert ck.preparation_code_fingerprint.__wrapped__(str(code)) != changed
    data = write_jsonl(tmp_path / "d.jsonl", TOY)
    keys = set()
    for fingerprint in ("a", "b"):
        monkeypatch.setattr(ck, "preparation_code_fingerprint", lambda f=fingerprint: f)
        keys.add(ck.cache_key(data, qwen_tok[0], {"max_len": 64}))
    assert len(keys) == 2
