#!/usr/bin/env python
"""Data preparation at scale (a benchmark, not a test): wall time, conversations/s and peak RSS per rank.

Writes N conversations (the example's chitchat repeated, every copy with its own id) as JSONL into a
temporary folder, then prepares them as training does (stream + validate + tokenize + Arrow shards,
:func:`sft.dataset.build_dataset`) with 1 and with P processes sharing one cache folder (ranks of one job:
each prepares its shard, then waits for the others' completion markers and memory-maps all shards). Also
measures a plain batched ``tokenizer()`` call on the same rendered texts (a sample of them), the reference of
the "preparation >= 80% of plain tokenizer()" target, and, with ``--before REPO``, the same preparation with
another checkout's ``sft`` (1 process; a checkout from before the sharded preparation loads every record, then
tokenizes on rank 0; a later one is run as this one).

    .venv/bin/python bench/data.py --conversations 1000000 --processes 2
    .venv/bin/python bench/data.py --conversations 200000 --before /path/to/old/checkout

Prints one line per configuration and the machine's load (``uptime``) before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(HERE, ".cache", "example", "smollm2-135m-instruct")
DEFAULT_DATA = os.path.join(HERE, ".cache", "example", "chitchat.jsonl")

# One rank of the job; run as a separate process so that its peak RSS is its own.
_RANK = """
import json, os, resource, sys, time
rank, world, data, model, cache, run, max_len = sys.argv[1:8]
rank, world, max_len = int(rank), int(world), int(max_len)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
t0 = time.perf_counter()
from sft.modeling import load_tokenizer
tok, eot, _ = load_tokenizer(model)
from sft.dataset import build_dataset
if sys.argv[8] == "after":
    from sft.shards import JobView, Plan
    plan = Plan(JobView(rank=rank, world_size=world, local_rank=rank, local_world_size=world), run, True, [0] * world)
    t1 = time.perf_counter()
    ds, report = build_dataset([data], tok, eot, max_len, None, cache, plan=plan, long_conversations=sys.argv[9])
else:  # an older sft: load every record, then build (rank 0 prepares)
    from sft.data import load_conversations
    t1 = time.perf_counter()
    convs = load_conversations(data)
    ds, report = build_dataset(convs, data, tok, eot, max_len, None, cache)
t2 = time.perf_counter()
# VmHWM: this process's own peak. ru_maxrss is not: Linux carries it across exec, so a rank would report at least
# the RSS of the benchmark process it was forked from (which holds the plain tokenizer() sample).
try:
    peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 2**20
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"rank": rank, "samples": len(ds), "startup_s": t1 - t0, "prepare_s": t2 - t1,
                  "peak_rss_gib": peak}))
"""


def write_data(src: str, n: int, out: str) -> None:
    with open(src, encoding="utf-8") as f:
        base = [json.loads(line) for line in f if line.strip()]
    with open(out, "w", encoding="utf-8") as f:
        for i in range(n):
            rec = dict(base[i % len(base)])
            rec["id"] = f"{rec.get('id', 'c')}-{i}"
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def run_ranks(world: int, data: str, model: str, cache: str, max_len: int, mode: str, pythonpath: str,
              long_conversations: str = "split") -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    # cwd = the checkout measured: ``python -c`` puts the working directory first on the module path. Each rank
    # in its own session: with the kernel's autogroup scheduling (sched_autogroup_enabled) the processes of one
    # session share one CPU share, so on a machine shared with other work P ranks of one session get no more CPU
    # than one (measured: 0.98x); separate sessions get what separate jobs get, as ranks do on their own cores.
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), data, model, cache, "bench",
                               str(max_len), mode, long_conversations], env=env, stdout=subprocess.PIPE, text=True, cwd=pythonpath,
                              start_new_session=True)
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    ranks = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    return {"wall_s": wall, "ranks": ranks}


def plain_tokenizer(model: str, data: str, sample: int) -> float:
    """Conversations/s of one batched tokenizer() call on already-rendered texts (the first ``sample``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from sft.data import load_conversations  # a small sample: a list is fine
    from sft.modeling import load_tokenizer

    tok, _, _ = load_tokenizer(model)
    head = os.path.join(os.path.dirname(data), "sample.jsonl")
    with open(data, encoding="utf-8") as f, open(head, "w", encoding="utf-8") as g:
        for _, line in zip(range(sample), f):
            g.write(line)
    texts = [tok.apply_chat_template(c.messages, tokenize=False) for c in load_conversations(head)]
    t0 = time.perf_counter()
    tok(texts, add_special_tokens=False)
    return len(texts) / (time.perf_counter() - t0)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime: not available"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=1_000_000)
    ap.add_argument("--processes", type=int, default=2, help="ranks of the multi-process run")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default=DEFAULT_DATA, help="conversations to repeat")
    ap.add_argument("--max_length", type=int, default=512)
    ap.add_argument("--long_conversations", choices=["split", "truncate"], default="split",
                    help="as the training flag (the 'before' checkout always truncates)")
    ap.add_argument("--plain_sample", type=int, default=20000, help="conversations for the plain tokenizer() figure")
    ap.add_argument("--before", default=None, help="a checkout whose sft is measured too (1 process)")
    ap.add_argument("--runs", nargs="+", default=["one", "many", "before"], choices=["one", "many", "before"],
                    help="one: 1 process; many: --processes processes; before: --before's sft, 1 process")
    ap.add_argument("--work", default=None, help="folder for data and caches (default: a new temporary one, removed)")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="sft-bench-data-")
    try:
        print(f"load before: {uptime()}", flush=True)
        data = os.path.join(work, "data.jsonl")
        t0 = time.perf_counter()
        write_data(a.data, a.conversations, data)
        print(f"wrote {a.conversations} conversations ({os.path.getsize(data) / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        plain = plain_tokenizer(a.model, data, min(a.plain_sample, a.conversations))
        print(f"plain batched tokenizer() on rendered texts: {plain:.0f} conversations/s (1 process)", flush=True)
        configs = [c for run, c in (("one", ("after", 1, HERE)), ("many", ("after", a.processes, HERE)),
                                    ("before", ("before", 1, a.before))) if run in a.runs and c[2]]
        single = None
        for mode, world, repo in configs:
            # a checkout with the sharded preparation (e.g. main before a speed-up) is called as this one
            api = "after" if mode == "after" or os.path.exists(os.path.join(repo, "sft", "shards.py")) else "before"
            cache = os.path.join(work, f"cache-{mode}-{world}")
            r = run_ranks(world, data, a.model, cache, a.max_length, api, repo, a.long_conversations)
            prep = max(x["prepare_s"] for x in r["ranks"])  # from the tokenizer loaded to every shard mapped
            rate = a.conversations / prep
            single = rate if (mode, world) == ("after", 1) else single
            extra = ""
            if world == 1:
                extra = f"; {100 * rate / plain:.0f}% of plain tokenizer()"
            elif mode == "after" and single:
                extra = f"; {rate / single:.2f}x one process"
            rss = ", ".join(f"rank {x['rank']} {x['peak_rss_gib']:.2f} GiB" for x in r["ranks"])
            print(f"{mode} ({repo}), {world} process(es): {prep:.0f} s preparing ({r['wall_s']:.0f} s with start-up), "
                  f"{rate:.0f} conversations/s{extra}; "
                  f"peak RSS {rss}; samples {r['ranks'][0]['samples']}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
        print(f"load after: {uptime()}", flush=True)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
