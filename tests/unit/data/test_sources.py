"""Data sources: formats read as a stream, sharding of records, Alpaca records, mixing by weight."""
import collections
import gzip
import json

import pytest

from sft.data.records import sources
from sft.data.records.records import RecordCheck, iter_conversations, load_conversations
from sft.data.spec import PreparationSpec
from sft.data.store.dataset import build_dataset
from sft.errors import DataError
from tests.helpers.data import TOY, write_jsonl


def _ids(path, **kw):
    return [c.id for c in load_conversations(str(path), **kw)]


def test_json_list_is_parsed_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK", 7)  # every record spans several reads
    p = tmp_path / "d.json"
    p.write_text(" [\n" + ",\n ".join(json.dumps(r) for r in TOY) + "\n]\n", encoding="utf-8")
    assert _ids(p) == [r["id"] for r in TOY]
    p.write_text('[{"id": "a", "messages": [{"role": "user", "content": "x"}, '
                 '{"role": "assistant", "content": "y"}]},\n'
                 ' {"id": "b" "messages": []}]', encoding="utf-8")
    with pytest.raises(DataError, match=r"d.json: line 2, column 13: not valid JSON \(Expecting ',' delimiter\)"):
        load_conversations(str(p))


def test_shards_partition_the_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", TOY)
    seen = []
    for shard in range(3):
        check = RecordCheck(path)
        seen += [c.index for c in iter_conversations(path, check, shard=shard, n_shards=3)]
        assert check.records == len(range(shard, len(TOY), 3))
    assert sorted(seen) == list(range(len(TOY)))


def test_compressed_parquet_and_dataset_folder_read_like_jsonl(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    with gzip.open(tmp_path / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in TOY)
    msgs = [r for r in TOY if "messages" in r]
    pq.write_table(pa.Table.from_pylist(msgs), tmp_path / "d.parquet", row_group_size=2)
    datasets.Dataset.from_list(msgs).save_to_disk(str(tmp_path / "folder"))
    assert _ids(tmp_path / "d.jsonl.gz") == [r["id"] for r in TOY]
    assert _ids(tmp_path / "d.parquet") == _ids(tmp_path / "folder") == [r["id"] for r in msgs]
    check = RecordCheck("p")
    assert [c.index for c in iter_conversations(str(tmp_path / "d.parquet"), check, shard=1, n_shards=2)] == [1, 3, 5]


def test_parquet_errors_name_file_record_id_and_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [TOY[2], {"id": "bad", "messages": [{"role": "robot", "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(DataError) as e:
        load_conversations(str(tmp_path / "d.parquet"))
    assert "d.parquet, record 1, id='bad', turn 0: unknown role 'robot' in 'role'" in str(e.value)
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="x.parquet: not a readable Parquet file"):
        load_conversations(str(tmp_path / "x.parquet"))


def test_dataset_dict_folder_is_refused_with_the_split_to_give(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(TOY[2:4])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="DatasetDict folder; give one split's folder .*dd/train"):
        load_conversations(str(tmp_path / "dd"))


def test_alpaca_records(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [
        {"instruction": "Translate to French", "input": "cat", "output": "chat"},
        {"id": "q", "instruction": "Say hi", "input": "", "output": "Hi!", "system": "Be brief."},
        {"id": "bad", "instruction": "x", "output": 3},
        {"id": "missing", "input": "y", "output": "z"},
    ])
    with pytest.raises(DataError) as e:
        load_conversations(path)
    assert "record 2, id='bad': 'output' is 3, not a string" in str(e.value)
    assert "record 3, id='missing': missing key 'instruction'" in str(e.value)
    convs = load_conversations(path, "skip")
    assert convs[0].id == "#0" and convs[0].messages == [{"role": "user", "content": "Translate to French\n\ncat"},
                                                         {"role": "assistant", "content": "chat"}]
    assert convs[1].messages[0] == {"role": "system", "content": "Be brief."} and len(convs[1].messages) == 3


def _source(tmp_path, name, n):
    rows = [{"id": f"{name}{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                               {"role": "assistant", "content": f"answer {i}"}]} for i in range(n)]
    return write_jsonl(tmp_path / f"{name}.jsonl", rows)


def test_mixing_weights_are_respected_by_counts_and_deterministic(tmp_path, qwen_tok):
    tok, eot = qwen_tok
    a, b = _source(tmp_path, "a", 10), _source(tmp_path, "b", 10)
    cache = str(tmp_path / "c")
    ds, _ = build_dataset([a, b], tok, eot, PreparationSpec(64, cache_dir=cache, weights=(3, 1), seed=1))
    ids = list(ds["id"])
    counts = collections.Counter(i[0] for i in ids)
    assert counts == {"a": 15, "b": 5}  # 20 samples in all, 3:1
    per_id = collections.Counter(ids)
    assert all(per_id[f"a{i}"] in (1, 2) for i in range(10)) and sum(per_id[f"a{i}"] == 2 for i in range(10)) == 5
    assert len({i for i in ids if i.startswith("b")}) == 5  # a subset, no repeats
    again, _ = build_dataset([a, b], tok, eot, PreparationSpec(64, cache_dir=cache, weights=(3, 1), seed=1))
    other, _ = build_dataset([a, b], tok, eot, PreparationSpec(64, cache_dir=cache, weights=(3, 1), seed=2))
    assert list(again["id"]) == ids and list(other["id"]) != ids
    plain, _ = build_dataset([a, b], tok, eot, PreparationSpec(64, cache_dir=cache))
    assert sorted(plain["id"]) == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)])


def test_yaml_list_of_sources_with_weights(tmp_path, tiny_model_dir):
    from sft.config.arguments import parse_args
    from sft.errors import ConfigError

    a, b = _source(tmp_path, "a", 2), _source(tmp_path, "b", 2)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data_path:\n  - {{path: {a}, weight: 0.7}}\n  - {{path: {b}, weight: 0.3}}\n")
    _, d, _, _ = parse_args(["--config", str(cfg), "--model_name_or_path", tiny_model_dir, "--output_dir",
                             str(tmp_path / "o")])
    assert d.data_path == [a, b] and d.data_weights == [0.7, 0.3]
    cfg.write_text(f"data_path:\n  - {{path: {a}, weight: 0.7}}\n  - {{path: {b}}}\n")
    with pytest.raises(ConfigError, match="give every source a 'weight', or none"):
        parse_args(["--config", str(cfg), "--output_dir", str(tmp_path / "o")])
    cfg.write_text(f"data_path:\n  - {{file: {a}}}\n")
    with pytest.raises(ConfigError, match="'data_path' entries must all be mappings with 'path'"):
        parse_args(["--config", str(cfg), "--output_dir", str(tmp_path / "o")])


def test_preparation_spec_maps_the_flags(tmp_path, tiny_model_dir):
    from sft.app.specs import preparation_spec
    from sft.config.arguments import parse_args

    base = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "o"), "--data_path", "a", "b"]
    _, d, t, _ = parse_args(base + ["--data_weights", "0.7", "0.3", "--lazy_preprocess", "True", "--seed", "7"])
    assert preparation_spec(d, t) == PreparationSpec(8192, lazy=True, long_conversations="truncate",
                                                     weights=(0.7, 0.3), seed=7)
    _, d, t, _ = parse_args(base + ["--model_max_length", "64", "--system_message", "Hi.", "--on_bad_record", "skip",
                                    "--data_cache_dir", "c", "--preprocessing_num_workers", "2", "--seed", "7",
                                    "--data_seed", "3", "--data_timeout", "60", "--eval_split_ratio", "0.25",
                                    "--eval_split_seed", "5"])
    assert preparation_spec(d, t) == PreparationSpec(64, "Hi.", "skip", cache_dir="c", num_proc=2, seed=3,
                                                     data_timeout=60.0, eval_split_ratio=0.25, eval_split_seed=5)


def test_show_sample_streams_to_the_record_asked_for(tmp_path, tiny_model_dir, capsys):
    from sft.cli import show_sample_main

    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "bad", "messages": []}] + TOY)  # invalid records are skipped
    assert show_sample_main([tiny_model_dir, path, "--index", "2"]) == 0
    assert capsys.readouterr().out.startswith("record 3 id=hi: ")
    assert show_sample_main([tiny_model_dir, path, "--index", "99"]) == 2
    assert f"--index 99: the file has {len(TOY)} valid records" in capsys.readouterr().err
