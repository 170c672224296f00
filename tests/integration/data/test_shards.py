"""Preparation shared by the ranks of a job: shards, completion and failure markers, --data_timeout, bounded memory.

Ranks are threads here (each with its own :class:`sft.data.store.shards.ShardPlan`, as
:func:`sft.data.store.shards.agree` gives
them);
tests/cluster/test_multinode.py runs the same with real torchrun processes on two namespace hosts.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from sft.data.spec import PreparationSpec
from sft.data.store.dataset import build_dataset
from sft.data.store.shards import JobView, ShardPlan, shard_name
from sft.errors import DataError
from tests.helpers.data import TOY, write_jsonl
from tests.helpers.paths import ROOT


def _plan(rank, world=2, shared=True, run="run1", nodes=None):
    nodes = nodes or list(range(world))
    return ShardPlan(JobView(rank=rank, world_size=world, local_rank=0, local_world_size=1, node_rank=nodes[rank],
                        host=f"host{nodes[rank]}"), run, shared, nodes)


def _ranks(fn, world=2):
    """Run ``fn(rank)`` in one thread per rank; return {rank: result or exception}."""
    out = {}

    def body(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[r] = e
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_each_rank_prepares_its_shard_and_every_rank_maps_all(tmp_path, qwen_tok):
    tok, eot = qwen_tok
    path, cache = write_jsonl(tmp_path / "d.jsonl", TOY), str(tmp_path / "c")
    one, _ = build_dataset([path], tok, eot, PreparationSpec(128, cache_dir=str(tmp_path / "single")))
    spec = PreparationSpec(128, cache_dir=cache, data_timeout=60)
    got = _ranks(lambda r: build_dataset([path], tok, eot, spec, plan=_plan(r)))
    (key,) = os.listdir(cache)
    markers = [json.load(open(os.path.join(cache, key, shard_name(k, 2) + ".done"))) for k in range(2)]
    assert [m["dir"].rsplit("-", 1)[1] for m in markers] == ["0", "1"]  # shard k was written by rank k
    assert [m["check"]["records"] for m in markers] == [4, 4]
    for r in range(2):
        ds, report = got[r]
        assert sorted(ds["id"]) == sorted(one["id"]) and report.samples == len(TOY)
        by_id = {x["id"]: x["input_ids"] for x in one}
        assert all(x["input_ids"] == by_id[x["id"]] for x in ds)
    assert [os.path.basename(f["filename"]) for f in ds.cache_files] == ["part-00.arrow"] * 2  # memory-mapped


def test_node_local_cache_has_every_node_prepare_every_shard():
    assert _plan(1, world=2, shared=False).mine(2) == [0, 1]
    assert _plan(1, world=2, shared=True).mine(2) == [1]
    four = ShardPlan(JobView(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1), "r", False,
                     [0, 0, 1, 1])
    assert four.mine(4) == [1, 3] and four.preparers(4)[0] == [0, 2]


def test_a_failed_rank_stops_every_rank_with_its_message(tmp_path, qwen_tok):
    tok, eot = qwen_tok
    bad = {"id": "broken-7", "conversations": [{"from": "robot", "value": "x"}]}
    path, cache = write_jsonl(tmp_path / "d.jsonl", [bad] + TOY[1:4]), str(tmp_path / "c")
    spec = PreparationSpec(128, cache_dir=cache, data_timeout=60)
    got = _ranks(lambda r: build_dataset([path], tok, eot, spec, plan=_plan(r)))
    assert isinstance(got[0], DataError) and "record 0, id='broken-7', turn 0: unknown role 'robot'" in str(got[0])
    assert isinstance(got[1], DataError)
    assert str(got[1]).startswith(f"rank 0 (node 0, host host0) could not prepare shard 0 of 2 of {path}: {path}: "
                                  "1 invalid record(s) of 2:")
    # the failure belongs to that run: a later run (fixed nothing, new run id) prepares and fails again itself
    (key,) = os.listdir(cache)
    assert not os.path.exists(os.path.join(cache, key, shard_name(0, 2) + ".done"))
    skip = PreparationSpec(128, on_bad_record="skip", cache_dir=cache, data_timeout=60)
    again = _ranks(lambda r: build_dataset([path], tok, eot, skip, plan=_plan(r, run="run2")))
    assert sorted(again[1][0]["id"]) == sorted(r["id"] for r in TOY[1:4])


def test_waiting_is_bounded_by_data_timeout_and_names_what_is_awaited(tmp_path, qwen_tok):
    tok, eot = qwen_tok
    path, cache = write_jsonl(tmp_path / "d.jsonl", TOY), str(tmp_path / "c")
    start = time.monotonic()
    with pytest.raises(DataError) as e:  # rank 1 of 2 on node 1; rank 0 (node 0) never comes
        build_dataset([path], tok, eot, PreparationSpec(128, cache_dir=cache, data_timeout=1.5), plan=_plan(1))
    assert 1.5 <= time.monotonic() - start < 30
    assert (f"rank 1: shard(s) 0 of 2 of {path} from node(s) 0 (rank(s) 0) not prepared within --data_timeout 1.5 s"
            in str(e.value))


_KILLABLE = """
import sys
from sft.data.store.dataset import build_dataset
from sft.data.spec import PreparationSpec
from sft.model.loading import load_tokenizer
tok, eot, _ = load_tokenizer(sys.argv[1])
build_dataset([sys.argv[2]], tok, eot, PreparationSpec(256, cache_dir=sys.argv[3]))
"""


def test_a_preparation_killed_midway_is_redone_not_trusted(tmp_path, qwen_tok, tiny_model_dir):
    tok, eot = qwen_tok
    rows = [dict(r, id=f"{r['id']}-{i}") for i in range(400) for r in TOY]
    path, cache = write_jsonl(tmp_path / "d.jsonl", rows), str(tmp_path / "c")
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE, tiny_model_dir, path, cache], cwd=ROOT)
    part = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # kill it once it has written some samples
        found = [os.path.join(d, f, "part-00.arrow") for d in [os.path.join(cache, k) for k in os.listdir(cache)]
                 for f in os.listdir(d) if ".tmp-" in f] if os.path.isdir(cache) else []
        if found and os.path.exists(found[0]) and os.path.getsize(found[0]) > 20000:
            part = found[0]
            break
        time.sleep(0.05)
    assert part is not None, "the preparation finished (or failed) before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    (key,) = os.listdir(cache)
    assert not any(f.endswith(".done") for f in os.listdir(os.path.join(cache, key)))
    ds, report = build_dataset([path], tok, eot, PreparationSpec(256, cache_dir=cache))
    assert len(ds) == report.samples == len(rows) and len(set(ds["id"])) == len(rows)
    marker = json.load(open(os.path.join(cache, key, shard_name(0, 1) + ".done")))
    assert ".tmp-" not in marker["dir"] and os.path.dirname(part) != os.path.join(cache, key, marker["dir"])


_UNDER_LIMIT = """
import json, resource, sys
mode, path, limit_mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "prepare":
    from sft.data.store.dataset import build_dataset
    from sft.data.spec import PreparationSpec
    from sft.model.loading import load_tokenizer
    tok, eot, _ = load_tokenizer(sys.argv[4])
from sft.data.records.records import RecordCheck, iter_conversations
data_kb = int([l for l in open("/proc/self/status") if l.startswith("VmData")][0].split()[1])
resource.setrlimit(resource.RLIMIT_DATA, ((data_kb // 1024 + limit_mb) << 20,) * 2)
if mode == "old":  # what main did: the whole file, then every record as Python objects
    raw = open(path, "rb").read()
    records = [json.loads(line) for line in raw.split(b"\\n") if line.strip()]
    print("loaded", len(records))
elif mode == "stream":
    check = RecordCheck(path)
    print("loaded", sum(1 for _ in iter_conversations(path, check)))
else:
    ds, report = build_dataset([path], tok, eot, PreparationSpec(64, cache_dir=sys.argv[5]))
    print("loaded", len(ds))
"""


def test_memory_is_bounded_for_real_under_a_data_limit(tmp_path, tiny_model_dir):
    """A file that main's way of loading cannot hold under RLIMIT_DATA (heap + anonymous maps) of 100 MiB above
    the start streams through validation and preparation (the Arrow shards are file-backed maps)."""
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
           "meta": "x" * 60000}  # extra keys are allowed; they make records big without tokens to pay for
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(2500):  # 150 MB
            f.write(json.dumps(dict(row, id=f"r{i}")) + "\n")

    def run(*args):
        # one tokenizer thread: a thread pool's stacks would count against the limit by the machine's core count
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, "-c", _UNDER_LIMIT, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=env)
    old = run("old", str(path), "100")
    assert old.returncode != 0 and "MemoryError" in old.stderr
    assert run("stream", str(path), "100").stdout.split() == ["loaded", "2500"]
    prepared = run("prepare", str(path), "100", tiny_model_dir, str(tmp_path / "c"))
    assert prepared.stdout.split()[-2:] == ["loaded", "2500"], prepared.stderr[-2000:]


def test_preprocessing_workers_split_a_shard_and_give_the_same_samples(tmp_path, qwen_tok, caplog):
    tok, eot = qwen_tok
    path = write_jsonl(tmp_path / "d.jsonl", TOY + [TOY[0]])  # "add" twice
    one, _ = build_dataset([path], tok, eot, PreparationSpec(128, cache_dir=str(tmp_path / "one")))
    two, report = build_dataset([path], tok, eot, PreparationSpec(128, cache_dir=str(tmp_path / "two"), num_proc=2))
    assert report.samples == len(TOY) + 1
    assert sorted(zip(two["id"], two["input_ids"])) == sorted(zip(one["id"], one["input_ids"]))
    (key,) = os.listdir(tmp_path / "two")
    marker = json.load(open(tmp_path / "two" / key / (shard_name(0, 1) + ".done")))
    assert marker["parts"] == ["part-00.arrow", "part-01.arrow"]
    assert "1 id(s) appear more than once (e.g. 'add')" in caplog.text


def _records(n=23):
    """``n`` distinct records; every fifth a long multi-turn one that --long_conversations split cuts into samples."""
    out = []
    for i in range(n):
        turns = 6 if i % 5 == 0 else 1
        msgs = []
        for t in range(turns):
            msgs += [{"role": "user", "content": f"item {i} question {t}: " + "tell me more " * 3},
                     {"role": "assistant", "content": f"answer {t} for item {i}: " + "here it is " * 3}]
        out.append({"id": f"r{i}", "messages": msgs})
    return out


def _rows(ds):
    return [json.dumps(x, sort_keys=True) for x in ds]  # every column (eager: ids and labels; lazy: messages)


@pytest.mark.parametrize("lazy", [False, True])
def test_the_dataset_is_the_same_row_for_row_for_any_number_of_preparing_ranks(tmp_path, qwen_tok, lazy):
    """World-size-independent data: 1 (with 2 part workers), 2 and 3 preparing ranks give the rows in record order,
    the samples of a split conversation in order; mixing by weight picks the same rows."""
    tok, eot = qwen_tok
    a = write_jsonl(tmp_path / "a.jsonl", _records())
    b = write_jsonl(tmp_path / "b.jsonl", _records(7))
    kw = dict(lazy=lazy, weights=(0.7, 0.3), seed=3, data_timeout=60)
    one, _ = build_dataset([a, b], tok, eot, PreparationSpec(64, cache_dir=str(tmp_path / "w1"), **kw))
    one = one.records if lazy else one
    if not lazy:  # the split mode is exercised: some records have several samples, in order
        ids = one["id"]
        assert len(ids) > len(set(ids)) and one["record"][:2] == [0, 0]
    # (ranks are threads here, so part workers only with one rank: the forked workers find their job in a global)
    for world, num_proc in ((1, 2), (2, None), (3, None)):
        spec = PreparationSpec(64, cache_dir=str(tmp_path / f"w{world}-{num_proc}"), num_proc=num_proc, **kw)
        got = _ranks(lambda r: build_dataset([a, b], tok, eot, spec, plan=_plan(r, world)), world)
        for r in range(world):
            assert not isinstance(got[r], Exception), got[r]
            ds = got[r][0].records if lazy else got[r][0]
            assert _rows(ds) == _rows(one), (world, r)


def test_a_cache_prepared_at_one_world_size_is_reused_at_another(tmp_path, qwen_tok):
    tok, eot = qwen_tok
    path, cache = write_jsonl(tmp_path / "d.jsonl", _records(9)), str(tmp_path / "c")
    two = _ranks(lambda r: build_dataset([path], tok, eot, PreparationSpec(64, cache_dir=cache, data_timeout=60),
                                         plan=_plan(r, 2)))
    one, _ = build_dataset([path], tok, eot, PreparationSpec(64, cache_dir=cache), plan=_plan(0, 1))
    (key,) = os.listdir(cache)
    assert not [n for n in os.listdir(os.path.join(cache, key)) if "-of-00001" in n]  # nothing prepared again
    assert _rows(one) == _rows(two[0][0]) and [x["record"] for x in one] == sorted(x["record"] for x in one)
